"""The store metric: how far what a store implies is from the teacher's FULL distribution (numpy only).

Every store kind holds some ids with their probabilities and one mass for every id it does not hold: top-K its
kept ids and its tail, adaptive K fewer ids and a larger tail, hybrid the head and the sampled ids with what the
head's tail leaves once the samples are taken out, sampled only the samples and 1 minus their mass. The
distribution the store implies, q, is the held ids at their stored probability and that rest spread evenly over
the ids not held (V - held ids), normalised to 1. The metric is KL(teacher || q) over the whole vocabulary, per
position, in nats: one definition for every store, so a smaller number is a more faithful store. With exact
values, holding one more id never raises it (chain rule: the split off id's binary KL is >= 0), so adaptive K
scores at least as high as full K on the same rows; the K+1-bucket KL (`store_fidelity.bucket_kl`) merges the ids a
store does not hold into one bucket on both sides, which can only lower KL: it is a lower bound that depends on
the partition, and is reported under that name.

`full_kl_dense` takes the teacher's log-probs over the vocabulary (a dense teacher pass); `full_kl_from_topk`
takes the teacher's exact top-K, its tail and the tail's sum of p log p (what a dense pass leaves once its top-K
is kept), for stores whose ids are among the teacher's top-K (every top-K codec setting), without V-wide arrays.
"""

from __future__ import annotations

import numpy as np

from kdflow.schemas.codec import DecodedTopk

# The store metric's key prefix in reports: KL(teacher || store). Its own name, because eval.jsonl's `kl_full` is
# KL(teacher || student), and one key must not mean two things.
STORE_KL = "kl_teacher_store"


def _rest_logq(stored_p: np.ndarray, rest: np.ndarray, held: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """-> log Z (the stored total) and the log of q at each id not held, both (P,), float64."""
    with np.errstate(divide="ignore"):
        log_z = np.log(stored_p.sum(-1) + rest)
        others = np.maximum(vocab - held.sum(-1), 1)
        return log_z, np.log(rest) - log_z - np.log(others)


def full_kl_dense(teacher_logprobs: np.ndarray, held_ids: np.ndarray, held_logprobs: np.ndarray,
                  rest_logprob: np.ndarray) -> np.ndarray:
    """KL(teacher || q) per position over the vocabulary, float64. teacher_logprobs (P, V) normalised log-probs;
    held_ids (P, M) the ids the store holds (-1: none), held_logprobs (P, M) their stored log-probs, rest_logprob
    (P,) the log of the mass the store keeps for every id it does not hold (spread evenly over them)."""
    positions, vocab = teacher_logprobs.shape
    held = held_ids >= 0
    stored_p = np.where(held, np.exp(held_logprobs.astype(np.float64)), 0.0)
    log_z, rest_logq = _rest_logq(stored_p, np.exp(rest_logprob.astype(np.float64)), held, vocab)
    out = np.empty(positions)
    for start in range(0, positions, 64):  # (64, V) float64 at a time
        stop = min(start + 64, positions)
        log_p = teacher_logprobs[start:stop].astype(np.float64)
        log_q = np.repeat(rest_logq[start:stop, None], vocab, 1)
        rows, cols = np.nonzero(held[start:stop])
        with np.errstate(divide="ignore"):
            log_q[rows, held_ids[start:stop][rows, cols]] = np.log(stored_p[start:stop][rows, cols]) - \
                log_z[start:stop][rows]
        p = np.exp(log_p)
        with np.errstate(invalid="ignore"):
            out[start:stop] = np.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    return out


def full_kl_from_topk(exact: DecodedTopk, tail_plogp: np.ndarray, vocab: int, stored: DecodedTopk) -> np.ndarray:
    """`full_kl_dense` of a top-K store without the dense log-probs: exact is the teacher's own top-K (all K kept)
    and tail (log of the mass outside it), tail_plogp (n, T) the sum of p log p over the ids outside the exact
    top-K, from the dense pass. Every id the store keeps must be among the exact ones (ValueError otherwise).
    -> (n, T) float64."""
    n, seq_len, _ = exact.ids.shape
    out = np.empty((n, seq_len))
    for row in range(n):
        kept = np.arange(stored.ids.shape[-1]) < stored.kept[row][:, None]  # (T, Ks)
        stored_ids = np.where(kept, stored.ids[row], -1)
        match = exact.ids[row][:, :, None] == stored_ids[:, None, :]  # (T, Ke, Ks)
        if (match.any(1).sum(-1) != kept.sum(-1)).any():
            raise ValueError("the store keeps ids outside the teacher's top-K: use full_kl_dense")
        stored_p = np.where(kept, np.exp(stored.logprobs[row].astype(np.float64)), 0.0)
        held_e = match.any(-1)  # (T, Ke): exact entries the store holds
        stored_e = (match * stored_p[:, None, :]).sum(-1)  # their stored probabilities
        log_p = exact.logprobs[row].astype(np.float64)
        p = np.exp(log_p)
        log_z, rest_logq = _rest_logq(stored_p, np.exp(stored.tail[row].astype(np.float64)), kept, vocab)
        with np.errstate(divide="ignore", invalid="ignore"):
            held_terms = np.where(held_e & (p > 0), p * (log_p - np.log(stored_e) + log_z[:, None]), 0.0).sum(-1)
            free_plogp = np.where(~held_e & (p > 0), p * log_p, 0.0).sum(-1) + tail_plogp[row]
            free_mass = np.where(held_e, 0.0, p).sum(-1) + np.exp(exact.tail[row].astype(np.float64))
            out[row] = held_terms + free_plogp - np.where(free_mass > 0, free_mass * rest_logq, 0.0)
    return out


def tail_plogp_dense(logprobs: np.ndarray, top_ids: np.ndarray) -> np.ndarray:
    """sum of p log p over the ids outside top_ids, per position: logprobs (P, V), top_ids (P, K) -> (P,)."""
    out = np.empty(logprobs.shape[0])
    for start in range(0, logprobs.shape[0], 64):
        log_p = logprobs[start:start + 64].astype(np.float64)
        terms = np.where(np.isfinite(log_p), np.exp(log_p) * log_p, 0.0)
        np.put_along_axis(terms, top_ids[start:start + 64].astype(np.int64), 0.0, 1)
        out[start:start + 64] = terms.sum(-1)
    return out


def kl_summary(kl: np.ndarray, prefix: str) -> dict[str, float | int]:
    """mean / p99 / max of the finite values, and how many are infinite (a stored zero where the teacher has
    mass), under `prefix`."""
    finite = np.isfinite(kl)
    values = kl[finite] if finite.any() else np.zeros(1)
    return {f"{prefix}_mean": float(values.mean()), f"{prefix}_p99": float(np.quantile(values, 0.99)),
            f"{prefix}_max": float(values.max()), f"{prefix}_infinite_positions": int((~finite).sum())}
