"""The teacher's top-K over the full vocabulary, without ever holding (tokens, vocab) logits.

The slab loop (`kdflow.tasks.teacher.slab`) hands us each block of rows' float32 logits, slab by slab; from
each we take the top-K and the log-sum-exp, and slabs (`vocab_chunk`) merge their top-Ks and log-sum-exps:
the same result as one pass over the whole vocabulary, in less memory per row.

The tail (the teacher's mass outside its top-K) comes from the same pass, never as 1 - sum(exp(top-K)):
the top-K entries of the exp buffer are zeroed before the one sum over the vocabulary, which gives the
complement's sum directly; the full sum is that plus the K top terms (a sum of positive numbers, no
cancellation). Slabs merge their complements plus the candidates the merged top-K drops.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kdflow.schemas.config import PrecomputeConfig
from kdflow.tasks.common.models import LogitTransform, final_logit_transform, output_layer
from kdflow.tasks.teacher.fused_moe import teacher_body_runner
from kdflow.tasks.teacher.slab import TeacherSlabs, split_logsumexp_
from kdflow.tasks.teacher.tiled_topk import (TILED_HEADS, float32_head, tiled_head_fits, tiled_head_topk,
                                             tiled_variant)

# Memory per chunk row, counted in logits rows: the float32 logits themselves plus as much again for the
# compute-dtype logits (bf16 is half a row) and the scratch of topk.
_WORKING_LOGITS_COPIES = 2


def choose_chunk_tokens(
    vocab_size: int,
    budget_bytes: int,
    *,
    logits_dtype_bytes: int = 4,
    minimum: int = 64,
    multiple: int = 64,
) -> int:
    """Rows per chunk whose logits (plus ~the same again of temporaries) fit `budget_bytes`.

    vocab_size: logits per row of one chunk (the vocabulary, or chunked_topk's vocab_chunk).
    Rounded down to `multiple` (matmul-friendly), never below `minimum` (too few rows starve the matmul).
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
    if logits_dtype_bytes < 1 or minimum < 1 or multiple < 1:
        raise ValueError(
            f"logits_dtype_bytes, minimum and multiple must be >= 1, got {logits_dtype_bytes}, {minimum}, {multiple}"
        )
    bytes_per_row = vocab_size * logits_dtype_bytes * _WORKING_LOGITS_COPIES
    rows = budget_bytes // bytes_per_row
    rows = (rows // multiple) * multiple
    return max(minimum, rows)


def topk_chunk_tokens(precompute: PrecomputeConfig, vocab_size: int) -> int:
    """Rows per chunk of the top-K pass: `precompute.chunk_tokens`, else as many as `precompute.chunk_memory_mib`
    holds (`choose_chunk_tokens`; sampled targets: `sampled_pass.sampled_chunk_tokens`)."""
    return precompute.chunk_tokens or choose_chunk_tokens(vocab_size, precompute.chunk_memory_mib << 20)


class _RunningTopk:
    """Top-K logits, their ids, the log-sum-exp and the log-sum-exp outside the top-K of a block of rows,
    accumulated over vocabulary slabs."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.top_logits: Tensor | None = None  # (c, <=K)
        self.top_ids: Tensor | None = None  # (c, <=K) int64
        self.log_normaliser: Tensor | None = None  # (c,)
        self.log_rest: Tensor | None = None  # (c,) log-sum-exp of the logits outside top_ids

    def add(self, logits: Tensor, first_id: int) -> None:
        """Fold in one slab's float32 logits (c, s); the slab's logits are destroyed."""
        slab_logits, slab_ids = torch.topk(logits, min(self.k, logits.shape[1]), dim=1, sorted=True)  # (c, k')
        # In place on the slab's float32 logits; the row max comes free from the sorted top-K.
        slab_log_normaliser, slab_log_rest = split_logsumexp_(logits, slab_ids, exp=logits,
                                                              row_max=slab_logits[:, 0])  # (c,), (c,)
        if first_id:
            slab_ids += first_id
        if self.top_logits is None:  # the first (with the default, the only) slab: nothing to merge
            self.top_logits, self.top_ids = slab_logits, slab_ids
            self.log_normaliser, self.log_rest = slab_log_normaliser, slab_log_rest
            return
        # The top-K of a union is the top-K of the parts' top-Ks; the candidates it drops join the rest.
        candidates = torch.cat([self.top_logits, slab_logits], dim=1)  # (c, <=2K)
        self.top_logits, positions = torch.topk(candidates, min(self.k, candidates.shape[1]), dim=1, sorted=True)
        self.top_ids = torch.cat([self.top_ids, slab_ids], dim=1).gather(1, positions)
        dropped = candidates.scatter(1, positions, float("-inf")).logsumexp(dim=1)  # (c,); -inf: none dropped
        rest = torch.stack([self.log_rest, slab_log_rest, dropped]).logsumexp(dim=0)
        self.log_normaliser = torch.logaddexp(self.log_normaliser, slab_log_normaliser)
        self.log_rest = rest


class _TopkTargets:
    """The top-K targets of every row (`kdflow.tasks.teacher.slab.SlabTargets`), written block by block."""

    def __init__(self, n_tokens: int, k: int, device: torch.device) -> None:
        self.k = k
        self.topk_ids = torch.empty((n_tokens, k), dtype=torch.int32, device=device)  # (N, K)
        self.topk_logprobs = torch.empty((n_tokens, k), dtype=torch.float32, device=device)  # (N, K)
        self.tail_logprob = torch.empty((n_tokens,), dtype=torch.float32, device=device)  # (N,)

    def block(self, start: int, stop: int) -> _RunningTopk:
        return _RunningTopk(self.k)

    def gather(self, running: _RunningTopk, start: int, stop: int) -> None:
        torch.sub(running.top_logits, running.log_normaliser[:, None], out=self.topk_logprobs[start:stop])
        torch.sub(running.log_rest, running.log_normaliser, out=self.tail_logprob[start:stop])
        self.topk_ids[start:stop].copy_(running.top_ids)


@torch.inference_mode()
def chunked_topk(
    hidden: Tensor,
    lm_head: nn.Module | Tensor,
    k: int,
    chunk_tokens: int,
    *,
    vocab_chunk: int | None = None,
    logit_transform: LogitTransform | None = None,
    return_tail: bool = False,
    workspace: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Top-K token ids and log-probabilities (normalised over the full vocabulary) for each row of hidden.

    hidden (N, H); lm_head a module (called as is unless it is a plain nn.Linear) or a weight (V, H).
    Returns topk_ids (N, K) int32 and topk_logprobs (N, K) float32, sorted by descending log-probability,
    on hidden's device; with `return_tail` also tail_logprob (N,) float32, the log of the mass outside the
    top-K (log-sum-exp over the complement minus the full one; -inf when K = V). Logits are computed in the
    weight's dtype and upcast to float32; a float32 weight with lower-precision hidden states upcasts each chunk
    of hidden states first (`teacher.lm_head_float32`).
    vocab_chunk (plain weights only): also cut the vocabulary into slabs of this many ids and merge their
    top-K and log-sum-exp. It lets a CPU take many rows per chunk (each chunk streams the whole weight from
    memory once) in the same memory; on a GPU the default, the whole vocabulary at once, is the fast choice.
    workspace: a dict the caller keeps between calls, holding the chunk's logits buffers (reused, not
    reallocated; one caller at a time).
    """
    slabs = TeacherSlabs(hidden, lm_head, chunk_tokens, vocab_chunk=vocab_chunk, workspace=workspace)
    if not 1 <= k <= slabs.vocab_size:
        raise ValueError(f"k must be between 1 and the vocabulary size {slabs.vocab_size}, got {k}")
    targets = _TopkTargets(hidden.shape[0], k, hidden.device)
    slabs.run(targets, logit_transform)
    if return_tail:
        return targets.topk_ids, targets.topk_logprobs, targets.tail_logprob
    return targets.topk_ids, targets.topk_logprobs


class TeacherTopkStep:
    """One micro-batch through the teacher: body hidden states, then chunked top-K with the model's own
    final-logit transform. Results stay on the model's device; the caller copies them to the host once."""

    def __init__(self, model: nn.Module, k: int, chunk_tokens: int, *, vocab_chunk: int | None = None,
                 head: str = "slab", compile_body: bool = False) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.model = model
        self.body = teacher_body_runner(model, compile_body)  # compile_body: torch.compile at the fixed shape
        self.compiled_body = compile_body
        self.lm_head = output_layer(model)
        self.logit_transform = final_logit_transform(model.config)
        vocab_size = getattr(self.lm_head, "out_features", None)
        if k < 1 or (isinstance(vocab_size, int) and k > vocab_size):
            raise ValueError(f"k must be between 1 and the vocabulary size {vocab_size}, got {k}")
        self.k = k
        self.chunk_tokens = chunk_tokens
        self.vocab_chunk = vocab_chunk
        self.workspace: dict[str, Tensor] = {}  # the chunk's logits buffers, reused by every micro-batch
        # "tiled" and "tiled-gemm" need a plain weight, one vocabulary slab and no final-logit transform; else the
        # slab loop runs. self.head: what runs (slab, tiled, tiled-triton or tiled-gemm; `tiled_variant`).
        self.tiled = head in TILED_HEADS and tiled_head_fits(self.lm_head, self.logit_transform, vocab_chunk)
        self.head = "slab" if not self.tiled else tiled_variant(next(model.parameters()).device, head)

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """input_ids (B, T) -> topk_ids (B, T, K) int32, topk_logprobs (B, T, K) float32,
        tail_logprob (B, T) float32."""
        batch, seq_len = input_ids.shape
        hidden = self.body(input_ids, attention_mask)  # (B, T, H)
        if self.tiled:
            topk_ids, topk_logprobs, tail_logprob = tiled_head_topk(
                hidden.flatten(0, 1), self.lm_head.weight, self.k, self.chunk_tokens, variant=self.head,
                float32=float32_head(self.lm_head))
            return (topk_ids.view(batch, seq_len, self.k), topk_logprobs.view(batch, seq_len, self.k),
                    tail_logprob.view(batch, seq_len))
        topk_ids, topk_logprobs, tail_logprob = chunked_topk(
            hidden.flatten(0, 1),
            self.lm_head,
            self.k,
            self.chunk_tokens,
            vocab_chunk=self.vocab_chunk,
            logit_transform=self.logit_transform,
            return_tail=True,
            workspace=self.workspace,
        )  # (B * T, K), (B * T,)
        return (topk_ids.view(batch, seq_len, self.k), topk_logprobs.view(batch, seq_len, self.k),
                tail_logprob.view(batch, seq_len))


def topk_step(model: nn.Module, pre: PrecomputeConfig, vocab: int) -> TeacherTopkStep:
    """The top-K step of this config as the pass runs it (its head, its body compiled or not): the pass's and
    `kdflow tune precompute`'s, so that the tune times what the pass will run."""
    return TeacherTopkStep(model, pre.top_k, topk_chunk_tokens(pre, vocab), head=pre.head,
                           compile_body=pre.compile_body)
