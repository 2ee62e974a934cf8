"""`kdflow bench train-step`: the student's training step against its limit, as JSON lines.

For a student config (the demo's by default) at a batch and seq_len, tok/s and peak memory of
  plain  (a) the student's forward with full (n, T, V) logits, next-token cross-entropy, backward, clipping,
             AdamW and scheduler step: what any trainer does;
  fused  (b) kdflow's step on the same batch: DistillLoss (the body's final hidden states into the fused
             top-K loss with the lm_head weight), backward, clipping, AdamW and scheduler step. The batch is
             the first training batch of the config's stores when they hold this seq_len, else a synthetic
             top-K batch (random tokens; K distinct ids a row, 10% tail mass);
  stage  (c) kdflow's whole training stage, `kdflow.tasks.student.train.train`, on the real shards: data
             loading, the metrics log, progress; no evaluation and no checkpoint inside the measured steps
             (a scratch student folder under the run root, removed afterwards);
then the ratios b/a and c/b of tok/s (`value`: numerator's tok_s / denominator's; `peak_ratio`,
`peak_total_ratio`: denominator's peak over the numerator's, > 1 where the numerator needs less).
Every variant's `tok_s` is tokens_per_step x steps / `seconds`, the wall seconds of its measured steps (after
`--warmup` untimed ones); plain and fused time the step alone, stage times everything the loop does between two
steps (its `step_only_s` is the part inside the step).

Inputs: without a config file, the demo's (teacher, text, token shards and the teacher's top-K store) are
prepared under `--run-root` first, as `kdflow demo` would (kept for reruns: a second run reuses them). With a
config, its tokenizer must load and, for the stage variant, its stores must exist: else the bench fails at
once, in one line naming what is missing, before measuring anything.

`--options` measures (b) again with options switched on (gradient_checkpointing, compile, attn=eager,
combinations joined by '+') and prints each against (b).

Every measurement runs in a fresh Python process, so that nothing of one is left in another's memory;
`--repeats R` measures every variant R times, round robin, and keeps the fastest of each (the least disturbed
on a shared machine: quote ratios from one run, with the load averages each record carries).
Memory, two numbers per variant:
  peak_bytes        the most bytes of tensors alive at once during one more step, beyond those alive before
                    it (model, optimiser state, batch): activations, logits, gradients. On CPU from
                    torch.profiler's allocation events (so the allocator's caching cannot hide or inflate it);
                    on CUDA torch.cuda.max_memory_allocated over memory_allocated before the step;
  peak_total_bytes  what the whole process held at its peak over the measured steps: on CPU the resident
                    set's high-water mark (VmHWM, reset through /proc/self/clear_refs after the warm-up:
                    Python, torch, model, optimiser, allocator caches, mapped shards); on CUDA
                    torch.cuda.max_memory_allocated.
The CUDA paths ran on an H200 in the GPU check (`kdflow bench gpu`; README, The GPU check).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from kdflow.bench.args import bench_parser
from kdflow.bench.harness import emit, run_fresh
from kdflow.bench.train_step_measure import measure, with_overrides

VARIANTS = ("plain", "fused", "stage")
OPTION_KEYS = {"gradient_checkpointing": ("student.gradient_checkpointing", True),
               "compile": ("student.compile", True)}
TARGETS = {"b/a": 0.95, "c/b": 0.95}
MODULE = "kdflow.bench.train_step"  # the child of each measurement: python -m MODULE --measure SPEC


def _refuse(message: str) -> NoReturn:
    raise SystemExit(f"kdflow bench train-step: {message}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.measure:
        emit(measure(json.loads(args.measure)))
        return 0
    for record in records(args, parser.error):
        emit(record)
    return 0


def records(args: argparse.Namespace, error: Callable[[str], NoReturn] = _refuse) -> Iterator[dict[str, Any]]:
    """Each variant's record (the fastest of its repeats), then the ratios; `args` from `_parser`. A wrong
    --variants or --options goes to `error` (the command line's: usage and exit 2) before anything runs."""
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        error(f"--variants must be a comma list of {', '.join(VARIANTS)}; got {args.variants}")
    options = [name for name in args.options.split(",") if name] if args.options else []
    option_overrides = {option: _option_overrides(option, error) for option in options}
    config = _bench_config(args)
    check_inputs(config, variants)
    base = {"config": config.model_dump(mode="json"), "warmup": args.warmup, "steps": args.steps,
            "check_float32": args.check_float32}
    specs = [base | {"variant": variant, "label": variant} for variant in variants]
    for option in options:
        specs.append(base | {"variant": "fused", "label": f"fused+{option}",
                             "config": with_overrides(config, option_overrides[option]).model_dump(mode="json")})
    runs: dict[str, list[dict[str, Any]]] = {spec["label"]: [] for spec in specs}
    for _ in range(args.repeats):
        for spec in specs:
            runs[spec["label"]].append(_run_child(spec))
    fastest = {label: _fastest(measured) for label, measured in runs.items()}
    yield from fastest.values()
    for name, (top, bottom) in {"b/a": ("fused", "plain"), "c/b": ("stage", "fused")}.items():
        if _measured(fastest.get(top)) and _measured(fastest.get(bottom)):
            yield _ratio(name, fastest[top], fastest[bottom]) | {"target": TARGETS[name]}
    for option in options:
        label = f"fused+{option}"
        if _measured(fastest.get(label)) and _measured(fastest.get("fused")):
            yield _ratio(f"{label}/fused", fastest[label], fastest["fused"])


def build_parser() -> argparse.ArgumentParser:
    from kdflow.schemas.config_io import parse_override

    parser = bench_parser("train-step", __doc__, run_root=True, repeats=1, device=None, seq_len=None,
                          helps={"run_root": "where the demo's inputs are prepared and kept (without a config file)",
                                 "repeats": "measure each variant this many times (round robin); report the fastest",
                                 "device": "cpu, cuda, cuda:N (default: student.device)",
                                 "seq_len": "tokens per sequence (default: the config's seq_len)"})
    parser.add_argument("config", nargs="?", help="student config (YAML); default: the demo's, configs/demo.yaml")
    parser.add_argument("--batch", type=int, help="sequences per step (default: student.batch_size)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the measured ones (compile, first touch)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of plain, fused, stage")
    parser.add_argument("--options", default="",
                        help="comma list of options to measure with the fused step: gradient_checkpointing, compile, "
                             "attn=sdpa|eager|flash_attention_2, or several joined by '+'")
    parser.add_argument("--set", action="append", type=parse_override, metavar="KEY=VALUE",
                        help="override a config key (repeatable), e.g. --set student.kd.chunk_tokens=2048")
    parser.add_argument("--check-float32", action="store_true",
                        help="fused: before timing, its first step's loss and gradients as configured (bf16 autocast "
                        "on CUDA) against the same step in float32 (`float32_check`; `ok` within its tolerances)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one measurement, in a child process
    return parser


def _bench_config(args: argparse.Namespace) -> Any:
    from kdflow.schemas.config_io import load_config

    overrides = dict(args.set or [])
    if args.config is not None:
        config = load_config(args.config, overrides)
    else:
        config = with_overrides(prepare_demo_stores(args.run_root), overrides)
    extra: dict[str, Any] = {}
    if args.batch is not None:
        extra["student.batch_size"] = args.batch
    if args.seq_len is not None:
        extra["seq_len"] = args.seq_len
    if args.device is not None:
        extra["student.device"] = args.device
    extra["student.grad_accum"] = 1  # one micro-batch per step in every variant
    return with_overrides(config, extra)


def prepare_demo_stores(run_root: str) -> Any:
    """The demo's teacher, text, token shards and top-K store under `run_root` (what is there and matches is
    kept) -> its config."""
    from kdflow.bench.teacher_pass import prepare_demo
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.tasks.teacher.precompute import precompute_shards

    config = prepare_demo(run_root)
    precompute_shards(open_run_root(config), teacher_pass_settings(config))
    return config


def check_inputs(config: Any, variants: list[str]) -> None:
    """A KDFlowError naming what is missing: the tokenizer every variant needs, the stores the stage trains on."""
    from kdflow.schemas.errors import KDFlowError, StoreError
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_stores

    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    if "stage" in variants:
        try:
            open_stores(open_run_root(config), training_settings(config), tokenizer)
        except KDFlowError as error:
            raise StoreError(f"the stage variant trains on the config's stores: {error} (or leave stage out of "
                             "--variants)") from None


def _option_overrides(option: str, error: Callable[[str], NoReturn]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for part in option.split("+"):
        if part.startswith("attn="):
            overrides["student.attn_implementation"] = part.removeprefix("attn=")
        elif part in OPTION_KEYS:
            key, value = OPTION_KEYS[part]
            overrides[key] = value
        else:
            error(f"unknown option {part!r} in --options (gradient_checkpointing, compile, attn=NAME)")
    return overrides


def _fastest(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of a variant's repeats, with every repeat's tok/s and load averages beside it."""
    done = [record for record in measured if "tok_s" in record]
    if not done:
        return measured[0]
    best = max(done, key=lambda record: record["tok_s"])
    if len(measured) == 1:
        return best
    return best | {"repeats": len(measured), "tok_s_all": [record.get("tok_s") for record in measured],
                   "load_avg_all": [record["load_avg"] for record in measured]}


def _measured(record: dict[str, Any] | None) -> bool:
    return record is not None and "tok_s" in record


def _ratio(name: str, top: dict[str, Any], bottom: dict[str, Any]) -> dict[str, Any]:
    """tok/s of `top` over `bottom`, and peak memory of `bottom` over `top` (> 1: `top` needs less)."""
    return {"ratio": name, "value": round(top["tok_s"] / bottom["tok_s"], 3),
            "peak_ratio": round(bottom["peak_bytes"] / max(top["peak_bytes"], 1), 2),
            "peak_total_ratio": round(bottom["peak_total_bytes"] / max(top["peak_total_bytes"], 1), 2),
            "load_avg": [bottom["load_avg"][0], top["load_avg"][1]]}


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    head = {"variant": spec["label"], "batch": spec["config"]["student"]["batch_size"],
            "seq_len": spec["config"]["seq_len"]}
    done = run_fresh(MODULE, ["--measure", json.dumps(spec)])
    return done.record if done.ok else head | done.failure()


if __name__ == "__main__":
    raise SystemExit(main())
