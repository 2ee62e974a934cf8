"""The steps of `kdflow bench gpu` (kdflow/bench/gpu.py runs them): each returns its record or raises.

None of them imports Prefect: they call the tasks layer and the benches directly, so that on the GPU machine
only the image's packages and the carried wheels (infra/gpu-wheels.txt) are needed.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kdflow.bench.gpu_plan import BF16_PEAK_TFLOPS, GIB, model_parameters, teacher_bytes


class Skipped(Exception):
    """Raised by a step that decides not to run (its reason is recorded; a skip is never a failure)."""


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def captured(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    """Run a `kdflow` subcommand's main in this process, its stdout captured (and echoed to stderr)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(argv)
    sys.stderr.write(buffer.getvalue())
    return code, buffer.getvalue()


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


BUILT = "teachers.json"  # in the work folder once every teacher is saved
TUNED = "tuned.json"  # in the work folder once `kdflow tune precompute` recommended a micro-batch


def teacher_folder(work: Path, depth: int) -> Path:
    return work / f"teacher-L{depth}"


def build_teachers(work: Path, size: dict[str, Any], device: str) -> dict[str, Any]:
    """Random Qwen3-MoE teachers with the check's shapes at each depth, and a tokenizer of exactly their
    vocabulary (a tiny BPE trained on Python's docs, its vocabulary padded with ids it never produces), so
    that the student's vocabulary is the teacher's."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from kdflow.bench.tokenise import pydoc_paragraphs, train_tiny_tokenizer

    shapes = size["shapes"]
    record_path = work / BUILT
    if record_path.is_file():  # a second call on a machine still warm, with the same --work-dir: build once
        record = json.loads(record_path.read_text(encoding="utf-8"))
        if record["shapes"] == shapes and all(teacher_folder(work, d).is_dir() for d in size["depths"]):
            return record | {"reused": str(record_path)}
    tokenizer = train_tiny_tokenizer(work / "tokenizer", pydoc_paragraphs(400), 384)
    _pad_vocabulary(tokenizer / "tokenizer.json", shapes["vocab_size"])
    texts = pydoc_paragraphs(size["documents"])
    (work / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    built = {}
    for depth in size["depths"]:
        config = Qwen3MoeConfig(**(shapes | {"num_hidden_layers": depth}), intermediate_size=4 * shapes["hidden_size"],
                                max_position_embeddings=max(4096, size["seq_len"]), tie_word_embeddings=False,
                                eos_token_id=0, bos_token_id=0, pad_token_id=1)
        torch.manual_seed(depth)
        build_on = device if device == "cuda" else "cpu"  # random init of billions of weights: on the GPU there
        with torch.device(build_on):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        folder = teacher_folder(work, depth)
        model.save_pretrained(folder)
        for name in tokenizer.iterdir():
            shutil.copy(name, folder / name.name)
        built[f"L{depth}"] = {"parameters": sum(p.numel() for p in model.parameters())}
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    record = {"architecture": "Qwen3MoeForCausalLM", "shapes": shapes, "depths": built}
    record_path.write_text(json.dumps(record), encoding="utf-8")  # last: a build stopped midway is redone
    return record


def teacher_weights(config_paths: list[Path], depths: tuple[int, int], shapes: dict[str, int]) -> dict[str, Any]:
    """Each depth's 4-bit teacher loaded as the pass loads it (`load_teacher`): its weights by kind, any expert
    left in 16 bits (a failure), the load's seconds and peak device memory; the full depth's 4-bit weights
    extrapolated from the two depths, against the plan's arithmetic (what a 24 GB GPU must hold)."""
    import time

    import torch

    from kdflow.schemas.config import load_config
    from kdflow.tasks.common.fused_experts import fused_expert_weights, weight_bytes
    from kdflow.tasks.common.teacher_loading import load_teacher

    out: dict[str, Any] = {}
    totals = {}
    for depth, path in zip(depths, config_paths, strict=True):
        teacher = load_config(path).teacher
        cuda = teacher.device.startswith("cuda")
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        model = load_teacher(teacher)
        seconds = time.perf_counter() - started
        sizes, left = weight_bytes(model), fused_expert_weights(model)
        totals[depth] = sum(sizes.values())
        peak = round(torch.cuda.max_memory_allocated() / GIB, 3) if cuda else None
        out[f"L{depth}"] = {"load_s": round(seconds, 2), "total_gib": round(totals[depth] / GIB, 4),
                            "weight_bytes": sizes,
                            "experts_left_unquantised": [name for name, *_ in left], "peak_load_gib": peak}
        del model
        if left:
            raise RuntimeError(f"{len(left)} expert weight(s) of the L{depth} teacher not quantised: {left[0][0]}")
    low, high = depths
    per_layer = (totals[high] - totals[low]) / (high - low)
    layers, float_bytes = shapes["num_hidden_layers"], 2 if teacher.dtype in ("bfloat16", "float16") else 4
    full = int(totals[low] + per_layer * (layers - low))
    planned = teacher_bytes(shapes, layers, True, float_bytes=float_bytes)
    out["full_depth"] = {"what": f"extrapolation to {layers} layers from L{low} and L{high}",
                         "weights_4bit_bytes": full, "weights_4bit_gib": round(full / GIB, 3),
                         "planned_bytes": planned, "planned_gib": round(planned / GIB, 3),
                         "weights_4bit_experts_16bit_gib": round(
                             teacher_bytes(shapes, layers, True, experts_4bit=False, float_bytes=float_bytes) / GIB, 3)}
    return out


def _pad_vocabulary(tokenizer_json: Path, vocab: int) -> None:
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    entries = data["model"]["vocab"]
    for index in range(len(entries), vocab):
        entries[f"<|unused{index}|>"] = index
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def tokens(config_path: Path) -> dict[str, Any]:
    from kdflow.schemas.config import load_config
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
    from kdflow.commands.tune import main as tune_main

    code, out = captured(tune_main, [str(config_path), "--micro-batches", size["micro_batches"], "--batches", "2",
                                     "--write", "--json", "--timeout-s", "150"])
    result = json_lines(out)[-1]
    if code != 0:
        raise RuntimeError(f"kdflow tune precompute exited {code}: no recommendation")
    record = {key: result[key] for key in ("recommended_micro_batch", "recommended_tokens_per_s", "fastest_micro_batch",
                                           "recommended_over_fastest", "candidates")}
    (config_path.parent / TUNED).write_text(json.dumps(record), encoding="utf-8")
    return record


def tuned_micro_batch(work: Path, results: dict[str, dict[str, Any]]) -> int | None:
    """The micro-batch `tune` recommended in this call or, when it did not run (`--only`), in an earlier call
    with the same --work-dir; None when neither (the pass then uses the config's)."""
    if "recommended_micro_batch" in results.get("tune_precompute", {}):
        return results["tune_precompute"]["recommended_micro_batch"]
    path = work / TUNED
    return json.loads(path.read_text(encoding="utf-8"))["recommended_micro_batch"] if path.is_file() else None


def precompute(config_path: Path) -> dict[str, Any]:
    """The teacher pass in its worker process, as the precompute flow starts it (the tuned micro-batch if written)."""
    from kdflow.tasks.common.launch import run_child
    from kdflow.tasks.teacher.precompute_worker import MODULE

    outcome = run_child(MODULE, ["--config", str(config_path)], on_log=lambda pid, line: print(line, file=sys.stderr))
    if outcome.exit_code != 0 or outcome.result is None:
        message = outcome.errors[-1]["message"] if outcome.errors else ""
        raise RuntimeError(f"the teacher worker exited {outcome.exit_code}: {message}")
    keys = ("tag", "written", "tokens", "tokens_per_s", "peak_device_memory_mib", "device", "writer", "phases_s")
    return {key: outcome.result.get(key) for key in keys}


def targets(config_path: Path, mode: str) -> dict[str, Any]:
    """Sampled or hybrid targets: the pass in its worker on a copy of the token store (its own run root)."""
    import yaml

    from kdflow.schemas.layout import TOPK_DIR

    data = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    source = Path(data["run_root"])
    root = source.with_name(f"{source.name}-{mode}")
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(source, root, ignore=lambda folder, names: [TOPK_DIR] if Path(folder) == source else [])
    data["run_root"] = str(root)
    data["precompute"] |= {"targets": mode, "store": {"format": "v2"}}
    return precompute(write_yaml(config_path.with_name(f"check-{mode}.yaml"), data)) | {"targets": mode}


def bench(what: str, argv: list[str]) -> dict[str, Any]:
    """A `kdflow bench` run: failed when it exits non-zero or a record holds an error; records that say they were
    skipped (planned, nothing attempted) are listed, never counted as errors."""
    from kdflow.bench import run_bench

    code, out = captured(lambda bench_argv: run_bench(what, bench_argv), argv)
    records = json_lines(out)
    skipped = [r for r in records if r.get("skipped") or str(r.get("status", "")).startswith("skipped")]
    errors = [r for r in records
              if r not in skipped and (r.get("error") or str(r.get("status", "")).startswith("error"))]
    if code != 0 or not records or errors:
        raise RuntimeError(f"kdflow bench {what} exited {code}: {errors[0] if errors else 'no records'}")
    if len(skipped) == len(records):
        raise Skipped(f"every record skipped: {skipped[0].get('skipped') or skipped[0].get('status')}")
    off = [r for r in records if r.get("float32_check", {}).get("ok") is False]
    if off:  # the step's values against the float32 reference step, out of tolerance
        check = off[0]["float32_check"]
        raise RuntimeError(f"kdflow bench {what}: {off[0].get('variant')} against float32: loss rel diff "
                           f"{check['loss_rel_diff']:.3g}, gradient rel diff {check['grad_rel_diff']:.3g} "
                           f"(tolerances {check['tolerance']})")
    return {"records": records, "skipped_records": len(skipped)}


def teacher_pass(config_path: Path, micro_batch: int | None, shards: int, depth: int,
                 shapes: dict[str, int], repeats: int = 2) -> dict[str, Any]:
    """`kdflow bench teacher-pass` (body, forward, topk, stage) on one teacher; with MFU from its active params."""
    argv = ["--config", str(config_path), "--shards", str(shards), "--repeats", str(repeats)]
    if micro_batch:
        argv += ["--micro-batch", str(micro_batch)]
    result = bench("teacher-pass", argv)
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
    """Full depth from two depths: seconds a token = a + b x layers, fitted through both; an EXTRAPOLATION."""
    low, high = (results[f"teacher_pass_L{d}_{quant}"] for d in depths)
    full = shapes["num_hidden_layers"]
    out: dict[str, Any] = {"what": "extrapolation to full depth, not a measurement", "layers": full}
    measured = set(low["tokens_per_s"]) & set(high["tokens_per_s"])
    for mode in [m for m in ("forward", "topk", "stage") if m in measured]:
        t_low, t_high = 1 / low["tokens_per_s"][mode], 1 / high["tokens_per_s"][mode]
        per_layer = (t_high - t_low) / (depths[1] - depths[0])
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

    from kdflow.schemas.config import load_config
    from kdflow.tasks.student.train import autocast_for, train as train_stage

    config = load_config(config_path)
    device = torch.device(config.student.device)
    autocast = autocast_for(device, config.student.autocast_bf16)
    summary = train_stage(config)
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

    from kdflow.schemas.config import load_config
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
        outcome = run_child(MODULE, [EXEC_TORCHRUN, *torchrun_arguments(config.student.distributed, path)],
                            on_log=lambda pid, line: print(line, file=sys.stderr))
    if outcome.exit_code != 0 or outcome.result is None:
        message = outcome.errors[0].get("message") if outcome.errors else ""
        raise RuntimeError(f"torchrun exited {outcome.exit_code}: {message}")
    return {"steps": outcome.result.get("steps"), "final_loss": outcome.result.get("final_loss"), "world_size": 2}
