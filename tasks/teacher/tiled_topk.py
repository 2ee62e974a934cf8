"""Top-K, log-sum-exp and tail of a block of logits, reading the whole vocabulary once.

At the reference teacher's 196,608 ids the head cost 4.3x its own matmul: after the matmul the slab loop makes
several more passes over the (rows, vocab) logits (upcast, `torch.topk` over every id, exp, gather, scatter,
sum). Here the logits are read once, tile by tile, for two numbers per tile of `tile` ids: its max and the sum of
exp(logit - max) (`tile_stats`; a Triton kernel on CUDA, kdflow.tasks.teacher.tile_stats_kernel, the same sums in
torch elsewhere; or, `tiled-gemm`, made by the lm_head GEMM as it writes the logits, kdflow.tasks.teacher.head_gemm,
so that they are not read again). Everything after that touches only small arrays and K tiles:

- the K largest logits of a row lie in the K tiles with the largest maxima (each of those tiles holds one logit
  at least as large as the K-th largest tile max, so no logit below that can be among the top K), so `torch.topk`
  runs over K x tile candidates gathered from those tiles (1/12 of the row at K = 128, tile = 128, V = 196,608);
- the log-sum-exp combines the tiles' partial sums;
- the tail (the mass outside the top K) is summed directly, never as 1 - sum(top K): the unselected tiles' partial
  sums plus the selected tiles' candidates that did not make the top K, so a peaked row keeps its tail's relative
  precision, as the slab loop's `split_logsumexp_` does.

The result equals the slab loop's top-K over the same logits (ties may pick other ids of equal value) and its
log-sum-exps up to float rounding (sums in another order); `kdflow bench head` times both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from kdflow.tasks.common.float32_logits import Float32Logits, float32_logits
from kdflow.tasks.common.models import LogitTransform
from kdflow.tasks.teacher.gemm_tiles import GemmTiles
from kdflow.tasks.teacher.head_gemm import head_gemm_stats
from kdflow.tasks.teacher.tile_stats_kernel import tile_stats_triton, triton_available

TileStats = Callable[[Tensor, int], tuple[Tensor, Tensor]]
TILED_HEADS = ("tiled", "tiled-gemm")  # the `precompute.head` values that read the logits per tile
TILED_VARIANTS = ("tiled", "tiled-triton", "tiled-gemm")  # what a tiled head runs: `tiled_variant`
TRITON_TILED = ("tiled-triton", "tiled-gemm")  # of those, the ones whose Triton kernels read the logits


def tile_stats_torch(logits: Tensor, tile: int) -> tuple[Tensor, Tensor]:
    """logits (c, V) -> (max (c, n), sum of exp(logit - max) (c, n)) float32 per tile of `tile` ids, n = ceil(V /
    tile); the last tile is padded with -inf. A tile of -inf only has max -inf and sum 0."""
    rows, vocab = logits.shape
    tiles = -(-vocab // tile)
    padded = logits.float()
    if tiles * tile != vocab:
        padded = torch.nn.functional.pad(padded, (0, tiles * tile - vocab), value=float("-inf"))
    view = padded.view(rows, tiles, tile)
    tile_max = view.amax(2)
    safe = torch.where(torch.isfinite(tile_max), tile_max, torch.zeros_like(tile_max))
    return tile_max, (view - safe[:, :, None]).exp().sum(2)


def tiled_topk(logits: Tensor, k: int, tile: int = 128,
               stats: TileStats = tile_stats_torch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """logits (c, V), any float dtype -> (top logits (c, k) float32 by descending value, their ids (c, k) int64,
    log-sum-exp (c,), log-sum-exp outside the top k (c,), -inf where the top k is the whole row)."""
    _check_topk(logits.shape[1], k, tile)
    return topk_of_tiles(logits, k, tile, *stats(logits, tile))


def topk_of_tiles(logits: Tensor, k: int, tile: int, tile_max: Tensor,
                  tile_sum: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`tiled_topk` of logits (c, V) whose tile statistics (c, n) float32 are given (the GEMM made them)."""
    _check_topk(logits.shape[1], k, tile)
    tiles = tile_max.shape[1]
    picked = torch.topk(tile_max, min(k, tiles), dim=1, sorted=False).indices  # (c, k')
    candidates = tile_values(logits, picked, tile)  # (c, k' * tile)
    top_logits, positions = torch.topk(candidates, k, dim=1, sorted=True)  # (c, k)
    top_ids = picked_ids(picked, positions, tile)

    log_normaliser, log_rest = tiled_logsumexps(tile_max, tile_sum, picked, candidates, positions, top_logits[:, :1])
    return top_logits, top_ids, log_normaliser.float(), log_rest.float()


def _check_topk(vocab: int, k: int, tile: int) -> None:
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be between 1 and the vocabulary size {vocab}, got {k}")
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")


def tile_columns(picked: Tensor, tile: int) -> Tensor:
    """The ids (c, k * tile) of the picked tiles (c, k), tile by tile in their order (past the vocabulary in the
    last tile's padding)."""
    return (picked[:, :, None] * tile + torch.arange(tile, device=picked.device)).flatten(1)


def tile_candidates(logits: Tensor, picked: Tensor, tile: int) -> tuple[Tensor, Tensor]:
    """The picked tiles' ids and their logits as float32, -inf in the last tile's padding: (c, k * tile) each."""
    columns = tile_columns(picked, tile)
    vocab = logits.shape[1]
    return columns, logits.gather(1, columns.clamp_max(vocab - 1)).float().masked_fill_(columns >= vocab, -torch.inf)


def tile_values(logits: Tensor, picked: Tensor, tile: int) -> Tensor:
    """`tile_candidates`' logits alone. Where the vocabulary is whole tiles (the reference's 196,608 ids are 1,536
    tiles of 128) and the block is contiguous, the logits are read as rows of one tile each and the picked rows
    copied whole (`index_select`): no (c, k * tile) int64 index is written and read back, which at K = 128 was
    128 KiB a row three times over, more memory traffic than the candidates' own 64 KiB."""
    rows, vocab = logits.shape
    if vocab % tile or not logits.is_contiguous():
        return tile_candidates(logits, picked, tile)[1]
    tiles = vocab // tile
    first = torch.arange(0, rows * tiles, tiles, device=picked.device)[:, None]  # each row's first tile
    return logits.view(rows * tiles, tile).index_select(0, (picked + first).flatten()).view(rows, -1).float()


def picked_ids(picked: Tensor, positions: Tensor, tile: int) -> Tensor:
    """The ids (c, m) int64 at `positions` (c, m) among the picked tiles' (c, k) candidates, tile by tile."""
    return picked.gather(1, positions // tile) * tile + positions % tile


def tiled_logsumexps(tile_max: Tensor, tile_sum: Tensor, picked: Tensor, candidates: Tensor, positions: Tensor,
                     row_max: Tensor) -> tuple[Tensor, Tensor]:
    """(log-sum-exp, log-sum-exp outside the kept ids) (c,) float64 of rows read as tiles: the tiles' stats (c, n),
    the picked tiles (c, k') whose ids are the candidates' columns, the candidates' logits (c, k' * tile), the kept
    ones' positions among them (c, k) and the row max (c, 1)."""
    # Sums relative to the row max: the tiles' (few, of very different sizes) in float64; the candidates' exps in
    # float32 as the slab loop takes them (each to float32 rounding), their sums combined in float64.
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).float()  # (c, 1)
    row_max = shift.double()
    scaled = tile_sum.double() * (tile_max.double() - row_max).exp()  # (c, n) each tile's sum, one scale
    unpicked = scaled.scatter(1, picked, 0.0).sum(1)  # tiles holding no candidate
    exp_candidates = (candidates - shift).exp_()  # (c, k' * tile) float32
    kept = exp_candidates.gather(1, positions).sum(1).double()
    rest = unpicked + exp_candidates.scatter_(1, positions, 0.0).sum(1).double()
    row_max = row_max[:, 0]
    return row_max + (kept + rest).log(), row_max + rest.log()


def logit_blocks(hidden: Tensor, weight: Tensor, chunk_tokens: int,
                 float32: bool = False) -> Iterator[tuple[int, int, Tensor]]:
    """(start, stop, logits (stop - start, V)) for each block of `chunk_tokens` rows of hidden (N, H) through a plain
    lm_head weight (V, H): one matmul into one reused buffer of the weight's dtype (rounded as the model rounds its
    own logits), or with `float32` (`teacher.lm_head_float32`: a `Float32Logits` head) float32 logits, never
    rounded to 16 bits (on CUDA the 16-bit matmul with float32 output). Each block's logits are overwritten by the
    next."""
    for start, stop, logits in logit_buffers(hidden, weight, chunk_tokens, float32):
        if float32:
            logits = float32_logits(hidden[start:stop].to(weight.dtype), weight, out=logits)
        else:
            torch.mm(hidden[start:stop].to(weight.dtype), weight.t(), out=logits)
        yield start, stop, logits


def logit_buffers(hidden: Tensor, weight: Tensor, chunk_tokens: int,
                  float32: bool = False) -> Iterator[tuple[int, int, Tensor]]:
    """`logit_blocks`' blocks and their (stop - start, V) views of its one buffer, not yet written."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (N, H) and weight (V, H) do not match: {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    tokens, vocab = hidden.shape[0], weight.shape[0]
    rows = max(1, min(chunk_tokens, tokens))
    buffer = torch.empty(rows * vocab, dtype=torch.float32 if float32 else weight.dtype, device=hidden.device)
    for start in range(0, tokens, rows):
        stop = min(start + rows, tokens)
        yield start, stop, buffer[: (stop - start) * vocab].view(stop - start, vocab)


def tiled_blocks(hidden: Tensor, weight: Tensor, chunk_tokens: int, *, tile: int = 128, float32: bool = False,
                 variant: str = "tiled",
                 gemm_tiling: GemmTiles | None = None) -> Iterator[tuple[int, int, Tensor, Tensor, Tensor]]:
    """(start, stop, logits, tile max, tile sum) for each block of `logit_blocks`, as `variant` makes them: `tiled`
    (torch's sums after the matmul), `tiled-triton` (the Triton tile kernel after it) or `tiled-gemm` (one Triton
    GEMM writes the logits and their statistics, `kdflow.tasks.teacher.head_gemm`; `gemm_tiling`: its
    `GemmTiles`, default the device's)."""
    check_tiled_variant(variant)
    if variant == "tiled-gemm":
        for start, stop, logits in logit_buffers(hidden, weight, chunk_tokens, float32):
            yield start, stop, logits, *head_gemm_stats(hidden[start:stop].to(weight.dtype), weight, logits, tile,
                                                        gemm_tiling)
        return
    stats = tile_stats_triton if variant == "tiled-triton" else tile_stats_torch
    for start, stop, logits in logit_blocks(hidden, weight, chunk_tokens, float32):
        yield start, stop, logits, *stats(logits, tile)


def check_tiled_variant(variant: str) -> None:
    """ValueError naming `variant` unless it is one of `TILED_VARIANTS`."""
    if variant not in TILED_VARIANTS:
        raise ValueError(f"unknown tiled head variant {variant!r}: one of {', '.join(TILED_VARIANTS)}")


def tiled_head_topk(hidden: Tensor, weight: Tensor, k: int, chunk_tokens: int, *, tile: int = 128,
                    float32: bool = False, variant: str = "tiled",
                    gemm_tiling: GemmTiles | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`chunked_topk(..., return_tail=True)`'s contract for a plain lm_head weight (V, H) and no final-logit
    transform: hidden (N, H) -> ids (N, K) int32, log-probs (N, K) float32, tail (N,) float32: the top-K of the
    tiles of each block of `tiled_blocks`."""
    tokens = hidden.shape[0]
    ids = torch.empty((tokens, k), dtype=torch.int32, device=hidden.device)
    logprobs = torch.empty((tokens, k), dtype=torch.float32, device=hidden.device)
    tail = torch.empty((tokens,), dtype=torch.float32, device=hidden.device)
    with torch.inference_mode():
        for start, stop, logits, tile_max, tile_sum in tiled_blocks(hidden, weight, chunk_tokens, tile=tile,
                                                                    float32=float32, variant=variant,
                                                                    gemm_tiling=gemm_tiling):
            top, top_ids, log_normaliser, log_rest = topk_of_tiles(logits, k, tile, tile_max, tile_sum)
            torch.sub(top, log_normaliser[:, None], out=logprobs[start:stop])
            torch.sub(log_rest, log_normaliser, out=tail[start:stop])
            ids[start:stop].copy_(top_ids)
    return ids, logprobs, tail


def tiled_head_fits(lm_head: nn.Module, transform: LogitTransform | None, vocab_chunk: int | None) -> bool:
    """Whether `precompute.head: tiled` can take this teacher's head: an exact `nn.Linear` without bias, or one
    wrapped for float32 logits (`Float32Logits`, `teacher.lm_head_float32`: `float32_head` says which; a quantised
    head computes its own logits), the whole vocabulary at once, no final-logit transform (soft-capping,
    scaling). Else the pass keeps the slab loop, and its shards record `head: slab`."""
    plain = (type(lm_head) is nn.Linear or isinstance(lm_head, Float32Logits)) and lm_head.bias is None
    return plain and vocab_chunk is None and (transform is None or transform.is_identity)


def float32_head(lm_head: nn.Module) -> bool:
    """Whether a tiled head's logits are float32 (`teacher.lm_head_float32` wrapped it) or the weight's dtype."""
    return isinstance(lm_head, Float32Logits)


def tiled_variant(device: torch.device, head: str = "tiled") -> str:
    """What a tiled head (`precompute.head`: tiled or tiled-gemm) runs on `device`. On CUDA with Triton installed:
    `tiled-gemm` (the GEMM writing the tile statistics) for tiled-gemm, `tiled-triton` (the tile kernel after the
    matmul) for tiled; elsewhere `tiled` (torch's sums after the matmul) for both."""
    if device.type != "cuda" or not triton_available():
        return "tiled"
    return "tiled-gemm" if head == "tiled-gemm" else "tiled-triton"
