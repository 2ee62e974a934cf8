"""The teachers of `kdflow bench gpu`: random Qwen3-MoE models at the check's shapes, built once per work folder,
and their 4-bit weights as the pass loads them (the steps `teacher` and `teacher_weights_4bit`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kdflow.bench.gpu_plan import reference_config, teacher_bytes
from kdflow.tasks.common.units import GIB

BUILT = "teachers.json"  # in the work folder once every teacher is saved


def teacher_folder(work: Path, depth: int) -> Path:
    return work / f"teacher-L{depth}"


def build_teachers(work: Path, size: dict[str, Any], device: str) -> dict[str, Any]:
    """Random Qwen3-MoE teachers with the check's shapes at each depth, and a tokenizer of exactly their
    vocabulary (a tiny BPE trained on Python's docs, its vocabulary padded with ids it never produces), so
    that the student's vocabulary is the teacher's."""
    import torch
    from transformers import AutoModelForCausalLM

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
        config = reference_config(shapes | {"num_hidden_layers": depth},
                                  max_position_embeddings=max(4096, size["seq_len"]))
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

    from kdflow.schemas.config_io import load_config
    from kdflow.tasks.common.fused_experts import experts_left_unquantised, weight_bytes
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
        sizes, left = weight_bytes(model), experts_left_unquantised(model)
        totals[depth] = sum(sizes.values())
        peak = round(torch.cuda.max_memory_allocated() / GIB, 3) if cuda else None
        out[f"L{depth}"] = {"load_s": round(seconds, 2), "total_gib": round(totals[depth] / GIB, 4),
                            "weight_bytes": sizes,
                            "experts_left_unquantised": left, "peak_load_gib": peak}
        del model
        if left:
            raise RuntimeError(f"{len(left)} expert weight(s) of the L{depth} teacher not quantised: {left[0]}")
    low, high = depths
    per_layer = (totals[high] - totals[low]) / (high - low)
    layers, float_bytes = shapes["num_hidden_layers"], 2 if teacher.dtype in ("bfloat16", "float16") else 4
    full = int(totals[low] + per_layer * (layers - low))
    planned = teacher_bytes(shapes, layers, True, float_bytes=float_bytes)
    out["full_depth"] = {"what": f"extrapolated to {layers} layers from L{low} and L{high}",
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
