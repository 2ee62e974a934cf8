"""A teacher checkpoint in the hub's own layout (one tensor per expert and projection, safetensors shards and an
index; kdflow/bench/gpu_hub_layout.py): transformers 5 fuses it as it loads and kdflow's loader quantises it, to
the same 4-bit teacher as the fused checkpoint `save_pretrained` writes; the child's record holds its peak RSS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")


@pytest.mark.unit
def test_the_hub_layout_loads_in_4bit_to_the_fused_checkpoints_teacher(tmp_path: Path) -> None:
    import torch

    from kdflow.bench.gpu_models import build_random
    from kdflow.bench.gpu_hub_layout import write_hub_layout
    from kdflow.bench.gpu_plan import QUICK_SHAPES
    from kdflow.schemas.config import TeacherConfig
    from kdflow.tasks.common.fused_experts import weight_bytes
    from kdflow.tasks.common.teacher_loading import load_teacher

    model = build_random(QUICK_SHAPES, 2, "cpu", seed=5)
    model.save_pretrained(tmp_path / "fused")
    written = write_hub_layout(model.config, tmp_path / "hub", source=model, shard_bytes=200_000)
    index = json.loads((tmp_path / "hub" / "model.safetensors.index.json").read_text())["weight_map"]
    experts = QUICK_SHAPES["num_experts"]
    assert written["files"] > 1 and written["tensors"] == len(index)
    assert {f"model.layers.1.mlp.experts.{experts - 1}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")} \
        <= set(index) and not any("gate_up_proj" in name for name in index)
    loaded = {name: load_teacher(TeacherConfig(model=str(tmp_path / name), device="cpu", dtype="bfloat16",
                                               load_in_4bit=True)) for name in ("fused", "hub")}
    assert weight_bytes(loaded["hub"]) == weight_bytes(loaded["fused"])
    ids = torch.randint(2, QUICK_SHAPES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # the same NF4 values: the hub's per-expert tensors were fused back exactly
        torch.testing.assert_close(loaded["hub"](input_ids=ids).logits, loaded["fused"](input_ids=ids).logits,
                                   rtol=0, atol=0)


def test_the_check_step_writes_random_weights_and_loads_them_in_a_child(children: object, tmp_path: Path) -> None:
    """The GPU check's `hub_layout_load` at the rehearsal's shapes: written, loaded in 4-bit in a fresh process
    (its peak RSS its own), nothing left in floating point, the folder removed after."""
    from kdflow.bench.gpu_hub_layout import check_step
    from kdflow.bench.gpu_plan import sizes

    record = check_step(tmp_path, sizes(True), "cpu")
    assert record["layers"] == 2 and record["written"]["tensors"] > 0 and record["written"]["write_s"] >= 0
    assert record["experts_left_unquantised"] == [] and record["logits_finite"] and record["load_s"] > 0
    assert 0.05 < record["peak_host_rss_gib"] < 8 and not (tmp_path / "hub-layout").exists()
