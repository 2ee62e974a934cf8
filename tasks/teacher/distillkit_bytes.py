"""The bytes of DistillKit's packed logits, one position per row of a uint8 matrix, both ways, in numpy.

A position's `compressed_logprobs` entry is, in order and with nothing between:
  exact_k floats of exact_dtype | one coefficient per polynomial term, of term_dtype |
  per residual bin: its scale (scale_dtype) then num_elements unsigned integers of element_bits, bit-packed.
Its `bytepacked_indices` entry is k ids of ceil(log2(d)) bits, bit-packed. Floats are little-endian (DistillKit
reinterprets torch tensors on x86 and CUDA hosts); bit packing puts each integer's most significant bit first and
pads the last byte with zero bits. Every function works on all positions at once: the format has one layout per
position, so a batch is a matrix and the work is a few array operations, not a loop over positions.
"""

from __future__ import annotations

import numpy as np

from kdflow.tasks.teacher.distillkit_settings import FLOAT_BYTES, DistillKitSettings

# numpy has no bfloat16: it is the top half of a float32, handled in floats_from_bytes / floats_to_bytes
_NUMPY_FLOAT = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4"), "float64": np.dtype("<f8")}


def floats_from_bytes(raw: np.ndarray, dtype: str) -> np.ndarray:
    """(n, m * width) uint8 -> (n, m) floats of `dtype` (bfloat16 widened to float32, exactly)."""
    raw = np.ascontiguousarray(raw)
    if dtype == "bfloat16":
        halves = raw.view("<u2").astype(np.uint32) << np.uint32(16)
        return halves.view(np.float32)
    return raw.view(_NUMPY_FLOAT[dtype])


def floats_to_bytes(values: np.ndarray, dtype: str) -> np.ndarray:
    """(n, m) floats -> (n, m * width) uint8, rounded to nearest (ties to even) as a cast to `dtype` does."""
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
        halves = rounded.astype(np.uint16).astype("<u2")
        return halves.view(np.uint8).reshape(len(values), -1)
    return np.ascontiguousarray(values, dtype=_NUMPY_FLOAT[dtype]).view(np.uint8).reshape(len(values), -1)


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` as `dtype` would hold them, back in float64: what a writer's reader will see."""
    return floats_from_bytes(floats_to_bytes(values, dtype), dtype).astype(np.float64)


def unpack_bits(raw: np.ndarray, bits: int, count: int) -> np.ndarray:
    """(n, bytes) uint8 -> (n, count) uint64: `count` integers of `bits` bits each, most significant bit first.

    Up to 57 bits an integer lies within the 8 bytes from its first one, so each is one big-endian 64-bit read,
    shifted and masked: 8 bytes of work per integer, where a bit at a time would take 8 * bits."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if bits <= 57:
        starts = np.arange(count, dtype=np.int64) * bits
        padded = np.concatenate([raw, np.zeros((len(raw), 8), np.uint8)], axis=1)
        windows = padded[:, (starts // 8)[:, None] + np.arange(8)].copy().view(">u8")[..., 0]
        shift = (64 - bits - starts % 8).astype(np.uint64)
        return (windows.astype(np.uint64) >> shift) & np.uint64((1 << bits) - 1)
    stream = np.unpackbits(raw, axis=-1)[:, :count * bits]
    weights = np.uint64(1) << np.arange(bits - 1, -1, -1, dtype=np.uint64)
    return (stream.reshape(len(raw), count, bits).astype(np.uint64) * weights).sum(-1, dtype=np.uint64)


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """(n, count) unsigned integers below 2**bits -> (n, ceil(count * bits / 8)) uint8, the inverse of unpack_bits."""
    values = np.asarray(values, dtype=np.uint64)
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint64)
    stream = ((values[..., None] >> shifts) & np.uint64(1)).astype(np.uint8).reshape(len(values), -1)
    return np.packbits(stream, axis=-1)


def curve_points(settings: DistillKitSettings) -> np.ndarray:
    """(k - exact_k, terms): each term evaluated at t = 0, 1, ... (or evenly over [0, 1] with normalize_t),
    in the coefficients' dtype as DistillKit evaluates them (float32 for bfloat16, which numpy lacks)."""
    dtype = np.float32 if settings.term_dtype == "bfloat16" else _NUMPY_FLOAT[settings.term_dtype].type
    count = settings.approx_k
    t = np.linspace(0, 1, count, dtype=dtype) if settings.normalize_t else np.arange(count, dtype=dtype)
    columns = [t ** term if isinstance(term, int) else getattr(np, term)(t) for term in settings.polynomial_terms]
    return np.stack(columns, axis=-1).astype(dtype)


def curve(coefficients: np.ndarray, settings: DistillKitSettings) -> np.ndarray:
    """(n, terms) coefficients -> (n, k - exact_k) float64: the polynomial's values, summed in its dtype."""
    points = curve_points(settings)
    return (points[None] * coefficients.astype(points.dtype)[:, None, :]).sum(-1).astype(np.float64)


def _residual_range(bits: int) -> tuple[int, int]:
    """The signed range a bin's integers stand for (DistillKit's: one bit is just 0 or 1)."""
    return (0, 1) if bits == 1 else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def decode_logprobs(raw: np.ndarray, settings: DistillKitSettings) -> np.ndarray:
    """(n, logprob_bytes) uint8 -> (n, k) float64 log-probs, in the stored order (descending, up to the
    approximation). Decoded in float64: DistillKit's own decoder rounds the result to exact_dtype, so the two
    agree within that rounding."""
    n, at = len(raw), 0
    width = FLOAT_BYTES[settings.exact_dtype]
    exact = floats_from_bytes(raw[:, :settings.exact_k * width], settings.exact_dtype).astype(np.float64)
    at += settings.exact_k * width
    residual = np.zeros((n, settings.approx_k), dtype=np.float64)
    coefficients = None
    if settings.polynomial_terms:
        size = len(settings.polynomial_terms) * FLOAT_BYTES[settings.term_dtype]
        coefficients = floats_from_bytes(raw[:, at:at + size], settings.term_dtype)
        at += size
    column = 0
    for spec in settings.residual_bins:
        scale_size = FLOAT_BYTES[spec.scale_dtype]
        scale = floats_from_bytes(raw[:, at:at + scale_size], spec.scale_dtype).astype(np.float64)
        at += scale_size
        size = (spec.num_elements * spec.element_bits + 7) // 8
        levels = unpack_bits(raw[:, at:at + size], spec.element_bits, spec.num_elements).astype(np.float64)
        at += size
        low = _residual_range(spec.element_bits)[0]
        signed = levels * 2.0 - 1.0 if spec.element_bits == 1 else levels + low
        residual[:, column:column + spec.num_elements] = signed * scale
        column += spec.num_elements
    approx = residual if coefficients is None else curve(coefficients, settings) + residual
    values = np.concatenate([exact, approx], axis=1)
    return np.cumsum(values, axis=1) if settings.delta_encoding else values


def encode_logprobs(logprobs: np.ndarray, settings: DistillKitSettings) -> np.ndarray:
    """(n, k) log-probs sorted descending -> (n, logprob_bytes) uint8 that decode_logprobs reads back.

    The curve is the least-squares fit over the approximated values (one pseudo-inverse for all positions,
    since every position uses the same points); each residual bin scales its largest magnitude to the largest
    level and rounds to the nearest. Error diffusion (a choice of how to round) is not done here: with it
    set, the residuals are rounded plainly, which any DistillKit reader decodes the same way."""
    values = np.asarray(logprobs, dtype=np.float64)
    if settings.delta_encoding:
        values = np.concatenate([values[:, :1], np.diff(values, axis=1)], axis=1)
    chunks = [floats_to_bytes(values[:, :settings.exact_k], settings.exact_dtype)]
    residual = values[:, settings.exact_k:]
    if settings.polynomial_terms:
        fit = residual @ np.linalg.pinv(curve_points(settings).astype(np.float64)).T
        stored = floats_to_bytes(fit, settings.term_dtype)
        chunks.append(stored)
        residual = residual - curve(floats_from_bytes(stored, settings.term_dtype), settings)
    column = 0
    for spec in settings.residual_bins:
        part = residual[:, column:column + spec.num_elements]
        top = 1.0 if spec.element_bits == 1 else float(2 ** (spec.element_bits - 1))
        largest = np.abs(part).max(axis=1, keepdims=True)
        scale = rounded(np.where(largest == 0, 1.0, largest / top), spec.scale_dtype)
        chunks.append(floats_to_bytes(scale, spec.scale_dtype))
        if spec.element_bits == 1:
            levels = (part > 0).astype(np.uint64)
        else:
            low, high = _residual_range(spec.element_bits)
            levels = (np.clip(np.rint(part / scale), low, high) - low).astype(np.uint64)
        chunks.append(pack_bits(levels, spec.element_bits))
        column += spec.num_elements
    return np.concatenate(chunks, axis=1) if chunks else np.zeros((len(values), 0), np.uint8)
