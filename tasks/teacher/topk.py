"""The teacher's top-K over the full vocabulary, without ever holding (tokens, vocab) logits.

The reference teacher has a 196,608-token vocabulary: `micro_batch x seq x vocab` logits were what limited
the teacher pass. Here lm_head is applied to `chunk_tokens` rows at a time; each chunk's float32 logits
live in one reused buffer, from which we take the top-K and the log-sum-exp over the whole vocabulary,
so peak memory depends on the chunk, not on the micro-batch. Optionally the vocabulary is cut into slabs
too (`vocab_chunk`), whose top-Ks and log-sum-exps are merged: the same result in less memory per row.

The tail (the teacher's mass outside its top-K) comes from the same pass, never as 1 - sum(exp(top-K)):
the top-K entries of the exp buffer are zeroed before the one sum over the vocabulary, which gives the
complement's sum directly; the full sum is that plus the K top terms (a sum of positive numbers, no
cancellation). Slabs merge their complements plus the candidates the merged top-K drops.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from kdflow.tasks.common.float32_logits import Float32Logits, float32_logits, float32_output_matmul
from kdflow.tasks.common.models import LogitTransform, body_hidden_states, final_logit_transform, output_layer

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


def _vocab_size(lm_head: nn.Module | Tensor, hidden: Tensor) -> int:
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


class _SlabLogits:
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


def _logsumexp_(logits: Tensor, top_logits: Tensor, top_ids: Tensor) -> tuple[Tensor, Tensor]:
    """float32 logits (c, s) and their top-k (c, k) -> (log-sum-exp of each row, log-sum-exp of each row
    without its top-k), both (c,); overwrites logits with exp(logits - max), top-k entries zeroed.

    In place so the chunk needs no second (c, V) temporary; the row max comes free from the top-K. The
    complement is summed directly (no 1 - sum(top) cancellation); -inf when the top-k is the whole row.
    """
    row_max = top_logits[:, 0]  # (c,)
    logits.sub_(row_max[:, None]).exp_()
    logits.scatter_(1, top_ids, 0.0)
    rest = logits.sum(dim=1)  # (c,) the one pass over the vocabulary
    top = (top_logits - row_max[:, None]).exp().sum(dim=1)  # (c,) k terms, the largest is 1
    return row_max + (rest + top).log(), row_max + rest.log()


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
        slab_log_normaliser, slab_log_rest = _logsumexp_(logits, slab_logits, slab_ids)  # (c,), (c,)
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
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (tokens, hidden_size), got shape {tuple(hidden.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if vocab_chunk is not None and vocab_chunk < 1:
        raise ValueError(f"vocab_chunk must be >= 1 or None, got {vocab_chunk}")
    n_tokens = hidden.shape[0]
    vocab_size = _vocab_size(lm_head, hidden)
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k must be between 1 and the vocabulary size {vocab_size}, got {k}")

    topk_ids = torch.empty((n_tokens, k), dtype=torch.int32, device=hidden.device)  # (N, K)
    topk_logprobs = torch.empty((n_tokens, k), dtype=torch.float32, device=hidden.device)  # (N, K)
    tail_logprob = torch.empty((n_tokens,), dtype=torch.float32, device=hidden.device)  # (N,)
    rows = max(1, min(chunk_tokens, n_tokens))
    cols = min(vocab_chunk or vocab_size, vocab_size)
    slab_logits = _SlabLogits(lm_head, hidden, vocab_size, rows, cols, workspace)
    for start in range(0, n_tokens, rows):
        stop = min(start + rows, n_tokens)
        running = _RunningTopk(k)
        for first_id, logits in slab_logits.slabs(hidden[start:stop]):  # (c, s) float32
            if logit_transform is not None and not logit_transform.is_identity:
                logit_transform.apply_(logits)
            running.add(logits, first_id)
        torch.sub(running.top_logits, running.log_normaliser[:, None], out=topk_logprobs[start:stop])
        torch.sub(running.log_rest, running.log_normaliser, out=tail_logprob[start:stop])
        topk_ids[start:stop].copy_(running.top_ids)
    return (topk_ids, topk_logprobs, tail_logprob) if return_tail else (topk_ids, topk_logprobs)


class TeacherTopkStep:
    """One micro-batch through the teacher: body hidden states, then chunked top-K with the model's own
    final-logit transform. Results stay on the model's device; the caller copies them to the host once."""

    def __init__(self, model: nn.Module, k: int, chunk_tokens: int, *, vocab_chunk: int | None = None) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.model = model
        self.lm_head = output_layer(model)
        self.logit_transform = final_logit_transform(model.config)
        vocab_size = getattr(self.lm_head, "out_features", None)
        if k < 1 or (isinstance(vocab_size, int) and k > vocab_size):
            raise ValueError(f"k must be between 1 and the vocabulary size {vocab_size}, got {k}")
        self.k = k
        self.chunk_tokens = chunk_tokens
        self.vocab_chunk = vocab_chunk
        self.workspace: dict[str, Tensor] = {}  # the chunk's logits buffers, reused by every micro-batch

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """input_ids (B, T) -> topk_ids (B, T, K) int32, topk_logprobs (B, T, K) float32,
        tail_logprob (B, T) float32."""
        batch, seq_len = input_ids.shape
        hidden = body_hidden_states(self.model, input_ids, attention_mask)  # (B, T, H)
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
