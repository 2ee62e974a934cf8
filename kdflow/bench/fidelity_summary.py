"""`kdflow bench fidelity`'s summary: per variant the means and spreads over seeds, byte ratios against both
top-128 stores, paired differences against top-128 with t intervals, each variant's share of the student's gap
to the teacher closed, the held-out KL curves, and the targets, each `met` only when its interval lies on the
right side of the bound (`kdflow.bench.fidelity_stats`).

The share of the gap closed is measured from where the student starts, its own step-0 evaluation (a pruned
student starts near the teacher, a random one far): for held-out full KL, whose floor is 0,
(KL at step 0 - KL at the end) / KL at step 0; for held-out CE, whose floor is the teacher's own CE on the same
rows, (CE at step 0 - CE at the end) / (CE at step 0 - the teacher's CE). 1 is the teacher reached, 0 no
progress, below 0 worse than the start."""

from __future__ import annotations

import statistics
from typing import Any

from kdflow.bench.fidelity_stats import MET, NOT_MET, paired, paired_interval, verdict

METRICS = ("heldout_ce", "heldout_kl", "heldout_top1_agreement", "train_seconds")
REFERENCES = {"default_codec": "codec", "lossless": "topk128"}  # byte ratios against these variants' stores


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    return (statistics.fmean(values) if values else None), (statistics.stdev(values) if len(values) > 1 else None)


def store_of(variant: str, seed: int) -> str:
    """The store a variant trains on: top-128 for online (its data order) and CE; sampled stores drawn per seed."""
    if variant == "codec":
        return "codec"
    return "topk128" if variant in ("topk128", "online", "ce") else f"{variant}-seed{seed}"


def gap_closed(run: dict[str, Any], teacher_ce: float | None) -> dict[str, float | None]:
    """One run's share of its gap to the teacher closed, in held-out KL and CE (see the module docstring); None
    where the run has no step-0 evaluation or starts at (or, for CE, below) the floor."""
    start = next((point for point in run.get("curve", []) if point["step"] == 0), None)
    if start is None:
        return {"kl_gap_closed": None, "ce_gap_closed": None}
    kl_gap = start["heldout_kl"]
    ce_gap = None if teacher_ce is None or "heldout_ce" not in start else start["heldout_ce"] - teacher_ce
    return {"kl_gap_closed": (kl_gap - run["heldout_kl"]) / kl_gap if kl_gap > 0 else None,
            "ce_gap_closed": (start["heldout_ce"] - run["heldout_ce"]) / ce_gap if ce_gap and ce_gap > 0 else None}


def _variant(variant: str, runs: list[dict[str, Any]], stores: dict[str, dict[str, Any]],
             teacher_ce: float | None) -> dict[str, Any]:
    mine = [r for r in runs if r["variant"] == variant]
    record: dict[str, Any] = {"kind": "variant", "variant": variant, "seeds": [r["seed"] for r in mine]}
    for key in METRICS:
        record[key], record[f"{key}_seed_sd"] = _mean_sd([r[key] for r in mine])
    shares = {r["seed"]: gap_closed(r, teacher_ce) for r in mine}
    for key in ("kl_gap_closed", "ce_gap_closed"):
        known = [share[key] for share in shares.values() if share[key] is not None]
        record[key], record[f"{key}_seed_sd"] = _mean_sd(known) if len(known) == len(mine) else (None, None)
    record["heldout_kl_start"], _ = _mean_sd([p["heldout_kl"] for r in mine for p in r.get("curve", [])[:1]
                                              if p["step"] == 0])
    record["teacher_heldout_ce"] = teacher_ce
    sizes = [stores[store_of(variant, r["seed"])]["bytes_per_position"] for r in mine
             if store_of(variant, r["seed"]) in stores]
    size = None if variant in ("online", "ce") or not sizes else statistics.fmean(sizes)
    record["bytes_per_position"] = size
    for name, reference in REFERENCES.items():
        base = stores.get(store_of(reference, 0), {}).get("bytes_per_position")
        record[f"bytes_over_{name}_topk128"] = None if size is None or not base else size / base
    record["per_seed"] = {r["seed"]: {"heldout_ce": r["heldout_ce"], "heldout_kl": r["heldout_kl"]} | shares[r["seed"]]
                          for r in mine}
    kl = paired(runs, variant, "topk128", "heldout_kl")
    record["kl_minus_topk128_per_seed"] = kl
    record["kl_minus_topk128"] = paired_interval(kl)
    record["kl_rel_to_topk128"] = paired_interval(paired(runs, variant, "topk128", "heldout_kl", relative=True))
    record["ce_rel_to_online_per_seed"] = paired(runs, variant, "online", "heldout_ce", relative=True)
    return record


def _target(name: str, what: str, differences: list[float], **bounds: float) -> dict[str, Any]:
    interval = paired_interval(differences)
    return {"kind": "target", "target": name, "what": what, "per_seed": differences, "interval": interval,
            "bounds": bounds, "verdict": verdict(interval, **bounds)}


def targets(runs: list[dict[str, Any]], by: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issues' targets for the variants that ran (paired per seed; `met` only beyond the interval)."""
    out = []
    if {"hybrid", "topk128"} <= by.keys():
        out.append(_target("hybrid_kl_within_1pct_of_topk128", "hybrid's held-out KL relative to top-128's (paired "
                           "per seed): at most +1%", paired(runs, "hybrid", "topk128", "heldout_kl", True),
                           at_most=0.01))
    ratio = by.get("hybrid", {}).get("bytes_over_default_codec_topk128")
    if ratio is not None:
        out.append({"kind": "target", "target": "hybrid_bytes_at_most_40pct_of_default_codec",
                    "what": "hybrid's bytes/position over the default-codec top-128 store's (no noise: one store "
                            "per seed, the mean)", "ratio": ratio,
                    "ratio_to_lossless": by["hybrid"]["bytes_over_lossless_topk128"], "bounds": {"at_most": 0.40},
                    "verdict": MET if ratio <= 0.40 else NOT_MET})
    if {"ce", "topk128"} <= by.keys():
        for key in ("heldout_kl", "heldout_ce"):
            out.append(_target(f"topk128_ahead_of_ce_only_{key}", f"CE-only's {key} minus top-128's (paired per "
                               "seed): above 0", paired(runs, "ce", "topk128", key), at_least=0.0))
    if {"codec", "topk128"} <= by.keys():
        out.append(_target("codec_kl_within_1pct_of_topk128", "the default codec's held-out KL relative to lossless "
                           "top-128's (paired per seed): within +-1%",
                           paired(runs, "codec", "topk128", "heldout_kl", True), at_most=0.01, at_least=-0.01))
    if "online" in by:
        for variant in ("topk128", "hybrid"):
            if variant in by:
                out.append(_target(f"{variant}_ce_within_2pct_of_online", f"{variant}'s held-out CE relative to "
                                   "online KD's (paired per seed): within +-2%",
                                   paired(runs, variant, "online", "heldout_ce", True), at_most=0.02, at_least=-0.02))
    return out


def curves(runs: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Held-out KL against steps per variant: the mean over the seeds evaluated at a step, and each seed's."""
    out: dict[str, Any] = {}
    for variant in variants:
        points: dict[int, dict[int, float]] = {}
        for run in (r for r in runs if r["variant"] == variant):
            for point in run.get("curve", []):
                points.setdefault(point["step"], {})[run["seed"]] = point["heldout_kl"]
        out[variant] = [{"step": step, "heldout_kl": statistics.fmean(seeds.values()), "per_seed": seeds}
                        for step, seeds in sorted(points.items())]
    return out


def summarise(results: list[dict[str, Any]], variants: list[str],
              context: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per variant: means, spreads over seeds, byte ratios, paired differences, gap shares; the curves; the
    targets. `context` (the corpus and the student's kind) goes into every record."""
    stores = {r["store"]: r for r in results if r["kind"] == "store"}
    runs = [r for r in results if r["kind"] == "run"]
    teacher_ce = next((r["heldout_ce"] for r in results if r["kind"] == "teacher"), None)
    out = [_variant(variant, runs, stores, teacher_ce) for variant in variants]
    by = {r["variant"]: r for r in out if r["seeds"]}
    out.append({"kind": "curves", "heldout_kl_by_step": curves(runs, variants)})
    return [(context or {}) | record for record in out + targets(runs, by)]


def _seeds(values: list[float], fmt: str) -> str:
    return " / ".join(fmt.format(v) for v in values) or "-"


def _interval(interval: dict[str, Any], fmt: str) -> str:
    if interval["mean"] is None:
        return "-"
    if interval["low"] is None:
        return fmt.format(interval["mean"]) + " (one seed)"
    return f"{fmt.format(interval['mean'])} [{fmt.format(interval['low'])}, {fmt.format(interval['high'])}]"


def print_table(summary: list[dict[str, Any]]) -> None:
    """The variants (+- : standard deviation over seeds), the paired differences with their 95% t intervals,
    the curves and the targets."""
    def cell(record: dict[str, Any], key: str, fmt: str, sd_fmt: str = "{:.4f}") -> str:
        sd = record.get(f"{key}_seed_sd")
        return "-" if record[key] is None else fmt.format(record[key]) + (
            " +- " + sd_fmt.format(sd) if sd is not None else "")

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    variants = [r for r in summary if r["kind"] == "variant"]
    if variants:
        first = variants[0]
        teacher_ce = "-" if first["teacher_heldout_ce"] is None else f"{first['teacher_heldout_ce']:.4f}"
        print(f"\ncorpus {first.get('corpus', '-')}, student {first.get('student', '-')}, teacher's held-out CE "
              f"{teacher_ce}; gap closed: the share of the step-0 student's KL (floor 0) and CE (floor: the "
              "teacher's) that training removed")
    print(f"\n{'variant':<9} {'B/pos':>7} {'/codec':>7} {'/lossless':>9} {'held-out CE':>17} {'held-out KL':>17} "
          f"{'top-1':>14} {'KL gap closed':>16} {'CE gap closed':>16} {'KL - top128, per seed':>24} "
          f"{'KL rel. top128, mean [95% CI]':>32}")
    for record in variants:
        size = f"{record['bytes_per_position']:.1f}" if record["bytes_per_position"] is not None else "-"
        print(f"{record['variant']:<9} {size:>7} {ratio(record['bytes_over_default_codec_topk128']):>7} "
              f"{ratio(record['bytes_over_lossless_topk128']):>9} {cell(record, 'heldout_ce', '{:.4f}'):>17} "
              f"{cell(record, 'heldout_kl', '{:.4f}'):>17} {cell(record, 'heldout_top1_agreement', '{:.3f}'):>14} "
              f"{cell(record, 'kl_gap_closed', '{:.1%}', '{:.1%}'):>16} "
              f"{cell(record, 'ce_gap_closed', '{:.1%}', '{:.1%}'):>16} "
              f"{_seeds(record['kl_minus_topk128_per_seed'], '{:+.4f}'):>24} "
              f"{_interval(record['kl_rel_to_topk128'], '{:+.2%}'):>32}")
    for record in (r for r in summary if r["kind"] == "curves"):
        curve = {v: {p["step"]: p["heldout_kl"] for p in points} for v, points in record["heldout_kl_by_step"].items()}
        steps = sorted({step for points in curve.values() for step in points})
        if steps:
            print("\nheld-out KL by step (mean over seeds)\n" + f"{'step':>6} " + " ".join(f"{v:>9}" for v in curve))
            for step in steps:
                print(f"{step:>6} " + " ".join(f"{curve[v][step]:>9.4f}" if step in curve[v] else f"{'-':>9}"
                                               for v in curve))
    for record in (r for r in summary if r["kind"] == "target"):
        if "interval" in record:
            value = _interval(record["interval"], "{:+.4f}") + " per seed " + _seeds(record["per_seed"], "{:+.4f}")
        else:
            value = f"{record['ratio']:.1%} (of the lossless store's: {record['ratio_to_lossless']:.1%})"
        print(f"{record['target']}: {value} -> {record['verdict']} ({record['what']})")
