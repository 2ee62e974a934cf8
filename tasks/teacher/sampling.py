"""Sampled teacher targets inside the chunked pass: an exact top-H head plus S tokens sampled outside it.

What is stored and why the weights are unbiased: `kdflow.tasks.common.sampled`. Here, for `chunk_tokens`
rows at a time and optionally vocabulary slabs (the slab loop: `kdflow.tasks.teacher.slab`), every token id j
of a position gets a key z_j + noise_j; the head is the top-H of the logits, the sample the S largest keys
outside the head, the threshold the (S+1)-th. `[rows, seq, vocab]` never exists: per chunk one float32
logits buffer (shared with the top-K pass) and two 8-byte buffers (the noise and its scratch), reused.

Slabs merge exactly: the head is a top-H (merged like a top-K), and the S+1 largest tail keys are always
among the H+S+1 largest keys overall, so each slab keeps that many. Ordering is (value desc, id asc)
everywhere, so ties go to the lower id whatever the cut. Log-sum-exps are float64; the tail's is the sum
of each slab's mass outside its own top-H plus what falls out of the running head, never `1 - sum`.

The noise is a counter-based hash of (seed, shard, row, position, token id) (`sampling_noise`), not
torch's RNG: it does not depend on the chunk, the slab, the micro-batch or the device, so a rerun or a
retry after a GPU reset writes the same shard, given the same logits. (Logits themselves are the same for
the same config, device type and torch version; a GEMM of another shape may round differently and flip a
near-tie.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kdflow.schemas.config import PrecomputeConfig
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.sampled_settings import HASH_VERSION, HASH_VERSIONS, SCHEMES
from kdflow.tasks.common.models import LogitTransform, text_config
from kdflow.tasks.common.sampled import SampledTargets, cat_targets
from kdflow.tasks.teacher.sampling_noise import (key_noise_, position_streams, stream_words, token_keys, token_keys32,
                                                 uniform_noise32_, uniform_noise_)
from kdflow.tasks.teacher.slab import TeacherSlabs, split_logsumexp_

__all__ = ["SAMPLER_BYTES_PER_LOGIT", "RunningSample", "SamplingPlan", "check_sampling_fits",
           "chunked_sampled", "finish_targets", "merge_ordered", "sample_slabs", "top_ordered"]

# Bytes per (row, id) the sampler holds, in units of topk.choose_chunk_tokens' `logits_dtype_bytes`
# (which it doubles): float32 logits, the float64 noise/keys, its int64 scratch, a bool mask: ~24 bytes.
SAMPLER_BYTES_PER_LOGIT = 12


@dataclass(frozen=True)
class SamplingPlan:
    """What one store's sampled targets are: head size H (0 for `sampled`), samples S, scheme, seed, and the noise
    hash that draws them (`sampling_noise`)."""

    head: int
    samples: int
    scheme: str = "priority"
    seed: int = 0
    hash_version: str = HASH_VERSION

    @property
    def kind(self) -> str:
        return "hybrid" if self.head else "sampled"

    @property
    def candidates(self) -> int:
        return self.head + self.samples + 1

    @classmethod
    def from_config(cls, precompute: PrecomputeConfig) -> SamplingPlan:
        if precompute.targets == "topk":
            raise ValueError("precompute.targets is topk: there is nothing to sample")
        sampling = precompute.sampling
        head = sampling.head if precompute.targets == "hybrid" else 0
        return cls(head=head, samples=sampling.samples, scheme=sampling.scheme, seed=sampling.seed,
                   hash_version=sampling.hash_version)

    def check(self, vocab_size: int) -> None:
        """ValueError (one line, naming the setting) unless 0 <= H, 1 <= S, H + S <= V, a known scheme."""
        if self.samples < 1:
            raise ValueError(f"precompute.sampling.samples must be >= 1, got {self.samples}")
        if self.head < 0:
            raise ValueError(f"precompute.sampling.head must be >= 0, got {self.head}")
        if self.head + self.samples > vocab_size:
            raise ValueError(f"precompute.sampling.head + samples = {self.head} + {self.samples} must be <= the "
                             f"teacher's vocabulary size {vocab_size}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"precompute.sampling.scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.hash_version not in HASH_VERSIONS:
            raise ValueError(f"precompute.sampling.hash_version must be one of {HASH_VERSIONS}, "
                             f"got {self.hash_version!r}")


def check_sampling_fits(precompute: PrecomputeConfig, teacher: object) -> None:
    """Pre-flight (before weights load): sampled/hybrid targets fit the teacher's vocabulary (`teacher`: its
    vocabulary size, or its model config)."""
    teacher = text_config(teacher)
    vocab_size = teacher if isinstance(teacher, int) else getattr(teacher, "vocab_size", None)
    if precompute.targets == "topk" or vocab_size is None:
        return
    try:
        SamplingPlan.from_config(precompute).check(vocab_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None


# --- ordered top lists ------------------------------------------------------------------------------------


def _ordered(values: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Sort each row of (values, ids) (c, k) by value desc, then id asc."""
    ids, by_id = ids.sort(dim=1)
    values = values.gather(1, by_id)
    values, by_value = values.sort(dim=1, descending=True, stable=True)
    return values, ids.gather(1, by_value)


def top_ordered(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k of values (c, s) in the order (value desc, column asc) -> values (c, k'), columns (c, k').

    torch.topk breaks ties arbitrarily; when ties straddle the k-th place the lowest columns win here.
    """
    k = min(k, values.shape[1])
    top, cols = torch.topk(values, k, dim=1, sorted=True)  # (c, k)
    if k == 0:
        return top, cols
    edge = top[:, -1:]  # (c, 1)
    if bool(((values >= edge).sum(1) > k).any()):
        above, at_edge = values > edge, values == edge
        room = k - above.sum(1, keepdim=True)  # (c, 1) places left for values at the edge
        chosen = above | (at_edge & (at_edge.cumsum(1) <= room))
        cols = chosen.nonzero()[:, 1].view(values.shape[0], k)  # ascending columns per row
        top = values.gather(1, cols)
    return _ordered(top, cols)


def merge_ordered(first: tuple[Tensor, ...], second: tuple[Tensor, ...], k: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """Top-k of two ordered lists (values, ids, payload...) whose ids in `first` all precede `second`'s.

    A stable descending sort of the concatenation keeps (value desc, id asc). -> the kept lists and the
    positions (c, rest) of the dropped entries in the concatenation.
    """
    joined = [torch.cat([a, b], dim=1) for a, b in zip(first, second, strict=True)]
    order = torch.sort(joined[0], dim=1, descending=True, stable=True).indices  # (c, k1 + k2)
    return tuple(t.gather(1, order[:, :k]) for t in joined), order[:, k:]


# --- one block of rows, slab by slab ----------------------------------------------------------------------


class _Workspace:
    """Two flat 8-byte buffers for the noise of one (rows, slab) block, allocated once per call."""

    def __init__(self, rows: int, cols: int, device: torch.device) -> None:
        self.bits = torch.empty(rows * cols, dtype=torch.int64, device=device)
        self.noise = torch.empty(rows * cols, dtype=torch.int64, device=device)

    def views(self, rows: int, cols: int) -> tuple[Tensor, Tensor]:
        return self.bits[: rows * cols].view(rows, cols), self.noise[: rows * cols].view(rows, cols)

    def keys(self, plan: SamplingPlan, streams: Tensor, logits: Tensor, first_id: int) -> tuple[Tensor, Tensor]:
        """logits (c, s) + noise -> (keys (c, s): float32 for kdflow.2, float64 for kdflow.1; a (c, s) float64
        scratch for the exponentials, free once the keys are read: the keys' own buffer for kdflow.1)."""
        rows, width = logits.shape
        if plan.hash_version == "kdflow.1":
            bits, noise = self.views(rows, width)
            uniform = uniform_noise_(streams, token_keys(first_id, width, logits.device), bits, noise)
            keys = key_noise_(uniform, plan.scheme).add_(logits)
            return keys, keys
        halves = self.bits[: rows * width].view(torch.int32)  # two int32 buffers in the first 8-byte one
        uniform = uniform_noise32_(stream_words(streams), token_keys32(first_id, width, logits.device),
                                   halves[: rows * width].view(rows, width), halves[rows * width:].view(rows, width))
        keys = key_noise_(uniform, plan.scheme).add_(logits)
        return keys, self.noise[: rows * width].view(torch.float64).view(rows, width)


class RunningSample:
    """Head, key candidates and log-sum-exps of a block of rows, accumulated over vocabulary slabs in id order."""

    def __init__(self, plan: SamplingPlan, streams: Tensor, workspace: _Workspace | None = None) -> None:
        self.plan, self.streams, self.workspace = plan, streams, workspace  # streams (c,) int64
        self.next_id = 0
        self.head: tuple[Tensor, Tensor] | None = None  # logits (c, <=H), ids (c, <=H) int64
        self.keys: tuple[Tensor, Tensor, Tensor] | None = None  # keys, ids, logits (c, <=H+S+1)
        self.lse: Tensor | None = None  # (c,) float64, over every id seen
        self.tail_lse: Tensor | None = None  # (c,) float64, over every id seen minus the running head

    def add(self, logits: Tensor, first_id: int) -> None:
        """Fold in one slab's float32 logits (c, s) for ids first_id.. (not modified)."""
        if first_id != self.next_id:
            raise ValueError(f"slabs must be contiguous and in id order: expected first id {self.next_id}, "
                             f"got {first_id}")
        rows, width = logits.shape
        self.next_id += width
        workspace = self.workspace or _Workspace(rows, width, logits.device)
        keys, scratch = workspace.keys(self.plan, self.streams, logits, first_id)  # (c, s)
        key_top, key_cols = top_ordered(keys, self.plan.candidates)
        slab_keys = (key_top, key_cols + first_id, logits.gather(1, key_cols))
        head_top, head_cols = top_ordered(logits, self.plan.head)  # (c, h)
        # float64 exponentials (in a scratch free once the keys are read), so that the slab's max, which depends
        # on the cut, moves the sums by float64 rounding only.
        lse, tail_lse = split_logsumexp_(logits, head_cols, exp=scratch)
        self._merge((head_top, head_cols + first_id), slab_keys, lse, tail_lse)

    def _merge(self, slab_head: tuple[Tensor, Tensor], slab_keys: tuple[Tensor, Tensor, Tensor],
               lse: Tensor, tail_lse: Tensor) -> None:
        if self.head is None:
            self.head, self.keys, self.lse, self.tail_lse = slab_head, slab_keys, lse, tail_lse
            return
        self.keys, _ = merge_ordered(self.keys, slab_keys, self.plan.candidates)
        joined_logits = torch.cat([self.head[0], slab_head[0]], dim=1)  # (c, h1 + h2)
        self.head, dropped = merge_ordered(self.head, slab_head, self.plan.head)
        self.tail_lse = torch.logaddexp(self.tail_lse, tail_lse)
        if dropped.shape[1]:  # fell out of the running head: tail now
            self.tail_lse = torch.logaddexp(self.tail_lse, joined_logits.gather(1, dropped).double().logsumexp(1))
        self.lse = torch.logaddexp(self.lse, lse)

    def finish(self, vocab_size: int) -> SampledTargets:
        """The block's targets once slabs covering ids 0..vocab_size-1 are in (float32 values)."""
        if self.next_id != vocab_size or self.head is None:
            raise ValueError(f"slabs cover ids 0..{self.next_id - 1}, not the vocabulary of {vocab_size}")
        if not bool(torch.isfinite(self.lse).all()):
            raise ValueError("teacher logits have NaN or +inf entries, or a row without a finite logit")
        return finish_targets(self.plan, self.head, self.keys, self.lse, self.tail_lse)


def finish_targets(plan: SamplingPlan, head: tuple[Tensor, Tensor], keys: tuple[Tensor, Tensor, Tensor],
                   lse: Tensor, tail_lse: Tensor) -> SampledTargets:
    """A block's targets from its head (logits, ids) (c, H), its largest keys (keys, ids, logits) (c, L) in the order
    (key desc, id asc), L = min(H + S + 1, V), its log-sum-exp and that outside the head (c,)."""
    head_logits, head_ids = head
    keys, key_ids, key_logits = keys
    in_head = (key_ids[:, :, None] == head_ids[:, None, :]).any(2)  # (c, L)
    tail_first = torch.sort(in_head.to(torch.int8), dim=1, stable=True).indices  # keeps key order
    keys, key_ids, key_logits = (t.gather(1, tail_first) for t in (keys, key_ids, key_logits))
    samples = plan.samples
    n_tail = (~in_head).sum(1)  # (c,): S + 1, or S when the tail has only S tokens
    kappa = torch.where(n_tail > samples, keys[:, min(samples, keys.shape[1] - 1)], -torch.inf)  # (c,)
    tail_lse = tail_lse if plan.head else lse
    return SampledTargets(
        head_ids=head_ids.to(torch.int32),
        head_logprobs=(head_logits.double() - lse[:, None]).float(),
        tail_logprob=(tail_lse - lse).float(),
        sample_ids=key_ids[:, :samples].to(torch.int32),
        sample_logprobs=(key_logits[:, :samples].double() - lse[:, None]).float(),
        log_threshold=(kappa.double() - lse).float(),
    )


@torch.inference_mode()
def sample_slabs(slabs: Iterable[tuple[int, Tensor]], plan: SamplingPlan, streams: Tensor,
                 vocab_size: int) -> SampledTargets:
    """Sampled targets of one block of rows from its float32 logits, given as (first id, (c, s)) slabs in id order."""
    plan.check(vocab_size)
    running = RunningSample(plan, streams)
    for first_id, logits in slabs:
        running.add(logits.float(), first_id)
    return running.finish(vocab_size)


@torch.inference_mode()
def chunked_sampled(
    hidden: Tensor, lm_head: nn.Module | Tensor, plan: SamplingPlan, chunk_tokens: int, *, shard: int, rows: Tensor,
    positions: Tensor, vocab_chunk: int | None = None, logit_transform: LogitTransform | None = None,
) -> SampledTargets:
    """Sampled targets for hidden (N, D), `chunk_tokens` rows at a time; lm_head as in `chunked_topk`.

    rows (N,) and positions (N,) name each token (sequence index in the shard, position in the sequence):
    with (plan.seed, shard) they seed its noise, so the result does not depend on chunk_tokens, vocab_chunk
    or how the shard is cut into micro-batches. Returns (N, ...) fields on hidden's device.
    """
    slabs = TeacherSlabs(hidden, lm_head, chunk_tokens, vocab_chunk=vocab_chunk)
    if rows.shape != (hidden.shape[0],) or positions.shape != rows.shape:
        raise ValueError(f"rows and positions must be ({hidden.shape[0]},), "
                         f"got {tuple(rows.shape)}, {tuple(positions.shape)}")
    plan.check(slabs.vocab_size)
    targets = _SampledTargets(plan, shard, rows, positions, slabs.vocab_size,
                              _Workspace(slabs.rows, slabs.cols, hidden.device))
    slabs.run(targets, logit_transform)
    if not targets.parts:
        empty = (hidden.new_empty((0, plan.head), dtype=torch.int32),
                 hidden.new_empty((0, plan.samples), dtype=torch.int32))
        zero = hidden.new_empty(0, dtype=torch.float32)
        return SampledTargets(empty[0], empty[0].float(), zero, empty[1], empty[1].float(), zero)
    return cat_targets(targets.parts)


class _SampledTargets:
    """The sampled targets of every row (`kdflow.tasks.teacher.slab.SlabTargets`), one part per block of rows."""

    def __init__(self, plan: SamplingPlan, shard: int, rows: Tensor, positions: Tensor, vocab_size: int,
                 workspace: _Workspace) -> None:
        self.plan, self.shard, self.rows, self.positions = plan, shard, rows, positions
        self.vocab_size, self.workspace = vocab_size, workspace
        self.parts: list[SampledTargets] = []

    def block(self, start: int, stop: int) -> RunningSample:
        streams = position_streams(self.plan.seed, self.shard, self.rows[start:stop],
                                   self.positions[start:stop])  # (c,)
        return RunningSample(self.plan, streams, self.workspace)

    def gather(self, running: RunningSample, start: int, stop: int) -> None:
        self.parts.append(running.finish(self.vocab_size))
