"""The noise of sampled targets: a counter-based hash of (seed, shard, row, position, token id).

Not torch's RNG: the noise does not depend on the chunk, the vocabulary slab, the micro-batch or the device, so a
rerun or a retry after a GPU reset draws the same sample from the same logits. Each position first gets a 64-bit
stream key from (seed, shard, row, position) (splitmix64's finaliser on int64 tensors, multiplications wrapping
modulo 2**64). Then, per (position, token id), by the store's hash version (`precompute.sampling.hash_version`,
recorded in the store and its fingerprint):

- `kdflow.2` (the default): a 32-bit integer hash of (the stream's low 32 bits, a hash of the id), 23 of its bits
  as a float32 uniform, float32 keys. Four bytes a logit and no 64-bit integer multiply: what a GPU does fast,
  and what the Triton kernel of the tiled sampler (`sample_tile_kernel`) computes bit for bit.
- `kdflow.1` (stores made before it): splitmix64 of (stream ^ hash of the id), 52 bits as a float64 uniform,
  float64 keys. Kept so that a sampled store begun with it can be finished.

The draw that uses them: `kdflow.tasks.teacher.sampling`.
"""

from __future__ import annotations

import torch
from torch import Tensor


__all__ = ["key_noise_", "mix32_", "mix64_", "position_streams", "stream_words", "token_keys",
           "token_keys32", "token_keys32_of", "uniform_noise32_", "uniform_noise_", "MIX32", "TOKEN_DOMAIN32",
           "UNIFORM_BITS"]



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


# --- kdflow.2: 32-bit ----------------------------------------------------------------------------------------

def _signed32(value: int) -> int:
    """An unsigned 32-bit constant as the int32 with the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


MIX32 = (0x7FEB352D, 0x846CA68B)  # the 32-bit hash's two odd multipliers (an xorshift-multiply chain)
TOKEN_DOMAIN32 = 0x9E3779B9  # xor-ed into token ids before mixing
_MIX32_1, _MIX32_2, _TOKEN_DOMAIN32 = (_signed32(value) for value in (*MIX32, TOKEN_DOMAIN32))
UNIFORM_BITS = 23  # u = (m + 1/2) 2**-23 with m < 2**23: exact in float32, never 0 or 1


def _shift_right32_(out: Tensor, z: Tensor, bits: int) -> Tensor:
    """out <- z >>> bits (logical) on int32."""
    torch.bitwise_right_shift(z, bits, out=out)
    return out.bitwise_and_((1 << (32 - bits)) - 1)


def mix32_(z: Tensor, scratch: Tensor | None = None) -> Tensor:
    """The 32-bit hash, in place on an int32 tensor (multiplications wrap modulo 2**32): z ^= z >>> 16,
    z *= M1, z ^= z >>> 15, z *= M2, z ^= z >>> 16."""
    tmp = torch.empty_like(z) if scratch is None else scratch
    z.bitwise_xor_(_shift_right32_(tmp, z, 16)).mul_(_MIX32_1)
    z.bitwise_xor_(_shift_right32_(tmp, z, 15)).mul_(_MIX32_2)
    return z.bitwise_xor_(_shift_right32_(tmp, z, 16))


def stream_words(streams: Tensor) -> Tensor:
    """(C,) int64 stream keys -> (C,) int32: their low 32 bits, the stream of kdflow.2."""
    low = streams.bitwise_and(0xFFFFFFFF)
    return torch.where(low >= 1 << 31, low - (1 << 32), low).to(torch.int32)


def token_keys32(first_id: int, width: int, device: torch.device) -> Tensor:
    """(width,) int32: mix32(id ^ domain) for ids first_id..first_id + width - 1."""
    return token_keys32_of(torch.arange(first_id, first_id + width, dtype=torch.int32, device=device))


def token_keys32_of(ids: Tensor) -> Tensor:
    """mix32(id ^ domain) of any ids, as int32 (a new tensor)."""
    return mix32_(ids.to(torch.int32).bitwise_xor(_TOKEN_DOMAIN32))


def uniform_noise32_(words: Tensor, keys: Tensor, bits: Tensor, scratch: Tensor) -> Tensor:
    """u in (0, 1) per (position, id): stream words (C,) int32, token keys (s,) (the same ids for every position)
    or (C, s) int32 -> (C, s) float32, a view of `bits`. u = (m + 1/2) 2^-23, m the top 23 bits of
    mix32(word ^ token key); bits and scratch are (C, s) int32 buffers we may overwrite."""
    torch.bitwise_xor(words[:, None], keys if keys.dim() == 2 else keys[None, :], out=bits)
    mix32_(bits, scratch)
    _shift_right32_(scratch, bits, 32 - UNIFORM_BITS)  # m
    uniform = bits.view(torch.float32)
    uniform.copy_(scratch)  # m as float32, exact (m < 2**23)
    return uniform.add_(0.5).mul_(2.0**-UNIFORM_BITS)


def key_noise_(u: Tensor, scheme: str) -> Tensor:
    """Uniforms -> key noise, in place: Exp(1) = -log u (priority) or Gumbel(0, 1) = -log(-log u)."""
    u.log_().neg_()
    return u.log_().neg_() if scheme == "gumbel" else u
