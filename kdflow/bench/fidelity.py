"""`kdflow bench fidelity`: how well a student learns the teacher from each kind of stored target.

The demo's teacher (SmolLM2-135M-Instruct) and student (`configs/demo.yaml`), for `--steps` steps on a
`--corpus-tokens` corpus of `--corpus` text (`kdflow.bench.fidelity_corpus`: Python's documentation, the
default; the standard library's sources; or a jsonl file). The same student (initial weights, data order,
AdamW, schedule and steps all from `student.seed`) is trained, for each seed, on
  topk128  lossless top-128 with the exact tail bucket (v2 store, float32 values and tail: the teacher's capture)
  codec    the same top-128 in the default v2 codec (`precompute.store` defaults: sqrt-quantised values,
           float16 tail): the store a user writes, and the store issue's check (within 1% of topk128's KL)
  hybrid   the default hybrid: an exact top-H head + S sampled tail tokens (`precompute.sampling`'s defaults
           unless --hybrid H,S), drawn with the seed
  sampled  S sampled tokens only (`precompute.targets: sampled`, drawn with the seed)
  online   online full-vocabulary KD, the teacher run alongside (`kdflow.bench.fidelity_runs`); optional, as it
           costs the most: add it to --variants where it fits the time
  ce       next-token cross-entropy only (kd_weight 0)
Each student is evaluated at several steps of its one run (every --eval-every steps, 0 and the last included) on
every held-out row with a dense teacher pass: next-token CE, full-vocabulary KL(teacher || student) and top-1
agreement per position; each variant's share of the student's gap to the teacher closed is measured from its
step-0 evaluation (`kdflow.bench.fidelity_summary`). Stores are made by the real teacher pass and trained on by
the training loop's own steps; `bytes_per_position` counts every byte of the store (`kdflow.schemas.store_bytes`),
and every variant's bytes are stated over both top-128 stores (default codec and lossless). `train_seconds` is
the same quantity in every variant: the optimiser steps only (no evaluation, no teacher body pass; online KD's
live lm_head included).

With `--prune-layers N` every student is made from the teacher instead of the demo's random architecture
(`student.prune`: its N most important blocks by `--prune-importance`, measured on calibration rows taken in an
order of their own, not the seed's). Pruning is deterministic, so the pruned initial weights are the same for
every variant and every seed: the seed then sets only the data order (and a sampled store's draw), and the
step-0 evaluation, the gap's start, is the same in every run.

Every variant x seed is a stored result (`kdflow.bench.fidelity_results`, a JSON file in the corpus's folder under
the run root; the student's pruning is in its key and its name) that a rerun skips, so a long comparison is
built up across runs (`--max-new-runs` bounds one call's work).
Differences between variants are paired per seed (variant minus top-128, same seed) with a 95% t interval; a
target is met only when the interval lies on its side of the bound, NOT met when it lies wholly on the other,
and not resolved otherwise (`kdflow.bench.fidelity_stats`). Prints one JSON object per line (each store and
run, each variant's summary, the curves, the targets) and a table; writes summary.json and, if matplotlib is
installed, a plot of held-out KL against steps beside the results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdflow.bench.args import bench_parser
from kdflow.bench.fidelity_corpus import BUILT_IN, choose_corpus, jsonl_problem, prepare
from kdflow.bench.fidelity_summary import print_table, store_of, summarise
from kdflow.demo_assets import local_run_root

if TYPE_CHECKING:
    from kdflow.bench.fidelity_runs import LazyTeacher

VARIANTS = ("topk128", "codec", "hybrid", "sampled", "online", "ce")
DEFAULT_VARIANTS = ("topk128", "codec", "hybrid", "sampled", "ce")


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("fidelity", __doc__, run_root=True, seq_len=256, threads=True,
                          helps={"threads": "torch threads (0: torch's default)"})
    parser.add_argument("--seeds", default="0,1,2", help="student seeds (init and data order), comma-separated")
    parser.add_argument("--steps", type=int, default=400, help="optimiser steps of every student")
    parser.add_argument("--corpus-tokens", "--max-tokens", dest="max_tokens", type=int, default=50176,
                        help="corpus token budget (50176: the demo's); 0: all of the docs")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate the student every N steps of its run (0: steps // 8)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimiser step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sequences-per-shard", type=int, default=32)
    parser.add_argument("--eval-shards", type=int, default=2, help="held-out token shards (the last ones)")
    parser.add_argument("--hybrid", default="", help="H,S of the hybrid store (default: precompute.sampling's)")
    parser.add_argument("--sampled", type=int, default=24, help="S of the sampled-only store")
    parser.add_argument("--scheme", choices=["priority", "gumbel"], default="priority")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--max-new-runs", type=int, default=0,
                        help="train at most N runs not yet stored, then summarise what is stored (0: all)")
    parser.add_argument("--corpus", default="pydoc",
                        help="pydoc (Python's documentation), stdlib (the standard library's .py sources) or a "
                             "PATH.jsonl with a text field")
    parser.add_argument("--prune-layers", type=int, default=0,
                        help="make every student from the teacher: its N most important blocks (0: the demo's "
                             "random student)")
    parser.add_argument("--prune-importance", choices=["cosine", "skip_loss"], default="cosine",
                        help="how --prune-layers ranks the teacher's blocks (student.prune.importance)")
    return parser


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[int]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        parser.error(f"--variants: unknown {', '.join(unknown) or 'none given'} (choose from {', '.join(VARIANTS)})")
    try:
        seeds = sorted({int(s) for s in args.seeds.split(",") if s.strip()})
    except ValueError:
        parser.error(f"--seeds: integers separated by commas, got {args.seeds!r}")
    if not seeds or args.steps < 1 or args.eval_every < 0 or args.max_new_runs < 0:
        parser.error("--seeds needs one seed at least, --steps >= 1, --eval-every and --max-new-runs >= 0")
    if args.hybrid and len(args.hybrid.split(",")) != 2:
        parser.error(f"--hybrid: H,S, got {args.hybrid!r}")
    if args.prune_layers < 0:
        parser.error(f"--prune-layers: a number of teacher blocks (0: off), got {args.prune_layers}")
    problem = None if args.corpus in BUILT_IN else jsonl_problem(os.path.abspath(os.path.expanduser(args.corpus)))
    if problem:
        parser.error(problem)
    return args, variants, seeds


def main(argv: list[str] | None = None) -> int:
    args, variants, seeds = parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from kdflow.bench.fidelity_results import Results

    if args.threads:
        torch.set_num_threads(args.threads)
    root = local_run_root(args.run_root)
    Path(root).mkdir(parents=True, exist_ok=True)
    corpus = choose_corpus(args.corpus, root)
    base = _base_config(args, root, corpus.source)
    emit(prepare(base, corpus))
    stored = Results(root, corpus.name)
    results = run_benchmark(args, base, stored, variants, seeds)
    summary = summarise(results, variants, {"corpus": corpus.name, "student": student_label(args)})
    for record in summary:
        print(json.dumps(record), flush=True)
    emit(stored.write_summary(summary))
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds only JSON lines, as every benchmark's does
        print_table(summary)
    return 0


def emit(record: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(record), flush=True)
    return record


def eval_steps(steps: int, every: int) -> list[int]:
    """The steps a run is evaluated at: 0, every `every` (default steps // 8) and the last."""
    every = every or max(steps // 8, 1)
    return sorted(set(range(0, steps + 1, every)) | {steps})


def student_label(args: argparse.Namespace) -> str:
    """The students' kind, in every result's name and the summary: random (the demo's architecture) or pruned."""
    return f"pruned{args.prune_layers}-{args.prune_importance}" if args.prune_layers else "random"


def _base_config(args: argparse.Namespace, root: str, source: str) -> Any:
    from kdflow.demo_assets import demo_config
    from kdflow.schemas.config_io import config_from_dict

    data = demo_config(root).model_dump(mode="json")
    data["dataset"]["path"] = source  # pydoc's is the demo's own: its stores and results keep their fingerprints
    data["seq_len"] = args.seq_len
    data["dataset"]["max_tokens"] = args.max_tokens or None
    data["precompute"] |= {"sequences_per_shard": args.sequences_per_shard, "micro_batch": 8, "report_rows": 0}
    data["student"] |= {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "eval_every": 0,
                        "eval_shards": args.eval_shards, "eval_sequences": 8, "save_every": args.steps,
                        "keep_checkpoints": 1, "prune": None}  # the demo's random student unless --prune-layers
    return config_from_dict(data, source="kdflow bench fidelity")


def variant_config(base: Any, variant: str, args: argparse.Namespace, seed: int,
                   tags: dict[str, str] | None = None) -> Any:
    """The config of one store (tags None) or of one student trained on it; sampled stores use the seed as their
    sampling seed, so the seeds' spread covers the draw as well as the initial weights and data order."""
    from kdflow.schemas.config_io import config_from_dict

    data = base.model_dump(mode="json")
    pre = data["precompute"]
    sampling = pre["sampling"]
    head, samples = ((int(x) for x in args.hybrid.split(",")) if args.hybrid
                     else (sampling["head"], sampling["samples"]))
    if variant in ("topk128", "online", "ce"):
        pre |= {"top_k": 128, "store": pre["store"] | {"values": "float32", "tail": "float32"}}
    elif variant == "codec":
        pre |= {"top_k": 128}
    elif variant == "hybrid":
        pre |= {"targets": "hybrid",
                "sampling": sampling | {"head": head, "samples": samples, "scheme": args.scheme, "seed": seed}}
    else:
        pre |= {"targets": "sampled",
                "sampling": sampling | {"samples": args.sampled, "scheme": args.scheme, "seed": seed}}
    if tags is not None:
        name = f"{variant}-seed{seed}" + (f"-{student_label(args)}" if args.prune_layers else "")
        data["student"] |= {"name": name, "seed": seed, "topk_tag": tags[store_of(variant, seed)]}
        data["student"]["kd"] |= {"kd_weight": 0.0 if variant == "ce" else 1.0}
        if args.prune_layers:  # the same blocks for every variant and seed (see the module docstring)
            data["student"]["prune"] = {"layers": args.prune_layers, "importance": args.prune_importance}
    return config_from_dict(data, source=f"kdflow bench fidelity ({variant})")


def _sampling(config: Any) -> dict[str, Any] | None:
    """The store's effective sampling settings (a `sampled` store has no head, whatever sampling.head says)."""
    pre = config.precompute
    if pre.targets == "topk":
        return None
    return pre.sampling.model_dump() | {"head": pre.sampling.head if pre.targets == "hybrid" else 0}


def build_stores(args: argparse.Namespace, base: Any, variants: list[str],
                 seeds: list[int]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Every store the variants train on, and both top-128 stores (the byte ratios' references); -> their tags
    and records. Committed shards are kept: a rerun computes nothing (and loads no teacher) for a complete store."""
    from kdflow.bench.fidelity_runs import store_bytes_per_position
    from kdflow.schemas.commits import list_commits, stage_dir
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.tasks.teacher.precompute import precompute_shards

    run_root, tags, records = open_run_root(base), {}, []
    wanted = {"topk128": ("topk128", seeds[0]), "codec": ("codec", seeds[0])}
    wanted |= {store_of(v, seed): (v, seed) for seed in seeds for v in variants}
    for store, (variant, seed) in wanted.items():
        config = variant_config(base, variant, args, seed)
        summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
        store_dir = stage_dir(run_root, "topk", summary["tag"])
        commits = list_commits(run_root, store_dir, "topk", summary["tag"])
        tags[store] = summary["tag"]
        seconds = sum(r.extra.seconds or 0.0 for r in commits.values())
        records.append(emit({
            "kind": "store", "store": store, "tag": summary["tag"], "shards": summary["shards"],
            "positions": summary["tokens"],
            "bytes_per_position": round(store_bytes_per_position(run_root, store_dir, commits), 2),
            "teacher_seconds": round(seconds, 1), "written_now": summary["written"],
            "targets": config.precompute.targets, "top_k": config.precompute.top_k, "sampling": _sampling(config),
            "store_format": {"values": config.precompute.store.values, "tail": config.precompute.store.tail},
            "load_average": os.getloadavg()[0]}))
    return tags, records


def run_one(config: Any, variant: str, seed: int, key: str, store_tag: str, teacher: LazyTeacher,
            steps: list[int], corpus: str) -> dict[str, Any]:
    """One student trained from scratch and evaluated at `steps` of its run; -> the result to store."""
    from kdflow.bench.fidelity_runs import train_with_curve
    from kdflow.schemas.layout import STUDENTS_DIR
    from kdflow.schemas.stage_settings import open_run_root

    folder = open_run_root(config).path(STUDENTS_DIR, config.student.name)  # a local run root (the demo's)
    shutil.rmtree(folder, ignore_errors=True)  # no resume of an interrupted run: its curve is gone
    started = time.perf_counter()
    student, curve, info = train_with_curve(config, teacher.states(), teacher.heldout(), set(steps),
                                            online=variant == "online")
    kept = getattr(student.config, "kdflow_prune", None)  # what pruning kept (its teacher path left out)
    shutil.rmtree(folder, ignore_errors=True)  # the stored result is what stays
    final = curve[-1]
    return {"kind": "run", "corpus": corpus, "variant": variant, "seed": seed, "key": key, "store_tag": store_tag,
            "student": config.student.name, "prune": kept and {k: v for k, v in kept.items() if k != "teacher"},
            "steps": info["steps"], "batch_size": config.student.batch_size, "train_rows": info["train_rows"],
            "epochs": round(info["steps"] * config.student.batch_size / info["train_rows"], 2),
            "train_seconds": round(info["train_seconds"], 1),
            "teacher_body_seconds": round(info["teacher_body_seconds"], 1),
            "wall_seconds": round(time.perf_counter() - started, 1), "final_train_loss": info["final_train_loss"],
            **{k: v for k, v in final.items() if k != "step"}, "curve": curve,
            "load_average": os.getloadavg()[0], "threads": _threads(), "finished_at": time.strftime("%Y-%m-%d %H:%M")}


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def run_benchmark(args: argparse.Namespace, base: Any, results: Any, variants: list[str],
                  seeds: list[int]) -> list[dict[str, Any]]:
    """The stores, then each variant x seed: its stored result, or a run from scratch that is then stored; and
    the teacher's own held-out CE (stored too)."""
    from kdflow.bench.fidelity_results import result_key, teacher_key
    from kdflow.bench.fidelity_runs import LazyTeacher, teacher_heldout_ce

    if args.prune_layers:  # refused before the teacher passes, not after them
        from transformers import AutoConfig

        from kdflow.schemas.errors import ConfigError
        from kdflow.tasks.common.teacher_loading import source_kwargs

        blocks = AutoConfig.from_pretrained(base.teacher.model, **source_kwargs(base.teacher)).num_hidden_layers
        if args.prune_layers > blocks:
            raise ConfigError(f"--prune-layers {args.prune_layers}: the teacher has {blocks} blocks to keep from")
    tags, out = build_stores(args, base, variants, seeds)
    steps = eval_steps(args.steps, args.eval_every)
    teacher = LazyTeacher(variant_config(base, "topk128", args, seeds[0], tags))
    key = teacher_key(tags["topk128"], teacher.config)
    record = results.load("teacher", 0, key)
    if record is None:
        heldout = teacher.heldout()
        record = results.save_record({"kind": "teacher", "corpus": results.corpus, "variant": "teacher", "seed": 0,
                                      "key": key,
                                      "heldout_ce": teacher_heldout_ce(heldout, teacher.states()),
                                      "heldout_rows": len(heldout.eval_rows), "train_rows": heldout.train_rows,
                                      "train_tokens": heldout.train_rows * base.seq_len})
    out.append(emit(record))
    new_runs = 0
    for seed in seeds:
        for variant in variants:
            config = variant_config(base, variant, args, seed, tags)
            store_tag = tags[store_of(variant, seed)]
            key = result_key(variant, seed, store_tag, config, steps)
            record = results.load(variant, seed, key)
            if record is None:
                if args.max_new_runs and new_runs >= args.max_new_runs:
                    out.append(emit({"kind": "not_run", "variant": variant, "seed": seed,
                                     "reason": "--max-new-runs reached"}))
                    continue
                record = results.save_record(run_one(config, variant, seed, key, store_tag, teacher, steps,
                                                     results.corpus))
                new_runs += 1
            out.append(emit(record | {"stored_in": str(results.path(variant, seed, key))}))
    return out
