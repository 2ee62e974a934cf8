"""The steps of `kdflow bench gpu` (kdflow/bench/gpu.py runs them): each returns its record (a dict) or raises.

Each calls functions, never a command's main: the tasks layer, and a bench's `records` (the dicts its JSON lines
are printed from) with its options set by name (`kdflow.bench.args.options`), judged by `bench`; nothing parses
printed text. None of them imports Prefect, so that on the GPU machine only the image's packages and the carried
wheels (infra/gpu-wheels.txt) are needed. The teachers are built in gpu_teachers.py.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kdflow.bench.args import options
from kdflow.bench.gpu_plan import BF16_PEAK_TFLOPS, model_parameters
from kdflow.bench.gpu_report import variant_label

HEADROOM = 0.10  # of the device's memory, left free by the recommended micro-batch (tune's default)


class Skipped(Exception):
    """Raised by a step that decides not to run (its reason is recorded; a skip is never a failure)."""


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


TUNED = "tuned.json"  # in the work folder once `tune_precompute` recommended a micro-batch


def tokens(config_path: Path) -> dict[str, Any]:
    from kdflow.schemas.config_io import load_config
    from kdflow.schemas.stage_settings import materialise_settings, open_run_root, tokenise_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise

    config = load_config(config_path)
    materialise(open_run_root(config), materialise_settings(config))
    summary = tokenise(open_run_root(config), tokenise_settings(config),
                       load_tokenizer(config.teacher, config.tokenizer))
    return {"shards": summary.shards, "sequences": summary.sequences, "tokens": summary.tokens}


def tune(config_path: Path, size: dict[str, Any]) -> dict[str, Any]:
    """`kdflow tune precompute CONFIG --write` as functions: the candidates timed, the recommendation written into
    the config (and into the work folder, for a later call with --only)."""
    from kdflow.tasks.common.launch import config_file
    from kdflow.tasks.teacher import tune_search
    from kdflow.tasks.teacher.tune_file import check_tune_request, write_micro_batch

    request = check_tune_request(config_path, micro_batches=size["micro_batches"], batches=2, headroom=HEADROOM,
                                 timeout_s=150, write=True)
    with config_file(request.config, "kdflow-gpu-tune-") as path:
        candidates = tune_search.tune(path, request.sizes, batches=2, timeout_s=150, on_candidate=_said)
    print(tune_search.table(candidates, HEADROOM), file=sys.stderr)
    result = tune_search.summary(candidates, HEADROOM)
    if result["recommended_micro_batch"] is None:
        raise RuntimeError(f"tune precompute: no candidate ran with {HEADROOM:.0%} headroom: no recommendation")
    write_micro_batch(config_path, result["recommended_micro_batch"])
    record = {key: result[key] for key in ("recommended_micro_batch", "recommended_tokens_per_s", "fastest_micro_batch",
                                           "recommended_over_fastest", "candidates")}
    (config_path.parent / TUNED).write_text(json.dumps(record), encoding="utf-8")
    return record


def _said(candidate: Any) -> None:
    print(f"tune precompute: micro-batch {candidate.micro_batch}: {candidate.status} {candidate.message}".rstrip(),
          file=sys.stderr, flush=True)


def tuned_micro_batch(work: Path, results: dict[str, dict[str, Any]]) -> int | None:
    """The micro-batch `tune` recommended in this call or, when it did not run (`--only`), in an earlier call
    with the same --work-dir; None when neither (the pass then uses the config's)."""
    if "recommended_micro_batch" in results.get("tune_precompute", {}):
        return results["tune_precompute"]["recommended_micro_batch"]
    path = work / TUNED
    return json.loads(path.read_text(encoding="utf-8"))["recommended_micro_batch"] if path.is_file() else None


def precompute(config_path: Path) -> dict[str, Any]:
    """The teacher pass in its worker process, as the precompute flow starts it (the tuned micro-batch if written);
    the record names the head, experts and compiled body that ran, as the shards' commit records say."""
    from kdflow.tasks.common.launch import run_child
    from kdflow.tasks.teacher.precompute_worker import MODULE

    outcome = run_child(MODULE, ["--config", str(config_path)], on_log=lambda pid, line: print(line, file=sys.stderr))
    if outcome.exit_code != 0 or outcome.result is None:
        message = outcome.errors[-1]["message"] if outcome.errors else ""
        raise RuntimeError(f"the teacher worker exited {outcome.exit_code}: {message}")
    keys = ("tag", "written", "tokens", "tokens_per_s", "peak_device_memory_mib", "device", "writer", "phases_s")
    return {key: outcome.result.get(key) for key in keys} | (outcome.result.get("computed_with") or {})


def targets(config_path: Path, mode: str) -> dict[str, Any]:
    """Sampled or hybrid targets: the pass in its worker on a copy of the token store (its own run root), its
    logits read by the tiled sampler (`precompute.head: tiled`: the Triton kernels on CUDA)."""
    import yaml

    from kdflow.schemas.layout import TOPK_DIR

    data = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    source = Path(data["run_root"])
    root = source.with_name(f"{source.name}-{mode}")
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(source, root, ignore=lambda folder, names: [TOPK_DIR] if Path(folder) == source else [])
    data["run_root"] = str(root)
    data["precompute"] |= {"targets": mode, "head": "tiled", "store": {"format": "v2"}}
    return precompute(write_yaml(config_path.with_name(f"check-{mode}.yaml"), data)) | {"targets": mode}


def bench(what: str, records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A bench's records judged (each echoed to stderr, the check's log, as it comes): failed when there are none or
    one holds an error; records that say they were skipped (planned, nothing attempted) are listed, never counted
    as errors, and when every one is, the step is skipped."""
    records = [_echo(record) for record in records]
    skipped = [r for r in records if r.get("skipped") or str(r.get("status", "")).startswith("skipped")]
    errors = [r for r in records
              if r not in skipped and (r.get("error") or str(r.get("status", "")).startswith("error"))]
    if not records or errors:
        raise RuntimeError(f"kdflow bench {what}: {errors[0] if errors else 'no records'}")
    if len(skipped) == len(records):
        raise Skipped(f"every record skipped: {skipped[0].get('skipped') or skipped[0].get('status')}")
    off = [r for r in records if r.get("float32_check", {}).get("ok") is False]
    if off:  # the step's values against the float32 reference step, out of tolerance
        check = off[0]["float32_check"]
        raise RuntimeError(f"kdflow bench {what}: {off[0].get('variant')} against float32: loss rel diff "
                           f"{check['loss_rel_diff']:.3g}, gradient rel diff {check['grad_rel_diff']:.3g} "
                           f"(tolerances {check['tolerance']})")
    return {"records": records, "skipped_records": len(skipped)}


def _echo(record: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(record), file=sys.stderr, flush=True)
    return record


def bench_loss(device: str, size: dict[str, Any]) -> dict[str, Any]:
    """`kdflow bench loss` under bf16 autocast at the check's sizes (fused against dense, and a float32 reference)."""
    from kdflow.bench import loss

    args = options(loss.build_parser(), device=device, tokens=size["loss_tokens"], vocab=[size["loss_vocab"]],
                   hidden=[size["loss_hidden"]], repeats=size["pass_repeats"], autocast_bf16=True, dense_max_gib=100)
    return bench("loss", loss.records(args))


def bench_precompute(device: str, size: dict[str, Any]) -> dict[str, Any]:
    """`kdflow bench precompute`: the top-K step chunked against dense, at the check's sizes."""
    from kdflow.bench import precompute

    args = precompute.prepare(options(precompute.build_parser(), device=device, **size["topk_bench"]))
    return bench("precompute", precompute.records(args))


# The tiled-gemm head's GEMM (top-K) tried in more tilings than the device's default, on Hopper (`kdflow bench
# kernels`: each compiles for sm_90 on warp-group MMA within its shared memory, without spills).
HEAD_GEMM_TILINGS = ("128x256x64:3:8", "64x128x64:4:4", "128x128x64:4:8")


def bench_head(device: str, size: dict[str, Any]) -> dict[str, Any]:
    """`kdflow bench head`: the head's variants (matmul, slab loop, tiled in torch, tiled with the Triton kernel,
    tiled with the statistics from the Triton GEMM, also in `HEAD_GEMM_TILINGS`; the same for hybrid targets) at
    the reference head's shapes, each checked against its slab loop's values: one that differs is marked
    `"correct": false` and named in `incorrect` (the check is then not ok), and the others' figures kept."""
    from kdflow.bench import head
    from kdflow.tasks.teacher.gemm_tiles import parse_tilings

    args = options(head.build_parser(), device=device, vocab=[size["loss_vocab"]], hidden=[size["loss_hidden"]],
                   tokens=size["head_tokens"], chunk_tokens=4096, repeats=size["pass_repeats"],
                   gemm_tiles=parse_tilings(",".join(HEAD_GEMM_TILINGS)))
    result = bench("head", head.records(args))
    for record in result["records"]:
        if "ids_agree" in record:
            record["correct"] = record["ids_agree"] >= 0.999 and record.get("max_logprob_diff", 0.0) <= 1e-3
    wrong = [r for r in result["records"] if r.get("correct") is False]
    return result | {"incorrect": [variant_label(r) for r in wrong]}


# The fused experts' kernels timed in more tilings than the device's (fused_moe.HOPPER on sm_90): the tiling every
# GPU had before (LARGE), a larger and a deeper one (`kdflow bench kernels`-style compiles for sm_90: none spills).
MOE_TILINGS = ("64x64x32:3:4", "128x128x64:3:8", "64x64x64:4:4")


def body_variants(config_path: Path, micro_batch: int | None, quick: bool) -> dict[str, Any]:
    """`kdflow bench body` on the check's 4-bit teacher at the tuned micro-batch: each experts implementation and
    the compiled body (with grouped_mm and with the fused experts), against eager, and the fused experts in
    `MOE_TILINGS` too. A variant that cannot run is
    recorded with its error; the step fails only when none ran."""
    from kdflow.bench import body
    from kdflow.tasks.teacher.gemm_tiles import parse_tilings

    args = options(body.build_parser(), config=str(config_path), micro_batch=micro_batch or None,
                   repeats=1 if quick else 3, compile_backend="aot_eager" if quick else "inductor",
                   moe_tiles=parse_tilings(",".join(MOE_TILINGS)))
    records = [_echo(record) for record in body.records(args)]
    ran = {variant_label(r): r["tokens_per_s"] for r in records if "tokens_per_s" in r}
    if not ran:
        raise RuntimeError(f"kdflow bench body: no variant ran: {records[0] if records else 'no records'}")
    fastest = max(ran, key=ran.__getitem__)
    return {"records": records, "fastest": fastest, "over_grouped_mm": {
        name: round(rate / ran["grouped_mm"], 3) for name, rate in ran.items()} if "grouped_mm" in ran else None}


def bench_train_step(config_path: Path, device: str, size: dict[str, Any], quick: bool) -> dict[str, Any]:
    """`kdflow bench train-step`, plain against fused, the fused step checked against float32."""
    from kdflow.bench import train_step

    counts = {"steps": 1, "warmup": 0} if quick else {"steps": 3, "warmup": 1}
    args = options(train_step.build_parser(), config=str(config_path), variants="plain,fused", device=device,
                   seq_len=size["train_seq_len"], check_float32=True, **counts)
    return bench("train-step", train_step.records(args))


def teacher_pass(config_path: Path, micro_batch: int | None, shards: int, depth: int,
                 shapes: dict[str, int], repeats: int = 2) -> dict[str, Any]:
    """`kdflow bench teacher-pass` (body, forward, topk, stage) on one teacher; with MFU from its active params."""
    from kdflow.bench import teacher_pass as bench_teacher_pass

    args = options(bench_teacher_pass.build_parser(), config=str(config_path), shards=shards, repeats=repeats,
                   micro_batch=micro_batch or None)
    result = bench("teacher-pass", bench_teacher_pass.records(args))
    modes = {r["mode"]: r for r in result["records"] if "mode" in r}
    ratios = next((r for r in result["records"] if r.get("what") == "ratios"), {})
    active = matmul_parameters(shapes, depth)
    mfu = model_flops_utilisation(shapes, depth, {mode: r["tokens_per_s"] for mode, r in modes.items()})
    stage = modes.get("stage", {})
    return {"layers": depth, "micro_batch": next(iter(modes.values()))["micro_batch"],
            "top_k": next(iter(modes.values()))["top_k"],
            "tokens_per_s": {mode: r["tokens_per_s"] for mode, r in modes.items()},
            "stage_writer": {key: stage.get(key) for key in ("seconds_best", "call_s", "phases_s",
                                                           "shards_tokens_per_s", "writer_busy_s",
                                                           "waited_for_writer_s")},
            "ratios": {k: v for k, v in ratios.items() if "/" in k}, "mfu_of_bf16_peak": mfu,
            "active_parameters": active}


def model_flops_utilisation(shapes: dict[str, int], depth: int, rates: dict[str, float]) -> dict[str, float]:
    """Each mode's tok/s as a share of the bf16 peak: 2 FLOPs a matmul parameter a token; the `body` mode stops
    before the lm_head, so its parameters are not counted there."""
    active, head = matmul_parameters(shapes, depth), shapes["vocab_size"] * shapes["hidden_size"]
    return {mode: round(2 * (active - head * (mode == "body")) * rate / (BF16_PEAK_TFLOPS * 1e12), 4)
            for mode, rate in rates.items()}


def matmul_parameters(shapes: dict[str, int], depth: int) -> int:
    """The active parameters a token multiplies with (the embedding lookup is no matmul; the lm_head is)."""
    counts = model_parameters(shapes, depth)
    return counts["activated"] - counts["embedding"]


def extrapolate(results: dict[str, dict[str, Any]], depths: tuple[int, int], shapes: dict[str, int],
                quant: str) -> dict[str, Any]:
    """Full depth from two depths: seconds a token = a + b x layers, fitted through both; EXTRAPOLATED, and
    constrained: a pass holds a forward, so its per-layer cost (b) is held at least the forward's (the H200 run's
    line gave the stage 0.816 us a layer against the forward's 0.976, and a full-depth rate that cannot be)."""
    low, high = (results[f"teacher_pass_L{d}_{quant}"] for d in depths)
    full = shapes["num_hidden_layers"]
    out: dict[str, Any] = {"what": f"extrapolated to {full} layers from L{depths[0]} and L{depths[1]}, not a "
                           "measurement; a pass's per-layer cost held at least its forward's", "layers": full,
                           "constrained": []}
    measured = set(low["tokens_per_s"]) & set(high["tokens_per_s"])
    forward_per_layer = None
    for mode in [m for m in ("forward", "topk", "stage") if m in measured]:
        t_low, t_high = 1 / low["tokens_per_s"][mode], 1 / high["tokens_per_s"][mode]
        per_layer = (t_high - t_low) / (depths[1] - depths[0])
        if mode == "forward":
            forward_per_layer = per_layer
        elif forward_per_layer is not None and per_layer < forward_per_layer:
            per_layer = forward_per_layer
            out["constrained"].append(mode)
        seconds = t_low + per_layer * (full - depths[0])
        # A deeper teacher that ran faster (noise, or a cost that does not grow with depth) extrapolates to nothing.
        out[f"{mode}_tokens_per_s"] = round(1 / seconds, 1) if per_layer > 0 else None
        out[f"{mode}_seconds_per_layer_per_mtok"] = round(per_layer * 1e6, 4)
    roofline = BF16_PEAK_TFLOPS * 1e12 / (2 * matmul_parameters(shapes, full))
    out |= {"bf16_roofline_tokens_per_s": round(roofline, 1),
            "stage_share_of_roofline": None if out["stage_tokens_per_s"] is None
            else round(out["stage_tokens_per_s"] / roofline, 4)}
    return out


def train(config_path: Path) -> dict[str, Any]:
    import torch

    from kdflow.schemas.config_io import load_config
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.steps import autocast_for
    from kdflow.tasks.student.train import train as train_stage

    config = load_config(config_path)
    device = torch.device(config.student.device)
    autocast = autocast_for(device, config.student.autocast_bf16)
    summary = train_stage(open_run_root(config), training_settings(config))
    loss = summary["final_loss"]
    if loss is None or not torch.isfinite(torch.tensor(loss)):
        raise RuntimeError(f"training ended with loss {loss}")
    return {"steps": summary["steps"], "final_loss": loss, "tokens": summary["tokens"],
            "seconds_training": summary["seconds"],
            "autocast": "bf16" if isinstance(autocast, torch.autocast) else "off"}


def fsdp(config_path: Path) -> dict[str, Any]:
    """Two ranks through torchrun, FSDP-sharded, for two more steps of a separate student."""
    import socket

    import yaml

    from kdflow.schemas.config_io import load_config
    from kdflow.tasks.common.launch import config_file, run_child
    from kdflow.tasks.student.distributed import torchrun_arguments
    from kdflow.tasks.student.train_worker import EXEC_TORCHRUN, MODULE

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data = copy.deepcopy(yaml.safe_load(config_path.read_text(encoding="utf-8")))
    data["student"] |= {"name": "gpu-check-fsdp", "steps": 2, "save_every": 2,
                        "distributed": {"nproc_per_node": 2, "sharding": "fsdp", "rdzv_endpoint": f"127.0.0.1:{port}"}}
    config = load_config(write_yaml(config_path.with_name("fsdp.yaml"), data))
    with config_file(config, "kdflow-gpu-fsdp-") as path:
        arguments = torchrun_arguments(config.student.distributed, path, log_dir=str(Path(path).with_name("torchrun")))
        outcome = run_child(MODULE, [EXEC_TORCHRUN, *arguments],
                            on_log=lambda pid, line: print(line, file=sys.stderr))
    if outcome.exit_code != 0 or outcome.result is None:
        message = outcome.errors[0].get("message") if outcome.errors else ""
        raise RuntimeError(f"torchrun exited {outcome.exit_code}: {message}")
    return {"steps": outcome.result.get("steps"), "final_loss": outcome.result.get("final_loss"), "world_size": 2}
