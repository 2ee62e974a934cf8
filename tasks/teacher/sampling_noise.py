"""The noise of sampled targets: a counter-based hash of (seed, shard, row, position, token id).

splitmix64's finaliser on int64 tensors (multiplications wrap modulo 2**64), not torch's RNG: the noise does
not depend on the chunk, the vocabulary slab, the micro-batch or the device, so a rerun or a retry after a GPU
reset draws the same sample from the same logits. `HASH_VERSION` names the constants below; a store records it.
The draw that uses it: `kdflow.tasks.teacher.sampling`.
"""

from __future__ import annotations

import torch
from torch import Tensor


__all__ = ["key_noise_", "mix64_", "position_streams", "token_keys", "uniform_noise_"]


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)
_STREAM_DOMAIN = _signed(0x6B64666C6F772E31)  # "kdflow.1": where position streams start
_TOKEN_DOMAIN = _signed(0x9E3779B97F4A7C15)  # xor-ed into token ids before mixing
_ONE_BITS = 0x3FF0000000000000  # the float64 bits of 1.0


def _shift_right_(out: Tensor, z: Tensor, bits: int) -> Tensor:
    """out <- z >>> bits (logical): torch's >> on int64 is arithmetic, so the sign copies are masked off."""
    torch.bitwise_right_shift(z, bits, out=out)
    return out.bitwise_and_((1 << (64 - bits)) - 1)


def mix64_(z: Tensor, scratch: Tensor | None = None) -> Tensor:
    """splitmix64's finaliser, in place on an int64 tensor."""
    tmp = torch.empty_like(z) if scratch is None else scratch
    z.bitwise_xor_(_shift_right_(tmp, z, 30)).mul_(_MIX_1)
    z.bitwise_xor_(_shift_right_(tmp, z, 27)).mul_(_MIX_2)
    return z.bitwise_xor_(_shift_right_(tmp, z, 31))


def position_streams(seed: int, shard: int, rows: Tensor, positions: Tensor) -> Tensor:
    """One 64-bit stream key per position: rows (C,) (sequence index in the shard), positions (C,) -> (C,) int64."""
    stream = torch.full(rows.shape, _STREAM_DOMAIN, dtype=torch.int64, device=rows.device)
    for part in (seed, shard):
        mix64_(stream.bitwise_xor_(_signed(int(part))))
    mix64_(stream.bitwise_xor_(rows.to(torch.int64)))
    return mix64_(stream.bitwise_xor_(positions.to(torch.int64)))


def token_keys(first_id: int, width: int, device: torch.device) -> Tensor:
    """(width,) int64: mix64(id ^ domain) for ids first_id..first_id + width - 1."""
    ids = torch.arange(first_id, first_id + width, dtype=torch.int64, device=device)
    return mix64_(ids.bitwise_xor_(_TOKEN_DOMAIN))


def uniform_noise_(streams: Tensor, keys: Tensor, bits: Tensor, out: Tensor) -> Tensor:
    """u in (0, 1) per (position, id): streams (C,), token keys (s,) -> out (C, s) float64 view of an int64 buffer.

    u = (m + 1/2) 2^-52 with m the top 52 bits of mix64(stream ^ token key), built through the float64 bits
    of [1, 2) minus 1: exact, and no allocation (bits and out are (C, s) int64 buffers we may overwrite).
    """
    torch.bitwise_xor(streams[:, None], keys[None, :], out=bits)
    mix64_(bits, out)
    _shift_right_(out, bits, 12).bitwise_or_(_ONE_BITS)
    return out.view(torch.float64).sub_(1.0).add_(2.0**-53)


def key_noise_(u: Tensor, scheme: str) -> Tensor:
    """Uniforms -> key noise, in place: Exp(1) = -log u (priority) or Gumbel(0, 1) = -log(-log u)."""
    u.log_().neg_()
    return u.log_().neg_() if scheme == "gumbel" else u
