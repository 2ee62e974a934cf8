"""`kdflow bench gpu`: the GPU check. Every CUDA path of kdflow at the reference teacher's shapes, within the lent
machine's minutes, with no network and no Prefect, ending in one JSON summary (`infra/gpu-check.sh` runs it).

Random Qwen3-MoE teachers with llm-jp-4-32b-a3b-base's per-layer shapes and 196,608-id vocabulary
(kdflow/bench/gpu_plan.py says where the shapes come from) at two depths, in 4-bit (bitsandbytes, the fused experts
too: kdflow.tasks.common.fused_experts) and bf16. Then, each step timed, its outcome recorded (ok, skipped with its
reason, failed with its error) and the rest run on. First what issue 44's steps need: token shards; `kdflow tune
precompute`; the pass in its worker. Then issue 44's: one micro-batch of the pass profiled, its time by kernel
family (gpu_profile.py); the full-depth teacher built in the device's memory and timed in bf16 (where it fits) and
4-bit, MFU against the measured matmul rate and the datasheet peak (gpu_full_depth.py); `kdflow bench head`;
sampled and hybrid targets; the MoE body's variants (`kdflow bench body`); the 32-layer 4-bit teacher's pass under
a 24 GiB cap (gpu_capped.py); a checkpoint in the hub's per-expert layout loaded in 4-bit (gpu_hub_layout.py);
`kdflow tune precompute` under that cap on the 32-layer teacher made from its config. Last, what the H200 check of
2026-12-04 measured, for a call's budget to skip first: each 4-bit teacher's weights as loaded (and the full
depth's, extrapolated); `kdflow bench teacher-pass` at the tuned micro-batch per
depth and precision (ratios to the bare forward, MFU from active parameters) and the full-depth tok/s extrapolated
from both depths (constrained: a pass's per-layer cost at least its forward's); the logits' precision in bf16
against float32, and the float32 lm_head's cost (logits_precision_measure.py); `kdflow bench loss` under bf16
autocast (fused vs dense, checked against a float32 dense reference); `kdflow bench precompute` (chunked vs dense
top-K); `kdflow bench train-step` with a student of the teacher's vocabulary; the training stage; a 2-process
FSDP step when two GPUs are visible. A step that would not finish within `--budget-s` is skipped. The last stdout
line is the summary (also `--out`); exit 0 when no step failed (skips included) and at least one step ran to the
end: a check whose every step skipped measured nothing and exits 1.

`--device cpu` is the rehearsal at small sizes (`--quick`); `--plan` prints the plan (sizes, memory
estimates, what would skip) at full size without building anything; `--only` runs some steps and what they need;
`--progress-log` appends each step as it starts and ends, for a summary of a check stopped from outside.
Each step is a function (gpu_steps.py, gpu_teachers.py) that returns its record: a bench's measurements come
from its `records`, the dicts its JSON lines are printed from, so nothing here parses printed text.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kdflow.bench import gpu_capped, gpu_full_depth, gpu_hub_layout, gpu_profile, logits_precision_measure
from kdflow.bench import gpu_steps as steps_
from kdflow.bench import gpu_teachers as teachers
from kdflow.bench.args import bench_parser
from kdflow.bench.gpu_plan import H200_MEMORY_GIB, plan, sizes
from kdflow.tasks.common.units import MIB


def _parser() -> argparse.ArgumentParser:
    parser = bench_parser("gpu", __doc__, device="cuda", devices=["cuda", "cpu"],
                          helps={"device": "cpu: the rehearsal"})
    parser.add_argument("--quick", action="store_true", help="small sizes (the rehearsal's; default with --device cpu)")
    parser.add_argument("--plan", action="store_true", help="print the plan at these sizes and exit (builds nothing)")
    parser.add_argument("--memory-gib", type=float, default=H200_MEMORY_GIB,
                        help="--plan: the device's memory (an H200: 139; an H100: 78)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip steps that would end after this (default: 480 on cuda, none on cpu)")
    parser.add_argument("--work-dir", help="keep the teachers, stores and configs here (default: a temporary "
                        "folder); a later call with the same folder reuses its teachers and tuned micro-batch")
    parser.add_argument("--out", help="also write the summary to this file")
    parser.add_argument("--setup-log", help="JSON lines of set-up steps (infra/gpu-check.sh) put in the summary")
    parser.add_argument("--progress-log", help="append each step as a JSON line when it starts and when it ends, so "
                        "a check stopped at its time limit still leaves what it measured (infra/gpu-check.sh)")
    parser.add_argument("--only", help="STEP[,STEP...]: run these steps and those they need, skip the rest "
                        "(a second run on the GPU machine for what the first did not measure)")
    parser.add_argument("--again", metavar="SUMMARY", help="run the steps an earlier call's summary (its "
                        "gpu-check.json) shows failed or skipped for its budget, and those they need "
                        "(with --only: both)")
    parser.add_argument("--report", nargs="+", metavar="SUMMARY", help="write the results page of these calls' "
                        "summaries (first call first) to --out or stdout, issue 44's targets judged, and build nothing")
    parser.add_argument("--fsdp", choices=["auto", "on", "off"], default="auto",
                        help="the 2-process FSDP step: auto runs it when two GPUs are visible")
    return parser


class Steps:
    """Runs each step, timing it. A step that raises `Skipped`, or would start with less than its `needs_s`
    left of the budget, is skipped with its reason; one that raises otherwise is failed (its first line; the
    traceback on stderr). Neither stops the others. With `progress`, each step is appended to that file as a JSON
    line when it starts (`"status": "running"`) and again when it ends. With `only`, a step not named there is
    skipped. `dry` runs nothing: every step is recorded as ok, with what it needs (`needs`), to know the steps."""

    def __init__(self, budget_s: float, progress: Path | None = None, only: set[str] | None = None,
                 dry: bool = False) -> None:
        self.results: dict[str, dict[str, Any]] = {}
        self.deadline = time.perf_counter() + budget_s
        self.progress, self.only, self.dry = progress, only, dry
        self.needs: dict[str, tuple[str, ...]] = {}

    def skip(self, name: str, reason: str) -> None:
        self.results[name] = {"status": "skipped", "reason": reason}
        self._log(name, self.results[name])

    def _log(self, name: str, result: dict[str, Any]) -> None:
        if self.progress is not None:
            with self.progress.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({"name": name, **result}) + "\n")

    def run(self, name: str, step: Callable[[], dict[str, Any] | None], *, needs: tuple[str, ...] = (),
            needs_s: float = 0.0) -> None:
        self.needs[name] = needs
        if self.dry:
            self.results[name] = {"status": "ok"}
            return
        if self.only is not None and name not in self.only:
            self.skip(name, "not asked for (--only)")
            return
        missing = [n for n in needs if self.results.get(n, {}).get("status") != "ok"]
        left = self.deadline - time.perf_counter()
        if missing or left < needs_s:
            reason = f"needs {', '.join(missing)}" if missing else f"budget: {left:.0f} s left, needs ~{needs_s:.0f} s"
            self.skip(name, reason)
            return
        print(f"kdflow bench gpu: {name} ...", file=sys.stderr, flush=True)
        self._log(name, {"status": "running"})
        started = time.perf_counter()
        try:
            self.results[name] = {"status": "ok", **(step() or {})}
        except steps_.Skipped as skip:
            self.results[name] = {"status": "skipped", "reason": str(skip)}
        except BaseException as error:  # noqa: BLE001 - one step's failure must not hide the others
            if isinstance(error, KeyboardInterrupt):
                raise
            traceback.print_exc(file=sys.stderr)
            message = (str(error).strip().splitlines() or [type(error).__name__])[0]
            self.results[name] = {"status": "failed", "error": f"{type(error).__name__}: {message}"}
        self.results[name]["seconds"] = round(time.perf_counter() - started, 2)
        self._log(name, self.results[name])


def check_config(work: Path, device: str, size: dict[str, Any], depth: int, four_bit: bool) -> dict[str, Any]:
    """One teacher's config as a plain dict (`kdflow tune --write` edits the file it is written to). The teacher
    runs in bf16 on the CPU too, so the rehearsal takes the GPU's dtype path (4-bit experts dequantised to bf16)."""
    shapes = size["shapes"]
    return {
        "run_root": str(work / "run"),
        "dataset": {"path": str(work / "docs.jsonl"), "documents_per_part": 64},
        "seq_len": size["seq_len"],
        "teacher": {"model": str(teachers.teacher_folder(work, depth)), "load_in_4bit": four_bit, "device": device,
                    "dtype": "bfloat16"},
        # The tiled head for the top-K pass as for the sampled and hybrid ones (`targets`): their ratio then
        # weighs the samplers, not two ways of reading the logits.
        "precompute": {"top_k": size["top_k"], "micro_batch": 4, "sequences_per_shard": size["per_shard"],
                       "head": "tiled"},
        "student": {"name": "gpu-check", "steps": size["student_steps"], "batch_size": size["batch_size"],
                    "warmup_steps": 1, "eval_shards": 1, "eval_sequences": 8, "save_every": size["student_steps"],
                    "device": device, "autocast_bf16": True,
                    "architecture": {"hidden_size": min(512, shapes["hidden_size"]), "num_hidden_layers": 2,
                                     "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "intermediate_size": 2 * min(512, shapes["hidden_size"])}},
    }


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                            "python": sys.version.split()[0], "cpus": os.cpu_count()}
    for name in ("transformers", "bitsandbytes", "pydantic"):
        with contextlib.suppress(ImportError):
            info[name] = __import__(name).__version__
    if torch.cuda.is_available():
        info |= {"cuda": torch.version.cuda,
                 "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                 "gpu_memory_mib": [round(torch.cuda.get_device_properties(i).total_memory / MIB)
                                    for i in range(torch.cuda.device_count())]}
    return info


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.quick = args.quick or args.device == "cpu"
    if args.budget_s is None:
        args.budget_s = 480.0 if args.device == "cuda" else float("inf")
    if args.plan:
        print(json.dumps(plan(args.quick, args.memory_gib, args.budget_s)), flush=True)
        return 0
    if args.report:
        return _report(args.report, args.out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kdflow bench gpu: no CUDA device is visible (use --device cpu for the rehearsal)")
    started = time.perf_counter()
    size = sizes(args.quick)
    setup = [json.loads(line) for line in Path(args.setup_log).read_text().splitlines()] if args.setup_log else []
    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kdflow-gpu-")))
        work.mkdir(parents=True, exist_ok=True)
        asked = ",".join(filter(None, [args.only, *(_again(Path(args.again), work, args, size) if args.again else [])]))
        only = _only(asked, work, args, size) if asked else None
        steps = Steps(args.budget_s, Path(args.progress_log) if args.progress_log else None, only)
        _run_steps(steps, work, args, size)
    results = {step["name"]: {k: v for k, v in step.items() if k != "name"} for step in setup} | steps.results
    failed = [name for name, result in results.items() if result["status"] == "failed"]
    # A check in which every step skipped (no time left, --only of nothing measurable) measured nothing: that
    # is no pass, whatever the reasons; the set-up steps measure nothing either.
    measured = [name for name, result in steps.results.items() if result["status"] == "ok"]
    # A step that measured variants and found some wrong (`incorrect`: bench_head's) keeps the others' figures.
    incorrect = {name: result["incorrect"] for name, result in results.items() if result.get("incorrect")}
    summary = {"bench": "gpu_check", "device": args.device, "quick": args.quick,
               "ok": bool(measured) and not failed and not incorrect, "incorrect": incorrect,
               "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "measured": len(measured), "failed": failed,
               "skipped": [name for name, result in results.items() if result["status"] == "skipped"],
               "seconds": round(time.perf_counter() - started, 1), "loadavg": [round(x, 2) for x in os.getloadavg()],
               "environment": environment(), "steps": results}
    text = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    if not measured:
        print("kdflow bench gpu: no step measured anything (every one skipped)", file=sys.stderr, flush=True)
    return 0 if summary["ok"] else 1


def _report(paths: list[str], out: str | None) -> int:
    """The results page (gpu_report.py) to `out` or stdout, then one JSON line: each target's verdict."""
    from kdflow.bench.gpu_report import judged, merged, read_summaries, render

    summary = merged(read_summaries(paths, "--report"))
    page = render(summary)
    if out:
        Path(out).write_text(page, encoding="utf-8")
    else:
        print(page, flush=True)
    verdicts = {target: verdict for target, _measured, verdict in judged(summary)}
    print(json.dumps({"bench": "gpu_report", "summaries": paths, "page": out or "stdout", "targets": verdicts}),
          flush=True)
    return 0


def _again(summary_path: Path, work: Path, args: argparse.Namespace, size: dict[str, Any]) -> list[str]:
    """The steps of this check that an earlier summary shows failed (a step still running when that call was
    stopped at its limit included) or skipped for the budget; not a set-up step, not a planned skip. The
    micro-batch that call tuned is kept in the work folder (where none is yet: a fresh machine), so the steps run
    again pass at it, not at the config's."""
    from kdflow.bench.gpu_report import read_summaries

    earlier = read_summaries([str(summary_path)], "--again")[0]["steps"]
    tune = earlier.get("tune_precompute", {})
    if tune.get("recommended_micro_batch") and not (work / steps_.TUNED).is_file():
        (work / steps_.TUNED).write_text(json.dumps({k: v for k, v in tune.items() if k not in ("status", "seconds")}),
                                         encoding="utf-8")
    dry = _dry_run(work, args, size)
    names = [name for name, step in earlier.items() if name in dry.results and (
        step.get("status") == "failed" or str(step.get("reason", "")).startswith("budget:"))]
    if not names:
        raise SystemExit(f"kdflow bench gpu: --again {summary_path}: no step failed or was skipped for its budget")
    return names


def _dry_run(work: Path, args: argparse.Namespace, size: dict[str, Any]) -> Steps:
    """Every step of the check, run dry: their names in order and what each needs (nothing built)."""
    dry = Steps(float("inf"), dry=True)
    _run_steps(dry, work, args, size)
    return dry


def _only(asked_text: str, work: Path, args: argparse.Namespace, size: dict[str, Any]) -> set[str]:
    """The steps `--only` names and, followed through, those they need; a name that is no step is an error."""
    dry = _dry_run(work, args, size)
    asked = {name.strip() for name in asked_text.split(",") if name.strip()}
    unknown = sorted(asked - set(dry.results))
    if unknown:
        raise SystemExit(f"kdflow bench gpu: --only names no step {', '.join(unknown)} "
                         f"(steps: {', '.join(dry.results)})")
    todo, wanted = list(asked), set(asked)
    while todo:
        for need in dry.needs.get(todo.pop(), ()):
            if need not in wanted:
                wanted.add(need)
                todo.append(need)
    return wanted


def _run_steps(steps: Steps, work: Path, args: argparse.Namespace, size: dict[str, Any]) -> None:
    device, quick, (low, high) = args.device, args.quick, size["depths"]
    configs = {(depth, bits): steps_.write_yaml(work / f"check-L{depth}-{bits}.yaml",
                                                check_config(work, device, size, depth, bits == "4bit"))
               for bits in ("4bit", "bf16") for depth in (low, high)}
    main_config = configs[(high, "4bit")]
    long_s = 0 if quick else 60  # what a teacher step needs at full size, at the least
    # First what issue 44's steps need (the teachers, token shards, the tuned micro-batch, the top-K pass that the
    # sampled targets are compared with), then issue 44's steps (gpu_plan.ISSUE_STEPS), then what was measured on
    # 2026-12-04 (gpu_plan.remeasured): a call's budget skips those first, for a second call.
    steps.run("teacher", lambda: teachers.build_teachers(work, size, device))
    steps.run("tokens", lambda: steps_.tokens(main_config), needs=("teacher",))
    steps.run("tune_precompute", lambda: steps_.tune(main_config, size), needs=("tokens",), needs_s=2 * long_s)
    steps.run("precompute", lambda: steps_.precompute(main_config), needs=("tokens",), needs_s=long_s)
    tuned = steps_.tuned_micro_batch(work, steps.results)
    steps.run("profile", lambda: gpu_profile.profile_teacher(main_config, tuned), needs=("teacher",),
              needs_s=long_s / 2)
    steps.run("full_depth", lambda: gpu_full_depth.check_step(size, device, tuned), needs_s=long_s)
    steps.run("bench_head", lambda: steps_.bench_head(device, size), needs_s=long_s / 4)
    for mode in ("sampled", "hybrid"):
        steps.run(f"targets_{mode}", lambda mode=mode: steps_.targets(main_config, mode), needs=("tokens",),
                  needs_s=long_s)
    steps.run("body_variants", lambda: steps_.body_variants(main_config, tuned, quick), needs=("teacher",),
              needs_s=long_s)
    steps.run("capped_24gib", lambda: gpu_capped.check_step(size, device), needs_s=long_s)
    steps.run("hub_layout_load", lambda: gpu_hub_layout.check_step(work, size, device), needs_s=long_s)
    steps.run("tune_capped_24gib", lambda: gpu_capped.tune_step(work, size, device, work / "tokenizer"),
              needs=("teacher",), needs_s=long_s)
    steps.run("teacher_weights_4bit", lambda: teachers.teacher_weights([configs[(d, "4bit")] for d in (low, high)],
                                                                       (low, high), size["shapes"]),
              needs=("teacher",), needs_s=long_s / 2)
    for (depth, bits), path in configs.items():
        if bits not in size["pass_bits"]:  # the rehearsal: one precision (the same code path as the other)
            steps.skip(f"teacher_pass_L{depth}_{bits}", "quick: 4bit only")
            continue
        steps.run(f"teacher_pass_L{depth}_{bits}",
                  lambda path=path, depth=depth: steps_.teacher_pass(path, tuned, size["pass_shards"], depth,
                                                                     size["shapes"], size["pass_repeats"]),
                  needs=("tokens",), needs_s=long_s)
    for bits in ("4bit", "bf16"):
        names = tuple(f"teacher_pass_L{d}_{bits}" for d in (low, high))
        steps.run(f"extrapolated_{bits}",
                  lambda bits=bits: steps_.extrapolate(steps.results, (low, high), size["shapes"], bits), needs=names,
                  needs_s=float("-inf"))  # arithmetic on what was measured: never skipped for time
    steps.run("logits_precision", lambda: logits_precision_measure.logits_precision(
        teachers.teacher_folder(work, low), device, size["precision_tokens"]),
              needs=("teacher",), needs_s=long_s / 2)
    steps.run("bench_loss", lambda: steps_.bench_loss(device, size), needs_s=long_s / 2)
    steps.run("bench_precompute", lambda: steps_.bench_precompute(device, size), needs_s=long_s / 2)
    steps.run("bench_train_step", lambda: steps_.bench_train_step(main_config, device, size, quick),
              needs=("precompute",), needs_s=long_s / 2)
    steps.run("train_bf16", lambda: steps_.train(main_config), needs=("precompute",), needs_s=long_s / 2)
    gpus = torch_gpus()
    if args.fsdp == "on" or (args.fsdp == "auto" and gpus >= 2):
        steps.run("fsdp_2_process", lambda: steps_.fsdp(main_config), needs=("precompute",), needs_s=long_s / 2)
    else:
        steps.skip("fsdp_2_process", f"{gpus} GPU(s) visible")


def torch_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


if __name__ == "__main__":
    raise SystemExit(main())
