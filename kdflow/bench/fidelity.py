"""`kdflow bench fidelity`: how well a student learns the teacher from each kind of stored target.

The demo's teacher (SmolLM2-135M-Instruct), text (Python's documentation, `pydoc_data`) and student
(`configs/demo.yaml`). The same student (initial weights, data order, AdamW, schedule and steps all from
`student.seed`) is trained, for each seed, on
  topk128  lossless top-128 with the exact tail bucket (v2 store, float16 values, float32 tail)
  codec    the same top-128 in the default v2 codec (`precompute.store` defaults: sqrt-quantised values,
           float16 tail): the store issue's check that a training run on it lands within 1% of topk128's KL
  hybrid   an exact top-H head + S sampled tail tokens (`precompute.targets: hybrid`, drawn with the seed)
  sampled  S sampled tokens only (`precompute.targets: sampled`, drawn with the seed)
  online   online full-vocabulary KD, the teacher run alongside (`kdflow.bench.fidelity_runs`)
  ce       next-token cross-entropy only (kd_weight 0)
and evaluated on the held-out shards with a dense teacher pass: next-token CE and full-vocabulary
KL(teacher || student) per position. Stores are made by the real teacher pass and trained on by the real
training loop; bytes/position count every byte of each store (`kdflow.schemas.store_bytes`). Prints one JSON
object per line (each run, each variant's mean over seeds, the targets) and a table. Differences between variants are
compared with the spread between seeds (the run-to-run noise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

VARIANTS = ("topk128", "codec", "hybrid", "sampled", "online", "ce")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdflow bench fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("--run-root", default="runs/bench-fidelity")
    parser.add_argument("--seeds", default="0,1", help="student seeds (init and data order), comma-separated")
    parser.add_argument("--steps", type=int, default=100, help="optimiser steps of every student (the demo's)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimiser step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=50176,
                        help="corpus token budget (the demo's); 0: all of the docs")
    parser.add_argument("--sequences-per-shard", type=int, default=32)
    parser.add_argument("--eval-shards", type=int, default=2, help="held-out token shards (the last ones)")
    parser.add_argument("--hybrid", default="16,12", help="H,S of the hybrid store (16,12: ~24%% of top-128's bytes)")
    parser.add_argument("--sampled", type=int, default=24,
                        help="S of the sampled-only store (24: about hybrid's bytes)")
    parser.add_argument("--scheme", choices=["priority", "gumbel"], default="priority")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        build_parser().error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    results = run_benchmark(args, variants, seeds)
    summary = summarise(results, variants)
    for record in summary:
        print(json.dumps(record), flush=True)
    print_table(summary)
    return 0


def emit(record: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(record), flush=True)
    return record


def _base_config(args: argparse.Namespace, root: str) -> Any:
    from kdflow.demo_assets import demo_config
    from kdflow.schemas.config import config_from_dict

    data = demo_config(root).model_dump(mode="json")
    data["seq_len"] = args.seq_len
    data["dataset"]["max_tokens"] = args.max_tokens or None
    data["precompute"] |= {"sequences_per_shard": args.sequences_per_shard, "micro_batch": 8, "report_rows": 0}
    data["student"] |= {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
                        "eval_shards": args.eval_shards, "eval_sequences": 8, "save_every": args.steps,
                        "keep_checkpoints": 1}
    return config_from_dict(data, source="kdflow bench fidelity")


def _store_of(variant: str, seed: int) -> str:
    """The store a variant trains on: top-128 for online (its data order) and CE; sampled stores drawn per seed."""
    if variant == "codec":
        return "codec"
    return "topk128" if variant in ("topk128", "online", "ce") else f"{variant}-seed{seed}"


def _variant_config(base: Any, variant: str, args: argparse.Namespace, seed: int,
                    tags: dict[str, str] | None = None) -> Any:
    """The config of one store (tags None) or of one student trained on it; sampled stores use the seed as their
    sampling seed, so the seeds' spread covers the draw as well as the initial weights and data order."""
    from kdflow.schemas.config import config_from_dict

    data = base.model_dump(mode="json")
    pre = data["precompute"]
    head, samples = (int(x) for x in args.hybrid.split(","))
    if variant in ("topk128", "online", "ce"):
        pre |= {"top_k": 128, "store": pre["store"] | {"values": "float16", "tail": "float32"}}
    elif variant == "codec":
        pre |= {"top_k": 128}
    elif variant == "hybrid":
        pre |= {"targets": "hybrid",
                "sampling": {"head": head, "samples": samples, "scheme": args.scheme, "seed": seed}}
    else:
        pre |= {"targets": "sampled", "sampling": {"samples": args.sampled, "scheme": args.scheme, "seed": seed}}
    if tags is not None:
        data["student"] |= {"name": f"{variant}-seed{seed}", "seed": seed, "topk_tag": tags[_store_of(variant, seed)]}
        data["student"]["kd"] |= {"kd_weight": 0.0 if variant == "ce" else 1.0}
    return config_from_dict(data, source=f"kdflow bench fidelity ({variant})")


def _sampling(config: Any) -> dict[str, Any] | None:
    """The store's effective sampling settings (a `sampled` store has no head, whatever sampling.head says)."""
    pre = config.precompute
    if pre.targets == "topk":
        return None
    return pre.sampling.model_dump() | {"head": pre.sampling.head if pre.targets == "hybrid" else 0}


def _prepare(args: argparse.Namespace) -> tuple[str, Any]:
    """The demo teacher (dequantised once), the docs as jsonl, corpus and token stores."""
    from kdflow.demo_assets import locate_teacher_gguf, local_run_root, prepare_teacher, write_corpus
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise

    root = local_run_root(args.run_root)
    Path(root).mkdir(parents=True, exist_ok=True)
    base = _base_config(args, root)
    write_corpus(Path(base.dataset.path))
    prepare_teacher(locate_teacher_gguf(), Path(base.teacher.model))
    tokenizer = load_tokenizer(base)

    def count_tokens(texts: list[str]) -> list[int]:
        encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return [len(ids) + 1 for ids in encoded]

    materialise(base, count_tokens)
    tokenise(base, tokenizer)
    return root, base


def run_benchmark(args: argparse.Namespace, variants: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    import torch

    from kdflow.bench.fidelity_runs import (TeacherStates, dense_eval, store_bytes_per_position, teacher_heldout_ce,
                                            train_online)
    from kdflow.schemas.commits import list_commits, stage_dir
    from kdflow.schemas.stage_settings import open_run_root
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_distill_data
    from kdflow.tasks.student.model import load_causal_lm
    from kdflow.tasks.student.train import train
    from kdflow.tasks.teacher.loading import load_teacher
    from kdflow.tasks.teacher.precompute import precompute_shards

    root, base = _prepare(args)
    run_root = open_run_root(base)
    teacher = load_teacher(base.teacher)
    results, tags = [], {}
    stores = {_store_of(v, seed): (v, seed) for seed in seeds for v in variants}
    for store, (variant, seed) in stores.items():
        config = _variant_config(base, variant, args, seed)
        summary = precompute_shards(config, model=teacher)
        store_dir = stage_dir(run_root, "topk", summary["tag"])
        records = list_commits(run_root, store_dir, "topk", summary["tag"])
        tags[store] = summary["tag"]
        seconds = sum(r.extra.seconds or 0.0 for r in records.values())
        results.append(emit({"kind": "store", "store": store, "tag": summary["tag"], "shards": summary["shards"],
                             "positions": summary["tokens"],
                             "bytes_per_position": round(store_bytes_per_position(run_root, store_dir, records), 2),
                             "teacher_seconds": round(seconds, 1), "written_now": summary["written"],
                             "targets": config.precompute.targets, "top_k": config.precompute.top_k,
                             "sampling": _sampling(config),
                             "load_average": os.getloadavg()[0]}))
    first = _variant_config(base, variants[0], args, seeds[0], tags)
    every_heldout_row = first.model_copy(update={"student": first.student.model_copy(update={"eval_sequences": 10**9})})
    data = open_distill_data(every_heldout_row, load_tokenizer(first))
    states = TeacherStates(teacher)
    teacher_ce = teacher_heldout_ce(data, states)
    results.append(emit({"kind": "teacher", "heldout_ce": teacher_ce, "heldout_rows": len(data.eval_rows),
                         "train_rows": data.train_rows, "train_tokens": data.train_rows * base.seq_len,
                         "steps": args.steps, "batch_size": args.batch_size,
                         "epochs": round(args.steps * args.batch_size / data.train_rows, 2)}))
    for seed in seeds:
        for variant in variants:
            config = _variant_config(base, variant, args, seed, tags)
            started = time.perf_counter()
            if variant == "online":
                student, info = train_online(config, states)
            else:
                info = train(config)
                student = load_causal_lm(os.path.join(root, "students", config.student.name, "final"), what="student",
                                         dtype=torch.float32).eval()
            record = {"kind": "run", "variant": variant, "seed": seed, "steps": info["steps"],
                      "train_seconds": round(time.perf_counter() - started, 1), "final_train_loss": info["final_loss"]}
            record |= dense_eval(student, data, states)
            results.append(emit(record | {"load_average": os.getloadavg()[0]}))
    return results


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def summarise(results: list[dict[str, Any]], variants: list[str]) -> list[dict[str, Any]]:
    """Per variant: the mean and the spread over seeds; then the issue's targets, checked."""
    stores = {r["store"]: r for r in results if r["kind"] == "store"}
    runs = [r for r in results if r["kind"] == "run"]
    out = []
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        mine_stores = [stores[_store_of(variant, r["seed"])] for r in mine]
        record: dict[str, Any] = {"kind": "variant", "variant": variant, "seeds": [r["seed"] for r in mine]}
        for key in ("heldout_ce", "heldout_kl", "heldout_top1_agreement", "train_seconds"):
            mean, sd = _mean_sd([r[key] for r in mine])
            record |= {key: mean, f"{key}_seed_sd": sd}
        sizes = [store["bytes_per_position"] for store in mine_stores]
        record["bytes_per_position"] = None if variant in ("online", "ce") or not sizes else statistics.fmean(sizes)
        record["per_seed"] = {r["seed"]: {"heldout_ce": r["heldout_ce"], "heldout_kl": r["heldout_kl"]} for r in mine}
        out.append(record)
    _paired(out, runs)
    by = {r["variant"]: r for r in out}
    if {"topk128", "hybrid", "online"} <= by.keys():
        top, hybrid = by["topk128"], by["hybrid"]
        byte_ratio = hybrid["bytes_per_position"] / top["bytes_per_position"]
        kl_delta = hybrid["kl_minus_topk128_per_seed"]
        ce_gap = {v: statistics.fmean(by[v]["ce_rel_to_online_per_seed"]) for v in ("topk128", "hybrid")}
        out.append({"kind": "targets", "hybrid_bytes_over_topk128": byte_ratio, "bytes_target_met": byte_ratio <= 0.25,
                    "hybrid_kl_minus_topk128_kl": statistics.fmean(kl_delta), "per_seed": kl_delta,
                    "kl_target_met": statistics.fmean(kl_delta) <= 0.0,
                    "ce_gap_to_online": ce_gap, "ce_target_met": all(abs(g) <= 0.02 for g in ce_gap.values())})
    if {"topk128", "codec"} <= by.keys():
        rel = [d / by["topk128"]["per_seed"][seed]["heldout_kl"]
               for seed, d in zip(by["codec"]["seeds"], by["codec"]["kl_minus_topk128_per_seed"], strict=True)]
        out.append({"kind": "codec_target", "codec_kl_rel_to_topk128_per_seed": rel,
                    "codec_kl_rel_to_topk128": statistics.fmean(rel), "codec_bytes_over_topk128":
                    by["codec"]["bytes_per_position"] / by["topk128"]["bytes_per_position"],
                    "codec_target_met": all(abs(r) <= 0.01 for r in rel)})
    return out


def _paired(out: list[dict[str, Any]], runs: list[dict[str, Any]]) -> None:
    """Differences within a seed (same initial weights and data order): KL minus top-128's, CE relative to online
    KD's; their spread over seeds is the run-to-run noise a difference must exceed."""
    by_seed = {(r["variant"], r["seed"]): r for r in runs}
    for record in out:
        kl, ce = [], []
        for seed in record["seeds"]:
            mine, top, online = (by_seed.get((v, seed)) for v in (record["variant"], "topk128", "online"))
            if top is not None:
                kl.append(mine["heldout_kl"] - top["heldout_kl"])
            if online is not None:
                ce.append((mine["heldout_ce"] - online["heldout_ce"]) / online["heldout_ce"])
        record["kl_minus_topk128_per_seed"], record["ce_rel_to_online_per_seed"] = kl, ce


def print_table(summary: list[dict[str, Any]]) -> None:
    """The variants as a table (+- : standard deviation over seeds), then the paired differences and the targets."""
    def cell(record: dict[str, Any], key: str, fmt: str) -> str:
        sd = record.get(f"{key}_seed_sd")
        return fmt.format(record[key]) + (f" +- {sd:.4f}" if sd is not None else "")

    def seeds(values: list[float], fmt: str) -> str:
        return " / ".join(fmt.format(v) for v in values) or "-"

    print(f"\n{'variant':<9} {'bytes/pos':>9} {'held-out CE':>18} {'held-out KL':>18} {'top-1':>15} "
          f"{'KL - top128, per seed':>24} {'CE vs online, per seed':>24}")
    for record in (r for r in summary if r["kind"] == "variant"):
        size = f"{record['bytes_per_position']:.1f}" if record["bytes_per_position"] is not None else "-"
        print(f"{record['variant']:<9} {size:>9} {cell(record, 'heldout_ce', '{:.4f}'):>18} "
              f"{cell(record, 'heldout_kl', '{:.4f}'):>18} {cell(record, 'heldout_top1_agreement', '{:.3f}'):>15} "
              f"{seeds(record['kl_minus_topk128_per_seed'], '{:+.4f}'):>24} "
              f"{seeds(record['ce_rel_to_online_per_seed'], '{:+.2%}'):>24}")
    for record in (r for r in summary if r["kind"] == "targets"):
        print(f"\nhybrid bytes / top-128 bytes = {record['hybrid_bytes_over_topk128']:.3f} "
              f"({'met' if record['bytes_target_met'] else 'NOT met'}: <= 0.25)")
        print(f"hybrid KL - top-128 KL = {record['hybrid_kl_minus_topk128_kl']:+.4f} nats, mean of the seeds' "
              f"{seeds(record['per_seed'], '{:+.4f}')} ({'met' if record['kl_target_met'] else 'NOT met'}: <= 0)")
        gaps = ", ".join(f"{k} {v:+.2%}" for k, v in record["ce_gap_to_online"].items())
        met = "met" if record["ce_target_met"] else "NOT met"
        print(f"held-out CE relative to online KD: {gaps} ({met}: within 2%)")
    for record in (r for r in summary if r["kind"] == "codec_target"):
        print(f"default codec's held-out KL relative to lossless top-128's: "
              f"{seeds(record['codec_kl_rel_to_topk128_per_seed'], '{:+.2%}')} per seed "
              f"({'met' if record['codec_target_met'] else 'NOT met'}: within 1%), at "
              f"{record['codec_bytes_over_topk128']:.1%} of its bytes")
