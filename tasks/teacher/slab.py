"""The teacher's slab loop: lm_head over the hidden states a block of rows and a vocabulary slab at a time.

The reference teacher has a 196,608-token vocabulary: `micro_batch x seq x vocab` logits were what limited the
teacher pass. Here lm_head is applied to `chunk_tokens` rows at a time, each block's float32 logits living in
one reused buffer, so peak memory depends on the block, not on the micro-batch. Optionally the vocabulary is cut
into slabs too (`vocab_chunk`): each target merges its slabs exactly, the same result in less memory per row.

This module owns the loop, the logits (the weight's dtype upcast to float32, or float32 all along with
`teacher.lm_head_float32`), the model's final-logit transform and the log-sum-exps of a slab. A kind of target
supplies what it keeps (`SlabTargets`): per block of rows a `BlockTargets` that folds in each slab's logits in
id order, and where a finished block's results go. The top-K (`kdflow.tasks.teacher.topk`) and the sampled
targets (`kdflow.tasks.teacher.sampling`) are the two; the student's chunked loss is split the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, TypeVar

import torch
from torch import Tensor, nn

from kdflow.tasks.common.float32_logits import Float32Logits, float32_logits, float32_output_matmul
from kdflow.tasks.common.models import LogitTransform

__all__ = ["BlockTargets", "SlabLogits", "SlabTargets", "TeacherSlabs", "head_vocab_size", "split_logsumexp_"]


class BlockTargets(Protocol):
    """One block of rows' targets, folded in slab by slab."""

    def add(self, logits: Tensor, first_id: int) -> None:
        """Fold in float32 logits (c, s) of ids first_id..first_id + s - 1; slabs come in id order, and the
        logits are a buffer the block may overwrite."""
        ...


Block = TypeVar("Block", bound=BlockTargets)


class SlabTargets(Protocol[Block]):
    """What one kind of teacher target keeps from the slab loop."""

    def block(self, start: int, stop: int) -> Block:
        """A fresh accumulator for rows start..stop - 1."""
        ...

    def gather(self, block: Block, start: int, stop: int) -> None:
        """Take the results of rows start..stop - 1 once every slab is in."""
        ...


class TeacherSlabs:
    """hidden (N, H) through lm_head, `chunk_tokens` rows and `vocab_chunk` ids (None: all) at a time.

    lm_head: a module (called whole unless it is a plain nn.Linear or a `Float32Logits`) or a weight (V, H).
    vocab_chunk needs a plain weight: a module such as a quantised layer allocates its own output and cannot be
    cut. workspace: a dict the caller keeps between calls, holding the logits buffers (one caller at a time).
    """

    def __init__(self, hidden: Tensor, lm_head: nn.Module | Tensor, chunk_tokens: int, *,
                 vocab_chunk: int | None = None, workspace: dict[str, Tensor] | None = None) -> None:
        if hidden.dim() != 2:
            raise ValueError(f"hidden must be (tokens, hidden_size), got shape {tuple(hidden.shape)}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if vocab_chunk is not None and vocab_chunk < 1:
            raise ValueError(f"vocab_chunk must be >= 1 or None, got {vocab_chunk}")
        self.hidden, self.lm_head, self.workspace = hidden, lm_head, workspace
        self.vocab_size = head_vocab_size(lm_head, hidden)
        self.rows = max(1, min(chunk_tokens, hidden.shape[0]))  # rows of a block (the last may have fewer)
        self.cols = min(vocab_chunk or self.vocab_size, self.vocab_size)  # ids of a slab (the last may have fewer)

    @torch.inference_mode()
    def run(self, targets: SlabTargets, logit_transform: LogitTransform | None = None) -> None:
        """Every block's slabs, in id order, to `targets`; `logit_transform` applied to the logits first.
        Never differentiated: the teacher's targets are constants to the student."""
        transform = None if logit_transform is None or logit_transform.is_identity else logit_transform
        slab_logits = SlabLogits(self.lm_head, self.hidden, self.vocab_size, self.rows, self.cols, self.workspace)
        n_tokens = self.hidden.shape[0]
        for start in range(0, n_tokens, self.rows):
            stop = min(start + self.rows, n_tokens)
            block = targets.block(start, stop)
            for first_id, logits in slab_logits.slabs(self.hidden[start:stop]):  # (c, s) float32
                if transform is not None:
                    transform.apply_(logits)
                block.add(logits, first_id)
            targets.gather(block, start, stop)


def split_logsumexp_(logits: Tensor, kept_cols: Tensor, exp: Tensor,
                     row_max: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(log-sum-exp of each row of logits (c, s), the same without the columns kept_cols (c, k)), both (c,) in
    exp's dtype; -inf for the second where the kept columns are the whole row.

    exp: a (c, s) buffer we overwrite with exp(logits - row max), kept entries zeroed: logits itself (float32,
    no second (c, s) temporary) or a float64 scratch (the log-sum-exps then move by float64 rounding only with
    where the slabs are cut). row_max: the rows' max when the caller has it (a sorted top-k's first column);
    else taken here, and 0 for a row without a finite max. The sum outside the kept columns is taken directly,
    never as 1 - sum(kept): the tail of a peaked row keeps its relative precision.
    """
    if row_max is None:
        row_max = logits.amax(1).to(exp.dtype)  # (c,)
        row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    if exp is not logits:
        exp.copy_(logits)
    exp.sub_(row_max[:, None]).exp_()  # (c, s)
    kept = exp.gather(1, kept_cols).sum(1)  # (c,) k terms
    rest = exp.scatter_(1, kept_cols, 0.0).sum(1)  # (c,) the one pass over the slab
    return row_max + (rest + kept).log(), row_max + rest.log()


# --- the logits of a block, slab by slab ------------------------------------------------------------------


def _plain_weight(lm_head: nn.Module | Tensor) -> tuple[Tensor, Tensor | None] | None:
    """(weight (V, H), bias (V,) or None) when we may do the matmul ourselves; None means call the module.

    Only an exact `nn.Linear` qualifies, or one wrapped in `Float32Logits`: quantised layers (bitsandbytes
    Linear4bit, ...) subclass it but store packed weights, so they must run their own forward.
    """
    if isinstance(lm_head, Tensor):
        return lm_head, None
    if type(lm_head) is nn.Linear or isinstance(lm_head, Float32Logits):
        return lm_head.weight, lm_head.bias
    return None


def head_vocab_size(lm_head: nn.Module | Tensor, hidden: Tensor) -> int:
    """The number of logits lm_head gives per row of hidden (N, H)."""
    plain = _plain_weight(lm_head)
    if plain is not None:
        return plain[0].shape[0]
    out_features = getattr(lm_head, "out_features", None)
    if isinstance(out_features, int):
        return out_features
    if hidden.shape[0] == 0:
        raise ValueError(f"cannot tell the vocabulary size of {type(lm_head).__name__} from an empty input")
    # An unknown module: one row tells us its output width.
    return lm_head(hidden[:1]).shape[-1]


def _check_plain_weight(weight: Tensor, bias: Tensor | None, hidden: Tensor, float32_out: bool) -> None:
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"lm_head weight must be (vocab, {hidden.shape[1]}) to match hidden, got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype and weight.dtype != torch.float32 and not float32_out:  # those upcast
        raise ValueError(f"hidden dtype {hidden.dtype} does not match lm_head weight dtype {weight.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"lm_head bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")


class SlabLogits:
    """Float32 logits of one block of rows over one vocabulary slab, in buffers allocated once per call.

    Reusing the buffers matters on CPU, where each fresh multi-hundred-MB tensor is new pages to fault in;
    on CUDA the caching allocator would reuse them anyway. A module (quantised, ...) is called whole: it
    allocates its own output and cannot be cut into slabs. A `Float32Logits` head's logits are never rounded
    to its 16-bit dtype (`teacher.lm_head_float32`).
    """

    def __init__(self, lm_head: nn.Module | Tensor, hidden: Tensor, vocab_size: int, rows: int, cols: int,
                 workspace: dict[str, Tensor] | None = None) -> None:
        self.lm_head = lm_head
        self.plain = _plain_weight(lm_head)
        self.float32_out = isinstance(lm_head, Float32Logits)
        self.vocab_size = vocab_size
        self.cols = cols
        if self.plain is None:
            if cols < vocab_size:
                raise ValueError(f"vocab_chunk needs a plain weight or nn.Linear lm_head, not {type(lm_head).__name__}")
            return
        weight, bias = self.plain
        _check_plain_weight(weight, bias, hidden, self.float32_out)
        # Flat storage, so that a smaller last block or slab is still a contiguous (c, s) view. None where the
        # 16-bit matmul writes float32 itself (Float32Logits on CUDA): each slab is then a new tensor.
        writes_float32 = (self.float32_out and hidden.dtype == weight.dtype
                          and float32_output_matmul(hidden.device))
        self.logits_f32 = None if writes_float32 else _buffer(workspace, "logits_f32", rows * cols, torch.float32,
                                                              hidden.device)  # (C * S,)
        self.logits_low: Tensor | None = None
        if weight.dtype != torch.float32 and not self.float32_out:
            # bf16/fp16 matmul output, upcast below; the model's own logits are rounded the same way.
            self.logits_low = _buffer(workspace, "logits_low", rows * cols, weight.dtype, hidden.device)

    def slabs(self, hidden_rows: Tensor) -> Iterator[tuple[int, Tensor]]:
        """hidden_rows (c, H) -> (first vocabulary id, float32 logits (c, s) that we may overwrite) per slab."""
        if self.plain is None:
            logits = self.lm_head(hidden_rows)  # a fresh tensor: safe to transform in place
            yield 0, logits if logits.dtype == torch.float32 else logits.float()
            return
        weight, bias = self.plain
        rows = hidden_rows.shape[0]
        if hidden_rows.dtype != weight.dtype and not self.float32_out:  # 16-bit hidden states, float32 lm_head
            hidden_rows = hidden_rows.to(weight.dtype)
        elif self.float32_out and self.logits_f32 is not None:  # Float32Logits, upcast: once a block, not a slab
            hidden_rows = hidden_rows.float()
        for first_id in range(0, self.vocab_size, self.cols):
            width = min(self.cols, self.vocab_size - first_id)
            logits_f32 = None if self.logits_f32 is None else self.logits_f32[: rows * width].view(rows, width)
            if self.float32_out:
                yield first_id, float32_logits(hidden_rows, weight[first_id : first_id + width],
                                               None if bias is None else bias[first_id : first_id + width],
                                               out=logits_f32)
                continue
            target = logits_f32 if self.logits_low is None else self.logits_low[: rows * width].view(rows, width)
            weight_slab = weight[first_id : first_id + width]  # (s, H), contiguous rows of the weight
            if bias is None:
                torch.mm(hidden_rows, weight_slab.t(), out=target)
            else:
                torch.addmm(bias[first_id : first_id + width], hidden_rows, weight_slab.t(), out=target)
            if self.logits_low is not None:
                logits_f32.copy_(target)
            yield first_id, logits_f32


def _buffer(workspace: dict[str, Tensor] | None, name: str, numel: int, dtype: torch.dtype,
            device: torch.device) -> Tensor:
    """A flat buffer of `numel` elements; kept in `workspace` across calls when one is given. On CPU a fresh
    (chunk, vocab) buffer per micro-batch is hundreds of MB of new pages to fault in every time (~2% of the
    demo teacher's pass on this machine's CPU)."""
    if workspace is None:
        return torch.empty(numel, dtype=dtype, device=device)
    buffer = workspace.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
        buffer = workspace[name] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]
