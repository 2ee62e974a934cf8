"""The teacher loaded from a checkpoint in the reference model's own file layout (issue 44, item 3's rehearsal).

The hub's Qwen3-MoE checkpoints keep one tensor per expert and projection
(`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`) in safetensors shards with an index; transformers 5
fuses them into 3-D parameters as it loads (its conversion mapping), and kdflow's loader quantises each fused
parameter as it is set (kdflow.tasks.common.fused_experts). The checks so far loaded checkpoints that
`save_pretrained` wrote, already fused: this writes the hub's layout, tensor by tensor and shard by shard (random
values, or a model's own to compare with), and loads it in a child process, as the pass loads its teacher,
recording the child's peak host RSS (`ru_maxrss`, the whole process's: a fresh process so nothing before counts;
and, sampled during the load, its anonymous and file-backed parts: a memory-mapped checkpoint's pages count in the
RSS but are the kernel's to drop), its peak device memory, the load's seconds and whether any expert weight was
left in floating point. On CUDA the child loads under the 24 GiB cap (kdflow.tasks.common.device_memory), as a
24 GB card would hold it.

`python -m kdflow.bench.gpu_hub_layout FOLDER DEVICE [CAP_GIB]` is the child: it prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kdflow.bench.gpu_plan import CAP_GIB
from kdflow.tasks.common.units import GIB

SHARD_BYTES = 2 * GIB
EXPERT_PARTS = ("gate_proj", "up_proj")  # the order in which transformers 5 concatenates them into gate_up_proj


def hub_tensors(name: str, tensor: Any) -> list[tuple[str, Any]]:
    """One fused parameter as the hub names it: a 3-D expert weight split into one 2-D tensor per expert (the fused
    gate_up_proj holds each expert's gate rows, then its up rows); any other tensor as it is."""
    prefix, _, last = name.rpartition(".")
    if not prefix.endswith(".experts") or tensor.dim() != 3:
        return [(name, tensor)]
    out = []
    for expert in range(tensor.shape[0]):
        if last == "gate_up_proj":
            gate, up = tensor[expert].chunk(2, dim=0)
            out += [(f"{prefix}.{expert}.{part}.weight", value.contiguous())
                    for part, value in zip(EXPERT_PARTS, (gate, up), strict=True)]
        else:
            out.append((f"{prefix}.{expert}.{last}.weight", tensor[expert].contiguous()))
    return out


def write_hub_layout(config: Any, folder: Path, source: Any = None, shard_bytes: int = SHARD_BYTES,
                     seed: int = 0, device: str = "cpu") -> dict[str, Any]:
    """Write `config`'s model into `folder` in the hub's layout: config.json, safetensors shards of at most
    `shard_bytes` and their index. Values from `source` (a model of that config) or random (bf16, std 0.02, norms
    one), made one parameter at a time (on `device`: a GPU draws billions of them in no time), so the writer never
holds the whole model. -> files, tensors, bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    if source is None:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        shapes = [(name, param.shape) for name, param in skeleton.named_parameters()]
    else:
        params = dict(source.named_parameters())
        shapes = [(name, param.shape) for name, param in params.items()]
    generator = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    files: list[str] = []
    held = total = 0

    def flush() -> None:
        nonlocal shard, held
        if shard:
            files.append(f"model-{len(files) + 1:05d}.safetensors")
            save_file(shard, folder / files[-1], metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, files[-1]))
            shard, held = {}, 0

    for name, shape in shapes:
        if source is not None:
            value = params[name].detach().to("cpu", torch.bfloat16)
        elif name.endswith("norm.weight"):
            value = torch.ones(shape, dtype=torch.bfloat16)
        else:
            value = (torch.randn(shape, generator=generator, device=device) * 0.02).to("cpu", torch.bfloat16)
        for hub_name, tensor in hub_tensors(name, value):
            size = tensor.numel() * tensor.element_size()
            if held and held + size > shard_bytes:
                flush()
            shard[hub_name] = tensor
            held, total = held + size, total + size
        del value
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1), encoding="utf-8")
    return {"files": len(files), "tensors": len(weight_map), "bytes": total}


def load_in_child(folder: Path, device: str, cap_gib: float | None = None, timeout_s: float = 600) -> dict[str, Any]:
    """The child's record (see `main`); a child that fails raises with its last line of stderr."""
    import subprocess

    cap = [] if cap_gib is None else [str(cap_gib)]
    done = subprocess.run([sys.executable, "-m", "kdflow.bench.gpu_hub_layout", str(folder), device, *cap],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        raise RuntimeError(f"loading the hub-layout checkpoint: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_step(work: Path, size: dict[str, Any], device: str) -> dict[str, Any]:
    """The GPU check's `hub_layout_load`: the reference's full widths at the size's depth, written random in the
    hub's layout into the work folder (removed after), loaded in 4-bit in a child."""
    import shutil

    from transformers import Qwen3MoeConfig

    shapes = size["shapes"] | {"num_hidden_layers": size["hub_layout_layers"]}
    config = Qwen3MoeConfig(**shapes, tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=1)
    folder = work / "hub-layout"
    shutil.rmtree(folder, ignore_errors=True)
    started = time.perf_counter()
    written = write_hub_layout(config, folder, device=device)
    written["write_s"] = round(time.perf_counter() - started, 2)
    try:
        loaded = load_in_child(folder, device, CAP_GIB if device.startswith("cuda") else None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if loaded["experts_left_unquantised"]:
        raise RuntimeError(f"expert weights left unquantised: {loaded['experts_left_unquantised'][0]}")
    return {"layers": shapes["num_hidden_layers"], "written": written, **loaded}


def main(argv: list[str] | None = None) -> int:
    """FOLDER DEVICE [CAP_GIB]: load FOLDER in 4-bit as the pass loads its teacher (on CUDA under a cap of CAP_GIB
    of device memory, when given), one forward of 8 tokens; one JSON line."""
    import resource

    import torch

    from kdflow.bench.harness import HostMemoryPeaks
    from kdflow.schemas.config import TeacherConfig
    from kdflow.tasks.common.fused_experts import experts_left_unquantised, weight_bytes
    from kdflow.tasks.common.teacher_loading import load_teacher

    args = argv if argv is not None else sys.argv[1:]
    folder, device = args[:2]
    cap_gib = float(args[2]) if len(args) > 2 else None
    cuda = device.startswith("cuda")
    cap: dict[str, Any] = {"cap_gib": None}
    if cuda and cap_gib is not None:
        from kdflow.tasks.common.device_memory import cap_device_memory

        cap = cap_device_memory(device, cap_gib)
    started = time.perf_counter()
    with HostMemoryPeaks() as host:
        model = load_teacher(TeacherConfig(model=folder, device=device, dtype="bfloat16", load_in_4bit=True))
    seconds = time.perf_counter() - started
    ids = torch.arange(2, 10, device=device).unsqueeze(0)
    with torch.inference_mode():
        finite = bool(torch.isfinite(model(input_ids=ids).logits).all())
    record = {"load_s": round(seconds, 2), "peak_host_rss_gib": round(resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3),
              "peak_host_anonymous_gib": round(host.peaks["RssAnon"] / GIB, 3),
              "peak_host_file_backed_gib": round(host.peaks["RssFile"] / GIB, 3),
              "weights_gib": round(sum(weight_bytes(model).values()) / GIB, 3),
              "experts_left_unquantised": experts_left_unquantised(model), "logits_finite": finite} | cap
    if cuda:
        record["peak_device_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
