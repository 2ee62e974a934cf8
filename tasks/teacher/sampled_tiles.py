"""Sampled targets of a block of logits, reading the whole vocabulary once: the tiled sampler.

The slab loop's sampler (`kdflow.tasks.teacher.sampling`) makes many passes over every (row, id) in 8-byte
numbers: the hash, the keys, two sorts' worth of top-k, the exponentials. Here, as the tiled top-K does
(`kdflow.tasks.teacher.tiled_topk`), the logits are read once for three numbers per tile of `tile` ids: the max
logit, the sum of exp(logit - max) and the max key (logit + kdflow.2 noise, computed where the logit is read;
`sample_tile_stats`: a Triton kernel on CUDA, the same arithmetic in torch elsewhere). Then only small arrays:

- the head (hybrid): the H largest logits lie in the H tiles with the largest maxima;
- the sample and its threshold: the H + S + 1 largest keys lie in the H + S + 1 tiles with the largest max keys,
  whose keys are recomputed (`tile_keys`, by the same code as the stats, so the two agree bit for bit);
- the log-sum-exps from the tiles' sums, the tail's summed directly (`tiled_logsumexps`).

Ties resolve as in the slab loop (value desc, then the lower id; tiles by the lower index): the same targets as
`sample_slabs` with the same plan, up to the log-sum-exps' float rounding. Only the kdflow.2 noise has a tiled
form: a kdflow.1 store is finished by the slab loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kdflow.tasks.teacher.sampling import SamplingPlan, finish_targets, top_ordered
from kdflow.tasks.common.sampled import SampledTargets
from kdflow.tasks.teacher.sampling_noise import (key_noise_, stream_words, token_keys32, token_keys32_of,
                                                 uniform_noise32_)
from kdflow.tasks.teacher.tiled_topk import (picked_ids, tile_candidates, tile_stats_torch, tile_values,
                                             tiled_logsumexps)

__all__ = ["SampleKernels", "TORCH_KERNELS", "element_keys", "sample_tile_stats_torch", "tile_keys_torch",
           "tiled_sample"]


def element_keys(logits: Tensor, words: Tensor, token_keys: Tensor, scheme: str) -> Tensor:
    """kdflow.2 keys: logits (c, m) float32 + the noise of (stream word (c,), id), the ids given by their token keys
    (`sampling_noise.token_keys32_of`: (m,), the same for every row, or (c, m)) -> (c, m) float32."""
    bits = torch.empty(logits.shape, dtype=torch.int32, device=logits.device)
    uniform = uniform_noise32_(words, token_keys, bits, torch.empty_like(bits))
    return key_noise_(uniform, scheme).add_(logits)


def sample_tile_stats_torch(logits: Tensor, words: Tensor, scheme: str, tile: int) -> tuple[Tensor, Tensor, Tensor]:
    """logits (c, V) -> per tile of `tile` ids (c, n) float32: max logit, sum of exp(logit - max), max key."""
    rows, vocab = logits.shape
    tile_max, tile_sum = tile_stats_torch(logits, tile)
    tiles = tile_max.shape[1]
    keys = element_keys(logits.float(), words, token_keys32(0, vocab, logits.device), scheme)
    if tiles * tile != vocab:
        keys = torch.nn.functional.pad(keys, (0, tiles * tile - vocab), value=float("-inf"))
    return tile_max, tile_sum, keys.view(rows, tiles, tile).amax(2)


def tile_keys_torch(logits: Tensor, words: Tensor, picked: Tensor, scheme: str, tile: int) -> Tensor:
    """The keys (c, k * tile) float32 of the picked tiles (c, k), tile by tile in their order; -inf past the
    vocabulary."""
    columns, values = tile_candidates(logits, picked, tile)
    return element_keys(values, words, token_keys32_of(columns), scheme)  # -inf logits: -inf keys


SampleKernels = tuple[Callable[[Tensor, Tensor, str, int], tuple[Tensor, Tensor, Tensor]],
                      Callable[[Tensor, Tensor, Tensor, str, int], Tensor]]
TORCH_KERNELS: SampleKernels = (sample_tile_stats_torch, tile_keys_torch)


def _top_tiles(tile_values: Tensor, k: int) -> Tensor:
    """The k tiles (c, k) with the largest values, the lower index first among equals, in ascending order: their
    columns are then in id order, so that ties among candidates go to the lower id."""
    return top_ordered(tile_values, k)[1].sort(dim=1).values


@torch.inference_mode()
def tiled_sample(logits: Tensor, plan: SamplingPlan, streams: Tensor, tile: int = 128,
                 kernels: SampleKernels = TORCH_KERNELS,
                 stats: tuple[Tensor, Tensor, Tensor] | None = None) -> SampledTargets:
    """The sampled targets of logits (c, V) (any float dtype) whose positions have the 64-bit streams (c,), as
    `sample_slabs` draws them with the kdflow.2 noise. `stats`: the tiles' (max, sum, max key) where the GEMM that
    wrote the logits made them (`head_gemm_sample_stats`), else the first of `kernels` reads them."""
    if plan.hash_version != "kdflow.2":
        raise ValueError(f"the tiled sampler draws kdflow.2 noise, not {plan.hash_version} (the slab loop does)")
    rows, vocab = logits.shape
    plan.check(vocab)
    tile_stats, keys_of = kernels
    words = stream_words(streams)
    tile_max, tile_sum, key_max = stats or tile_stats(logits, words, plan.scheme, tile)  # (c, n) each
    tiles = tile_max.shape[1]
    problem = "teacher logits have NaN or +inf entries, or a row without a finite logit"
    if not bool(torch.isfinite(tile_max.amax(1)).all()) or bool(torch.isnan(tile_max).any()):
        raise ValueError(problem)

    head = plan.head
    if head:
        picked = _top_tiles(tile_max, min(head, tiles))  # (c, h')
        candidates = tile_values(logits, picked, tile)
        head_logits, positions = top_ordered(candidates, head)  # (c, H)
        head_ids = picked_ids(picked, positions, tile)
        lse, tail_lse = tiled_logsumexps(tile_max, tile_sum, picked, candidates, positions, head_logits[:, :1])
    else:
        head_logits = logits.new_empty((rows, 0), dtype=torch.float32)
        head_ids = torch.empty((rows, 0), dtype=torch.int64, device=logits.device)
        row_max = tile_max.amax(1, keepdim=True).double()
        lse = row_max[:, 0] + (tile_sum.double() * (tile_max.double() - row_max).exp()).sum(1).log()
        tail_lse = lse

    if not bool(torch.isfinite(lse).all()):  # a NaN that a kernel's max passed over still reaches the sums
        raise ValueError(problem)
    wanted = min(plan.candidates, vocab)
    picked = _top_tiles(key_max, min(wanted, tiles))  # (c, L')
    keys = keys_of(logits, words, picked, plan.scheme, tile)  # (c, L' * tile) in id order
    key_top, positions = top_ordered(keys, wanted)  # (c, L)
    key_ids = picked.gather(1, positions // tile) * tile + positions % tile  # the kept ids only
    key_logits = logits.gather(1, key_ids).float()
    return finish_targets(plan, (head_logits, head_ids), (key_top, key_ids, key_logits), lse, tail_lse)
