"""The Triton kernels under the tiled sampler (`kdflow.tasks.teacher.sampled_tiles`), on CUDA.

`sample_tile_stats_triton`: one read of the logits (in their own dtype) for, per tile of ids, the max logit, the
sum of exp(logit - max) and the max key, the kdflow.2 noise hashed where the logit is read (32-bit unsigned
arithmetic, the same steps as `kdflow.tasks.teacher.sampling_noise.mix32_`). `tile_keys_triton`: the keys of the
picked tiles by the same code, so that tiles are chosen and their keys ranked by one arithmetic. The suite runs
both through Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) against the torch forms; a GPU only times them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kdflow.tasks.teacher.tile_stats_kernel import check_triton_device


__all__ = ["TRITON_KERNELS", "sample_tile_stats_triton", "tile_keys_triton"]

SCHEME_CODES = {"priority": 0, "gumbel": 1}  # the kernels' SCHEME: kdflow.2 noise's schemes


def _check(logits: Tensor, tile: int, group: int) -> None:
    if tile & (tile - 1) or group & (group - 1):
        raise ValueError(f"tile and group must be powers of two, got {tile} and {group}")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be a (rows, vocab) tensor with contiguous rows")


def sample_tile_stats_triton(logits: Tensor, words: Tensor, scheme: str, tile: int,
                             group: int = 8) -> tuple[Tensor, Tensor, Tensor]:
    """The same as `sample_tile_stats_torch`; `tile` and `group` powers of two."""
    import triton

    _check(logits, tile, group)
    check_triton_device(logits, "the Triton sampler kernels run")
    kernels = _kernels()
    rows, vocab = logits.shape
    tiles = triton.cdiv(vocab, tile)
    out = [torch.empty((rows, tiles), dtype=torch.float32, device=logits.device) for _ in range(3)]
    grid = (rows, triton.cdiv(tiles, group))
    kernels["stats"][grid](logits, words.contiguous(), *out, vocab, tiles, logits.stride(0),
                           SCHEME=SCHEME_CODES[scheme], TILE=tile, GROUP=group)
    return out[0], out[1], out[2]


def tile_keys_triton(logits: Tensor, words: Tensor, picked: Tensor, scheme: str, tile: int) -> Tensor:
    """The same as `tile_keys_torch`."""
    _check(logits, tile, 1)
    check_triton_device(logits, "the Triton sampler kernels run")
    kernels = _kernels()
    rows, vocab = logits.shape
    count = picked.shape[1]
    keys = torch.empty((rows, count * tile), dtype=torch.float32, device=logits.device)
    picked = picked.to(torch.int32).contiguous()
    kernels["keys"][(rows, count)](logits, words.contiguous(), picked, keys, vocab, count, logits.stride(0),
                                   SCHEME=SCHEME_CODES[scheme], TILE=tile)
    return keys


TRITON_KERNELS = (sample_tile_stats_triton, tile_keys_triton)


def _kernels() -> dict[str, object]:
    """The jitted kernels, imported on first use: importing kdflow never imports Triton. Triton decides when it
    decorates whether a kernel is interpreted, so the suite sets TRITON_INTERPRET before this runs."""
    from kdflow.tasks.teacher import sample_tile_jit

    return {"stats": sample_tile_jit.sample_tile_stats, "keys": sample_tile_jit.tile_keys}
