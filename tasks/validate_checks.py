"""The content checks of `kdflow validate` (kdflow.tasks.validate), pure numpy: token ids within the vocabulary;
top-K ids unique per position, log-probs finite, <= 0, sorted descending, tail mass in [0, 1]; a decoded v2
shard's mass within its codec's precision. Each returns its problems as lines (none: fine).
"""

from __future__ import annotations

import numpy as np

from kdflow.schemas.codec import DecodedTopk, TopkCodec

# Log-probs may exceed 0 by rounding only; the tail mass 1 - sum(exp) may dip below 0 by the rounding of K
# values (float16 keeps 11 bits: the error of sum p_i * l_i stays under ~1e-2 even at high entropy).
LOGPROB_SLACK = {"float16": 1e-3, "float32": 1e-5}
TAIL_SLACK = {"float16": 1e-2, "float32": 1e-4}


def _where(mask: np.ndarray, row_offset: int = 0) -> str:
    """'row r, position t' of the first True in a (rows, T) mask."""
    row, position = np.argwhere(mask)[0][:2]
    return f"row {row_offset + row}, position {position}"


def token_id_problems(input_ids: np.ndarray, vocab: int | None) -> list[str]:
    """input_ids (rows, T): every id within [0, vocab)."""
    problems = []
    if (input_ids < 0).any():
        problems.append(f"negative token id at {_where(input_ids < 0)}")
    if vocab is not None and (input_ids >= vocab).any():
        problems.append(f"token id {int(input_ids.max())} >= vocabulary {vocab} at {_where(input_ids >= vocab)}")
    return problems


def topk_problems(topk_ids: np.ndarray, topk_logprobs: np.ndarray, vocab: int | None, row_offset: int = 0) -> list[str]:
    """topk_ids (rows, T, K) int32, topk_logprobs (rows, T, K) float16|float32: the top-K contract, one line per
    failed check."""
    dtype = "float16" if topk_logprobs.dtype == np.float16 else "float32"
    logprobs = topk_logprobs.astype(np.float32)  # (rows, T, K)

    def at(mask: np.ndarray) -> str:  # mask (rows, T)
        return _where(mask, row_offset)

    problems = []
    if (topk_ids < 0).any():
        problems.append(f"negative top-K id at {at((topk_ids < 0).any(-1))}")
    if vocab is not None and (topk_ids >= vocab).any():
        problems.append(f"top-K id {int(topk_ids.max())} >= vocabulary {vocab} at {at((topk_ids >= vocab).any(-1))}")
    sorted_ids = np.sort(topk_ids, axis=-1)  # (rows, T, K)
    duplicate = (sorted_ids[..., 1:] == sorted_ids[..., :-1]).any(-1)  # (rows, T)
    if duplicate.any():
        problems.append(f"a top-K id appears twice at {at(duplicate)}")
    finite = np.isfinite(logprobs).all(-1)  # (rows, T)
    if not finite.all():
        problems.append(f"non-finite log-prob at {at(~finite)}")
        # Such positions get a harmless stand-in (sorted, <= 0, tiny mass) so the checks below report other
        # problems only.
        logprobs = np.where(finite[..., None], logprobs, np.float32(-30.0))
    positive = (logprobs > LOGPROB_SLACK[dtype]).any(-1)  # (rows, T)
    if positive.any():
        problems.append(f"positive log-prob {float(logprobs.max()):.4g} at {at(positive)}")
    unsorted = (np.diff(logprobs, axis=-1) > 0).any(-1)  # (rows, T): ties are fine
    if unsorted.any():
        problems.append(f"log-probs not sorted descending along K at {at(unsorted)}")
    tail_mass = 1.0 - np.exp(logprobs.astype(np.float64)).sum(-1)  # (rows, T)
    negative_tail = tail_mass < -TAIL_SLACK[dtype]
    if negative_tail.any():
        problems.append(f"tail mass 1 - sum(exp(log-probs)) = {float(tail_mass.min()):.4g} < 0 at {at(negative_tail)}")
    return problems


def mass_tolerance(codec: TopkCodec) -> float:
    """How far sum(p) + exp(tail) of a decoded v2 position may be from 1: the values' quantisation bound
    (|sqrt(p) error| <= 1/2L per entry sums to at most sqrt(K)/L + K/4L^2), plus the tail's float16 rounding."""
    if codec.values == "sqrt":
        values = codec.top_k**0.5 / codec.levels + codec.top_k / (4 * codec.levels**2)
    else:
        values = TAIL_SLACK[codec.values]
    return values + (1e-3 if codec.tail == "float16" else 1e-5)


def topk_v2_problems(decoded: DecodedTopk, codec: TopkCodec, vocab: int | None, row_offset: int = 0) -> list[str]:
    """Rows of a decoded v2 shard: kept ids within the teacher's vocabulary, each position's mass 1 within
    `mass_tolerance` (the decoder already checked ids, order, ranges and the tail's sign)."""
    kept = np.arange(codec.top_k) < decoded.kept[..., None]  # (rows, T, K)
    problems = []
    beyond = (np.where(kept, decoded.ids, 0) >= vocab).any(-1) if vocab is not None else None  # (rows, T)
    if beyond is not None and beyond.any():
        problems.append(f"top-K id {int(decoded.ids.max())} >= vocabulary {vocab} at {_where(beyond, row_offset)}")
    mass = np.where(kept, np.exp(decoded.logprobs.astype(np.float64)), 0.0).sum(-1)
    if codec.normalisation == "full":  # a top_k store's K alone sum to 1 (its tail is unknown, decoded as NaN)
        mass = mass + np.exp(decoded.tail.astype(np.float64))
    tolerance = mass_tolerance(codec)
    wrong = np.abs(mass - 1.0) > tolerance  # (rows, T)
    if decoded.target is not None:  # positions without a target hold no distribution
        wrong &= decoded.target
    if wrong.any():
        worst = float(mass.flat[np.abs(mass - 1.0).argmax()])
        problems.append(f"stored ids and tail hold mass {worst:.4g}, not 1 (+-{tolerance:.2g}) at "
                        f"{_where(wrong, row_offset)}")
    return problems
