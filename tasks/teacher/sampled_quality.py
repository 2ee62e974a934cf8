"""The store report for sampled targets (`precompute.targets: sampled | hybrid`), beside the top-K one in
`kdflow.tasks.teacher.store_quality`.

Without a teacher (`sampled_summary`, over sampled rows): the tail mass outside the head, how many sampled
tokens carry their own probability as weight (p >= tau, drawn for sure), how many positions had their
whole tail sampled, and the Horvitz-Thompson check sum W / p_o (sum of the weights over the exact tail
mass: 1 in expectation, its spread is the estimator's noise). With the teacher (`sampled_fidelity`): the
picked rows' micro-batches re-run exactly as the pass ran them (same shapes, same seed), the store metric (the
full-vocabulary KL to what the store implies: head and sampled ids at their stored probabilities, the rest of
the head's tail spread evenly over the other ids; `kdflow.tasks.teacher.store_metric`), the head's K+1 bucket
KL (what the codec's quantisation lost; a lower bound), and the draws compared id for id (a rerun must draw
the same samples: positions that differ are counted).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kdflow.schemas.codec import DecodedTopk
from kdflow.schemas.codec_sampled import DecodedSampled, SampledShard
from kdflow.schemas.commits import CommitRecord, list_commits, stage_dir
from kdflow.schemas.shards import read_token_shard
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.sampled import ht_weights
from kdflow.tasks.teacher.store_fidelity import bucket_fields, bucket_kl, full_fidelity


def _head(targets: DecodedSampled) -> DecodedTopk:
    return DecodedTopk(targets.head_ids, targets.head_logprobs, targets.tail_logprob,
                       np.full(targets.tail_logprob.shape, targets.head_ids.shape[-1], np.int32))


def sampled_summary(run_root: RunRoot, store: str, records: dict[int, CommitRecord], picks: list[tuple[int, int]],
                    tail_histogram: Any) -> dict[str, Any]:
    """The report's teacher-free part for a sampled store, over the picked (shard, row) pairs."""
    import torch

    shards: dict[int, SampledShard] = {}
    for shard_id, _ in picks:
        shards.setdefault(shard_id, SampledShard(run_root, f"{store}/{records[shard_id].data_file}"))
    rows = [shards[s].read([r]) for s, r in picks]
    targets = DecodedSampled(*(np.concatenate(field) for field in zip(*rows, strict=True)))
    codec = next(iter(shards.values())).codec
    weights = ht_weights(torch.from_numpy(targets.sample_logprobs.astype(np.float64)),
                         torch.from_numpy(targets.log_threshold.astype(np.float64)), codec.scheme).numpy()  # (n, T, S)
    tail = np.exp(targets.tail_logprob.astype(np.float64))  # (n, T)
    ratio = weights.sum(-1)[tail > 0] / tail[tail > 0]
    values = np.concatenate([targets.head_logprobs, targets.sample_logprobs, targets.tail_logprob[..., None]], -1)
    return {
        "targets": codec.kind, "head": codec.head, "samples": codec.samples, "scheme": codec.scheme, "seed": codec.seed,
        "schema_bytes_per_shard": len(next(iter(shards.values())).table.schema.serialize()),
        "sampled_rows": len(picks), "sampled_positions": int(tail.size),
        "mean_tail_mass": float(tail.mean()), "tail_mass_histogram": tail_histogram(targets.tail_logprob),
        "invalid_tails": int((np.isnan(values) | (values > 1e-3)).any(-1).sum()),
        "samples_drawn_for_sure": float((targets.sample_logprobs >= targets.log_threshold[..., None]).mean()),
        "positions_whole_tail_sampled": int(np.isneginf(targets.log_threshold).sum()),
        "weight_sum_over_tail_mean": float(ratio.mean()) if ratio.size else None,
        "weight_sum_over_tail_sd": float(ratio.std()) if ratio.size else None,
        "mean_kept": float(codec.head), "kept_histogram": {str(codec.head): int(tail.size)},  # the head: always H
    }


def sampled_fidelity(step: Any, run_root: RunRoot, tag: str, picks: list[tuple[int, int]], micro_batch: int
                     ) -> dict[str, Any]:
    """Re-run `step` (a TeacherSampledStep, or the pass's SampledPass) on the micro-batches of the picked rows and
    compare with the store: the head's K+1 bucket KL and the draws, id for id."""
    import torch

    step = getattr(step, "step", step)  # SampledPass -> its TeacherSampledStep
    store, tokens_store = stage_dir(run_root, "topk", tag), stage_dir(run_root, "tokens")
    token_records, records = list_commits(run_root, tokens_store, "tokens"), list_commits(run_root, store, "topk")
    device = next(step.model.parameters()).device
    exact, stored, input_ids = [], [], []
    for shard_id, row in picks:
        tokens = read_token_shard(run_root, f"{tokens_store}/{token_records[shard_id].data_file}")  # (rows, T)
        first = row - row % micro_batch  # the pass's micro-batch holding `row`, padded as the pass padded it
        batch = np.zeros((micro_batch, tokens.shape[1]), np.int64)
        batch[:len(tokens[first:first + micro_batch])] = tokens[first:first + micro_batch]
        with torch.inference_mode():
            drawn = step(torch.from_numpy(batch).to(device), shard=shard_id, first_row=first)
        exact.append(DecodedSampled(*(getattr(drawn, f).cpu().numpy()[row - first:row - first + 1]
                                      for f in DecodedSampled._fields)))
        stored.append(SampledShard(run_root, f"{store}/{records[shard_id].data_file}").read([row]))
        input_ids.append(tokens[row])
    exact, stored = (DecodedSampled(*(np.concatenate(f) for f in zip(*parts, strict=True)))
                     for parts in (exact, stored))
    same = (np.sort(exact.sample_ids, -1) == np.sort(stored.sample_ids, -1)).all(-1)  # (n, T)
    result = {"kl_rows": len(picks), "kl_positions": int(same.size), "positions_with_other_samples": int((~same).sum())}
    sample_p = np.exp(stored.sample_logprobs.astype(np.float64)).sum(-1)
    with np.errstate(divide="ignore"):  # the head's tail less the samples; 0 (an infinite KL) only if rounded away
        rest = np.log(np.maximum(np.exp(stored.tail_logprob.astype(np.float64)) - sample_p, 0.0))
    result |= full_fidelity(step.model, np.stack(input_ids), np.concatenate([stored.head_ids, stored.sample_ids], -1),
                            np.concatenate([stored.head_logprobs, stored.sample_logprobs], -1), rest, micro_batch)
    if exact.head_ids.shape[-1]:
        kl, agree = bucket_kl(_head(exact), _head(stored))
        result |= bucket_fields(kl) | {"positions_with_other_ids": int((~agree).sum())}
    return result


def sampled_markdown(summary: dict[str, Any]) -> list[str]:
    """The report's table rows for a sampled store."""
    if "samples" not in summary:
        return []
    lines = [f"| targets | {summary['targets']}: head {summary['head']}, samples {summary['samples']} "
             f"({summary['scheme']}, seed {summary['seed']}) |",
             f"| sampled tokens drawn for sure (p >= tau) | {summary['samples_drawn_for_sure']:.2%} |",
             f"| positions whose whole tail was sampled | {summary['positions_whole_tail_sampled']} |"]
    if summary.get("weight_sum_over_tail_mean") is not None:
        lines.append(f"| sum of weights / exact tail mass (1 in expectation) | "
                     f"mean {summary['weight_sum_over_tail_mean']:.4f}, sd {summary['weight_sum_over_tail_sd']:.4f} |")
    if "positions_with_other_samples" in summary:
        lines.append(f"| re-drawn positions with other samples | {summary['positions_with_other_samples']} of "
                     f"{summary['kl_positions']:,} |")
    return lines
