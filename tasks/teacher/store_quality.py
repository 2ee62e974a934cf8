"""What a top-K store costs and how close it stays to the teacher: the store report (no Prefect here).

Without a teacher (`store_summary`): bytes per position, every byte of the store (`kdflow.schemas.store_bytes`),
the format and codec, and over a sample of rows the tail-mass histogram and how many positions keep how many
ids (adaptive K). With the teacher (`teacher_fidelity`): a few rows re-run through it, float32 logits over the
full vocabulary as at capture, and two figures per position:
- `kl_teacher_store_*`: the store metric, KL(teacher || what the store implies) over the whole vocabulary, from a dense
  teacher pass (`kdflow.tasks.teacher.store_metric`, run by `kdflow.tasks.teacher.store_fidelity`): one
  definition for every store kind, comparable across stores (smaller is more faithful);
- `kl_buckets_lower_bound_*`: KL(exact || stored) over the K+1 buckets "each id both hold, everything else",
  the stored side normalised (what the loss fits the student to). It depends on the partition (a store holding
  fewer ids merges more of them into the rest bucket, which can only lower it): a lower bound of the full KL,
  not comparable across stores. Where a re-run picks other ids it is over the common ids plus one rest bucket,
  and the report counts those positions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kdflow.schemas.codec import DecodedTopk
from kdflow.schemas.commits import CommitRecord, list_commits, read_complete, stage_dir
from kdflow.schemas.shards import TopkShard, read_token_shard
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_bytes import store_bytes
from kdflow.schemas.store_info import format_label, read_store_info
from kdflow.tasks.teacher.sampled_quality import sampled_fidelity, sampled_markdown, sampled_summary
from kdflow.tasks.teacher.sampled_step import TeacherSampledStep
from kdflow.tasks.teacher.store_fidelity import bucket_fields, bucket_kl, full_fidelity
from kdflow.tasks.teacher.store_metric import STORE_KL

TAIL_EDGES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)  # tail-mass histogram: 0, then below each edge, then the rest


def sample_rows(records: dict[int, CommitRecord], count: int) -> list[tuple[int, int]]:
    """(shard id, row) pairs spread evenly over the committed rows, in order; at most `count`."""
    order = sorted(records)
    offsets = np.cumsum([0] + [records[i].rows for i in order])
    total = int(offsets[-1])
    if total == 0 or count <= 0:
        return []
    picks = np.unique(np.linspace(0, total - 1, min(count, total)).round().astype(np.int64))
    shard = np.searchsorted(offsets, picks, side="right") - 1
    return [(order[s], int(p - offsets[s])) for s, p in zip(shard, picks, strict=True)]


def tail_histogram(tail_logprob: np.ndarray) -> dict[str, int]:
    """Positions by tail mass exp(tail): exactly 0, then decades up to 1."""
    mass = np.exp(tail_logprob.astype(np.float64)).ravel()
    labels = ["0"] + [f"<{edge:g}" for edge in TAIL_EDGES] + [f">={TAIL_EDGES[-1]:g}"]
    bins = np.where(mass == 0, 0, 1 + np.searchsorted(np.asarray(TAIL_EDGES), mass, side="right"))
    return {label: int(n) for label, n in zip(labels, np.bincount(bins, minlength=len(labels)), strict=True)}


def kept_histogram(kept: np.ndarray, top_k: int) -> dict[str, int]:
    """Positions by how many ids they keep, in power-of-two bins: "1", "2", "3-4", "5-8", ... up to top_k."""
    counts, low = {}, 1
    while low <= top_k:
        high = min(top_k, low if low <= 2 else 2 * (low - 1))  # 1, 2, 3-4, 5-8, 9-16, ...
        counts[str(low) if low == high else f"{low}-{high}"] = int(((kept >= low) & (kept <= high)).sum())
        low = high + 1
    return counts


def store_summary(run_root: RunRoot, tag: str, rows: int = 256) -> dict[str, Any]:
    """Bytes/position (every byte of the store: `kdflow.schemas.store_bytes`), format and codec, and the tail and
    kept-id histograms over `rows` rows."""
    store = stage_dir(run_root, "topk", tag)
    done = read_complete(run_root, store)
    records = list_commits(run_root, store, "topk", done.fingerprint if done else tag)
    info = read_store_info(run_root, store)
    positions = sum(r.tokens for r in records.values())
    summary: dict[str, Any] = {
        "tag": tag, "store": run_root.display(store), "shards": len(records), "positions": positions,
        **store_bytes(run_root, store, records).fields(),
        "format": info.format if info is not None else None,
        "format_label": format_label(info.store_format()) if info is not None else "unknown (no _store.json)",
        "codec": info.codec if info is not None else None,
    }
    picks = sample_rows(records, rows)
    if not picks:
        return summary
    if info is not None and info.targets != "topk":  # hybrid / sampled targets: kdflow.tasks.teacher.sampled_quality
        return summary | sampled_summary(run_root, store, records, picks, tail_histogram)
    shards: dict[int, TopkShard] = {}
    decoded = []
    for shard_id, row in picks:
        if shard_id not in shards:
            shards[shard_id] = TopkShard(run_root, f"{store}/{records[shard_id].data_file}")
        decoded.append(shards[shard_id].read([row]))
    # positions with a teacher target only (a masked store's others hold none), as (m,)
    target = np.concatenate([d.target if d.target is not None else np.ones(d.kept.shape, bool) for d in decoded])
    tails = np.concatenate([d.tail for d in decoded])[target]
    kept = np.concatenate([d.kept for d in decoded])[target]
    first = next(iter(shards.values()))
    top_k = first.top_k
    known = getattr(first.codec, "normalisation", "full") == "full"  # renormalised over K: no tail to show
    if not known:  # the store settings' tail kind is not stored at all
        summary["format_label"] = summary["format_label"].replace(
            f"tail {first.codec.tail}", "no tail (log-probs renormalised over the K)")
    summary |= {
        "v1_bytes_per_position": 8 * top_k if first.format == 1 and first.logprobs.dtype == np.float32 else 6 * top_k,
        "schema_bytes_per_shard": len(first.table.schema.serialize()),
        "sampled_rows": len(picks), "sampled_positions": int(tails.size),
        "positions_without_target": int((~target).sum()),
        "mean_tail_mass": float(np.exp(tails.astype(np.float64)).mean()) if known and tails.size else None,
        "tail_mass_histogram": tail_histogram(tails) if known else None,
        "invalid_tails": int((np.isnan(tails) | (tails > 0)).sum()) if known else 0,
        "mean_kept": float(kept.mean()) if kept.size else 0.0, "kept_histogram": kept_histogram(kept, top_k),
    }
    if first.format == 1:  # v1 derives its tail as 1 - sum: count where that came out <= 0 (clamped)
        summary["v1_tails_clamped_to_zero"] = int(np.isneginf(tails).sum())
    return summary


def teacher_fidelity(step: Any, run_root: RunRoot, tag: str, picks: list[tuple[int, int]],
                     micro_batch: int) -> dict[str, Any]:
    """Re-run `step` (a TeacherTopkStep: the teacher, float32 logits over the full vocabulary) on the picked
    (shard, row) pairs and compare with what the store decodes: the full KL (a dense pass) and the K+1-bucket
    lower bound, mean / max / p99, and agreement."""
    import torch

    if isinstance(getattr(step, "step", step), TeacherSampledStep):  # a store of sampled targets
        return sampled_fidelity(step, run_root, tag, picks, micro_batch)
    store, tokens_store = stage_dir(run_root, "topk", tag), stage_dir(run_root, "tokens")
    token_records, records = list_commits(run_root, tokens_store, "tokens"), list_commits(run_root, store, "topk")
    input_ids = np.stack([read_token_shard(run_root, f"{tokens_store}/{token_records[s].data_file}")[r]
                          for s, r in picks])
    stored = [TopkShard(run_root, f"{store}/{records[s].data_file}").read([r]) for s, r in picks]
    stored = DecodedTopk(*(None if field[0] is None else np.concatenate(field) for field in zip(*stored)))
    device = next(step.model.parameters()).device
    parts = []
    with torch.inference_mode():
        for start in range(0, len(input_ids), micro_batch):
            batch = torch.from_numpy(input_ids[start:start + micro_batch].astype(np.int64)).to(device)
            ids, logprobs, tail = step(batch)  # (b, T, K), (b, T, K), (b, T)
            parts.append((ids.cpu().numpy(), logprobs.cpu().numpy(), tail.cpu().numpy()))
    exact_ids, exact_logprobs, exact_tail = (np.concatenate(p) for p in zip(*parts))
    exact = DecodedTopk(exact_ids, exact_logprobs, exact_tail, np.full(exact_tail.shape, exact_ids.shape[-1], np.int32))
    kl, agree = bucket_kl(exact, stored)
    kept = np.arange(stored.ids.shape[-1]) < stored.kept[..., None]
    full = full_fidelity(step.model, input_ids, np.where(kept, stored.ids, -1), stored.logprobs, stored.tail,
                         micro_batch)
    return {"kl_rows": len(picks), "kl_positions": int(kl.size), **full, **bucket_fields(kl),
            "positions_with_other_ids": int((~agree).sum())}


def pass_fidelity(step: Any, run_root: RunRoot, tag: str, shard_ids: list[int], rows: int, micro_batch: int
                  ) -> dict[str, Any] | None:
    """`teacher_fidelity` on `rows` rows spread over the given committed shards (what a pass just wrote)."""
    records = list_commits(run_root, stage_dir(run_root, "topk", tag), "topk", tag)
    picks = sample_rows({i: records[i] for i in shard_ids if i in records}, rows)
    return teacher_fidelity(step, run_root, tag, picks, micro_batch) if picks else None


def report_markdown(summary: dict[str, Any]) -> str:
    """The report as Markdown (the Prefect artifact, and `kdflow store report`'s text)."""
    lines = [f"### top-K store {summary['tag']}: {summary['format_label']}", "",
             "| | |", "|---|---|",
             f"| shards | {summary['shards']} |", f"| positions | {summary['positions']:,} |",
             f"| bytes / position (every file of the store) | {summary['bytes_per_position']} "
             f"(v1 at this K: {summary.get('v1_bytes_per_position', '-')}) |"]
    lines += sampled_markdown(summary)
    for key, name in ((STORE_KL, "full-vocabulary KL(teacher \u2016 store), the store metric"),
                      ("kl_buckets_lower_bound", "K+1-bucket KL (a lower bound, depends on the ids held)")):
        if f"{key}_mean" in summary:
            lines.append(f"| {name}, nats/position | mean {summary[f'{key}_mean']:.3g}, p99 "
                         f"{summary[f'{key}_p99']:.3g}, max {summary[f'{key}_max']:.3g} "
                         f"over {summary['kl_positions']:,} positions |")
    if "kl_note" in summary:  # why there is no KL: said in the table, not only in --json
        lines.append(f"| KL to the teacher | {summary['kl_note']} |")
    if "mean_tail_mass" in summary:
        sample = f"{summary['sampled_positions']:,} positions of {summary['sampled_rows']:,} rows sampled"
        sample += (f" ({summary['positions_without_target']:,} without a teacher target left out)"
                   if summary.get("positions_without_target") else "")
        histogram = summary["tail_mass_histogram"]
        lines += [f"| mean tail mass | {summary['mean_tail_mass']:.4f} (invalid tails: {summary['invalid_tails']}) "
                  f"over {sample} |" if histogram is not None else
                  "| mean tail mass | unknown: log-probs renormalised over the K, no tail stored |",
                  f"| mean ids kept | {summary['mean_kept']:.1f} over "
                  f"{'the same' if histogram is not None else sample} |", "",
                  f"histograms over the {sample}:", ""]
        if histogram is not None:
            lines += ["tail mass | " + " | ".join(histogram), "|".join(["---"] * (len(histogram) + 1)),
                      "positions | " + " | ".join(str(v) for v in histogram.values()), ""]
        lines += ["ids kept | " + " | ".join(summary["kept_histogram"]),
                  "|".join(["---"] * (len(summary["kept_histogram"]) + 1)),
                  "positions | " + " | ".join(str(v) for v in summary["kept_histogram"].values())]
    return "\n".join(lines) + "\n"
