"""How close a store's rows stay to the teacher re-run on them: the two figures of the store report, for top-K
and sampled stores alike (kdflow.tasks.teacher.store_quality, kdflow.tasks.teacher.sampled_quality).

- `full_fidelity`: the store metric (kdflow.tasks.teacher.store_metric) over the whole vocabulary, from a dense
  teacher pass (`dense_logprobs`), as `kl_teacher_store_*`;
- `bucket_kl`: KL(exact || stored) over the K+1 buckets "each id both hold, everything else", a lower bound of
  the full KL that depends on the ids held, as `kl_buckets_lower_bound_*` (`bucket_fields`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kdflow.schemas.codec import DecodedTopk
from kdflow.tasks.teacher.store_metric import STORE_KL, full_kl_dense, kl_summary


def bucket_kl(exact: DecodedTopk, stored: DecodedTopk) -> tuple[np.ndarray, np.ndarray]:
    """KL(exact || stored) per position (n, T) in float64 over "each id both hold" + one rest bucket, the stored
    side normalised; and (n, T) whether the kept stored ids are all among the exact ones."""
    n, seq_len, top_k = exact.ids.shape
    kl, agree = np.empty((n, seq_len)), np.empty((n, seq_len), dtype=bool)
    for row in range(n):  # (T, K, K) comparisons per row bound the memory
        kept = np.arange(top_k) < stored.kept[row][:, None]  # (T, K)
        stored_ids = np.where(kept, stored.ids[row], -1)
        common_e = (exact.ids[row][:, :, None] == stored_ids[:, None, :]).any(-1)  # (T, K): exact id also stored
        common_s = (stored_ids[:, :, None] == exact.ids[row][:, None, :]).any(-1) & kept  # (T, K)
        p_e, p_s = np.exp(exact.logprobs[row].astype(np.float64)), np.exp(stored.logprobs[row].astype(np.float64))
        p_s = np.where(kept, p_s, 0.0)
        # the same ids in the same order on both sides: sort each side's common ids by id
        order_e = np.argsort(np.where(common_e, exact.ids[row], np.iinfo(np.int32).max), axis=-1, kind="stable")
        order_s = np.argsort(np.where(common_s, stored_ids, np.iinfo(np.int32).max), axis=-1, kind="stable")
        top_e = np.take_along_axis(np.where(common_e, p_e, 0.0), order_e, -1)
        top_s = np.take_along_axis(np.where(common_s, p_s, 0.0), order_s, -1)
        rest_e = np.exp(exact.tail[row].astype(np.float64)) + np.where(common_e, 0.0, p_e).sum(-1)
        rest_s = np.exp(stored.tail[row].astype(np.float64)) + np.where(common_s, 0.0, p_s).sum(-1)
        p = np.concatenate([top_e, rest_e[:, None]], -1)
        q = np.concatenate([top_s, rest_s[:, None]], -1)
        p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
        kl[row], agree[row] = terms.sum(-1), (common_s == kept).all(-1)
    return kl, agree


def bucket_fields(kl: np.ndarray) -> dict[str, float]:
    """The K+1-bucket KL's summary, named for what it is."""
    return {"kl_buckets_lower_bound_mean": float(kl.mean()), "kl_buckets_lower_bound_max": float(kl.max()),
            "kl_buckets_lower_bound_p99": float(np.quantile(kl, 0.99))}


def dense_logprobs(model: Any, input_ids: np.ndarray, micro_batch: int, chunk: int = 256) -> Any:
    """The teacher's float32 log-probs over the full vocabulary (its own final-logit transform applied), (<= chunk,
    V) at a time, positions in row-major order: a dense pass, for the store metric."""
    import torch

    from kdflow.tasks.common.models import body_hidden_states, final_logit_transform, output_layer

    lm_head, transform = output_layer(model), final_logit_transform(model.config)
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(input_ids), micro_batch):
            batch = torch.from_numpy(input_ids[start:start + micro_batch].astype(np.int64)).to(device)
            hidden = body_hidden_states(model, batch).flatten(0, 1)  # (b * T, H)
            for first in range(0, hidden.shape[0], chunk):
                logits = lm_head(hidden[first:first + chunk]).float()
                if not transform.is_identity:
                    transform.apply_(logits)
                yield torch.log_softmax(logits, -1).cpu().numpy()


def full_fidelity(model: Any, input_ids: np.ndarray, held_ids: np.ndarray, held_logprobs: np.ndarray,
                  rest_logprob: np.ndarray, micro_batch: int) -> dict[str, Any]:
    """The store metric on the picked rows: held_ids (n, T, M) (-1: none) with their stored log-probs, rest (n, T)
    the log of the store's mass for every other id. -> kl_teacher_store_mean / _p99 / _max / _infinite_positions."""
    held_ids = held_ids.reshape(-1, held_ids.shape[-1])
    held_logprobs = held_logprobs.reshape(held_ids.shape)
    rest_logprob, parts, done = rest_logprob.ravel(), [], 0
    for logprobs in dense_logprobs(model, input_ids, micro_batch):
        stop = done + len(logprobs)
        parts.append(full_kl_dense(logprobs, held_ids[done:stop], held_logprobs[done:stop], rest_logprob[done:stop]))
        done = stop
    return kl_summary(np.concatenate(parts), STORE_KL)
