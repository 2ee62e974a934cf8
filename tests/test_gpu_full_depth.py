"""The GPU check's full-depth step (kdflow/bench/gpu_full_depth.py): the teacher built in memory and quantised in
place holds what the loader would have loaded from the same weights, and the step's record names its rooflines."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from kdflow.bench.gpu_full_depth import KDFLOW_PASS_MODES

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.unit
# The modes timed here: kdflow's variants of the pass too where Triton interprets them (the suite sets
# TRITON_INTERPRET=1), as a GPU runs them compiled.
MODES = {"body", "forward", "topk"} | (set(KDFLOW_PASS_MODES) if importlib.util.find_spec("triton") else set())


def test_quantised_in_place_holds_the_loaders_4bit_bytes_and_logits(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """A random Qwen3-MoE saved, loaded in 4-bit by `load_teacher`, against the same model quantised in place:
    the same 4-bit bytes by kind, the same Linear4bit layers, the same logits (the same NF4 values)."""
    import torch
    from transformers import AutoTokenizer

    from kdflow.bench.gpu_models import build_random
    from kdflow.tasks.common.random_teacher import quantise_in_place
    from kdflow.bench.gpu_plan import QUICK_SHAPES
    from kdflow.schemas.config import TeacherConfig
    from kdflow.tasks.common.fused_experts import experts_left_unquantised, weight_bytes
    from kdflow.tasks.common.teacher_loading import load_teacher

    from kdflow.tasks.common.teacher_loading import float32_lm_head

    model = build_random(QUICK_SHAPES, 2, "cpu", seed=3)
    model.save_pretrained(tmp_path / "teacher")
    float32_lm_head(model)  # as the step builds it and the loader loads it
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(tmp_path / "teacher")
    loaded = load_teacher(TeacherConfig(model=str(tmp_path / "teacher"), device="cpu", dtype="bfloat16",
                                        load_in_4bit=True))
    assert quantise_in_place(model) == 2 * 4  # q, k, v, o in each layer; the router and lm_head stay bf16
    assert experts_left_unquantised(model) == []
    assert weight_bytes(model) == weight_bytes(loaded)
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}
    assert kinds == {name: type(module).__name__ for name, module in loaded.named_modules()}
    ids = torch.randint(2, QUICK_SHAPES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, loaded(input_ids=ids).logits, rtol=0, atol=0)


def test_the_step_times_both_precisions_and_names_both_rooflines() -> None:
    from kdflow.bench.gpu_full_depth import full_depth
    from kdflow.bench.gpu_plan import QUICK_SHAPES

    out = full_depth(QUICK_SHAPES, "cpu", 2, 16, 8, 64, 1, 128)
    assert out["what"].startswith("measured at full depth") and out["layers"] == QUICK_SHAPES["num_hidden_layers"]
    assert out["roofline_tflops"]["datasheet_dense_bf16"] is None and out["device_name"] == "cpu"  # no datasheet
    assert out["roofline_tflops"]["measured_bf16_matmul"] > 0
    for bits in ("bf16", "4bit"):
        rates = out[bits]["tokens_per_s"]
        assert set(rates) == MODES and all(rate > 0 for rate in rates.values())
        assert set(out[bits]["mfu_of_measured_matmul"]) == set(rates) and "out_of_memory" not in out[bits]
        assert out[bits]["topk/forward"] > 0 and "mfu_of_datasheet_peak" not in out[bits]
    assert out["4bit"]["experts_left_unquantised"] == [] and out["4bit"]["weight_bytes"] < out["bf16"]["weight_bytes"]
    assert set(out["4bit/bf16"]) == MODES


def test_the_datasheet_peak_is_the_devices_own() -> None:
    """The H100 SXM the device tool lends and the H200 share a peak; the PCIe H100 and the 3090 do not."""
    from kdflow.bench.gpu_full_depth import datasheet_peak

    assert datasheet_peak("NVIDIA H200") == datasheet_peak("NVIDIA H100 80GB HBM3") == 989.0
    assert datasheet_peak("NVIDIA H100 PCIe") == 756.0 and datasheet_peak("NVIDIA GeForce RTX 3090") == 71.0
    assert datasheet_peak("NVIDIA A100-SXM4-80GB") == 312.0 and datasheet_peak("Tesla T4") is None


def test_where_bf16_does_not_fit_the_4bit_teacher_is_built_layer_by_layer_and_timed_alone() -> None:
    """A device whose free memory the bf16 weights would overfill (a 40 GB card at the reference; 1 MiB here): bf16 is
    skipped with its reason, the 4-bit teacher still measured in every mode, every expert quantised."""
    from kdflow.bench.gpu_full_depth import full_depth
    from kdflow.bench.gpu_plan import QUICK_SHAPES

    out = full_depth(QUICK_SHAPES, "cpu", 2, 16, 8, 64, 1, 128, free_bytes=2**20)
    assert "90% of the device's free memory" in out["bf16"]["skipped"] and set(out["bf16"]) == {"skipped"}
    assert set(out["4bit"]["tokens_per_s"]) == MODES and "4bit/bf16" not in out
    assert out["4bit"]["experts_left_unquantised"] == [] and "quantise_s" not in out


def test_a_mode_that_runs_out_of_memory_is_its_outcome_and_the_others_run() -> None:
    """The bare forward's whole logits out of memory (as beside bf16 weights on an H100; raised here by a hook on
    the bare lm_head, which only that mode calls as a module): recorded under `out_of_memory`, the body and the
    pass's step still timed, no ratio made of the missing rate."""
    import torch

    from kdflow.bench.gpu_full_depth import time_modes
    from kdflow.bench.gpu_models import build_random
    from kdflow.bench.gpu_plan import QUICK_SHAPES
    from kdflow.tasks.common.teacher_loading import float32_lm_head

    model = build_random(QUICK_SHAPES, 2, "cpu")
    float32_lm_head(model)

    def no_memory(module: Any, args: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")

    model.get_output_embeddings().linear.register_forward_pre_hook(no_memory)
    ids = torch.randint(2, QUICK_SHAPES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    rates, out_of_memory, failed = time_modes(model, ids, 8, 64, 1)
    assert set(rates) - set(KDFLOW_PASS_MODES) == {"body", "topk"} and all(rate > 0 for rate in rates.values())
    assert out_of_memory == {"forward": "CUDA out of memory. Tried to allocate 12.00 GiB"} and failed == {}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_pass_is_also_timed_as_kdflow_runs_it_and_the_experts_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiled heads with the fused experts (on a CPU through Triton's interpreter, as the suite runs it), each
    mode's experts implementation set for its timing and the model's own put back; a variant that fails is
    recorded as failed, and the others are timed."""
    import torch

    from kdflow.bench.gpu_full_depth import time_modes
    from kdflow.bench.gpu_models import build_random
    from kdflow.bench.gpu_plan import QUICK_SHAPES
    from kdflow.tasks.teacher import body_variants
    from kdflow.tasks.teacher.body_variants import experts_in_use, use_experts

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = build_random(QUICK_SHAPES, 1, "cpu")
    before = experts_in_use(model)
    ids = torch.randint(2, QUICK_SHAPES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    rates, out_of_memory, failed = time_modes(model, ids, 8, 64, 1)
    assert set(rates) == {"body", "forward", "topk", *KDFLOW_PASS_MODES} and not out_of_memory and not failed
    assert experts_in_use(model) == before != "kdflow_fused"

    def broken(model: Any, choice: str) -> Any:  # the fused experts cannot run: the other modes still can
        if choice == "kdflow_fused":
            raise RuntimeError("the kernel did not compile")
        return use_experts(model, choice)

    monkeypatch.setattr(body_variants, "use_experts", broken)
    rates, _, failed = time_modes(model, ids, 8, 64, 1)
    assert set(failed) == set(KDFLOW_PASS_MODES) and "the kernel did not compile" in failed["topk_tiled_fused"]
    assert {"body", "forward", "topk"} <= set(rates) and experts_in_use(model) == before


def test_built_layer_by_layer_the_4bit_teacher_holds_what_the_whole_build_holds() -> None:
    """The capped step's teacher (made on the meta device, each layer given memory and quantised in turn, never
    the whole model in 16 bits): the same 4-bit bytes by kind and the same module kinds as the model built whole
    and quantised in place, nothing left on the meta device or in floating point, its rotary tables computed."""
    import torch

    from kdflow.bench.gpu_capped import capped
    from kdflow.bench.gpu_models import build_quantised, build_random
    from kdflow.tasks.common.random_teacher import quantise_in_place
    from kdflow.bench.gpu_plan import QUICK_SHAPES
    from kdflow.tasks.common.fused_experts import experts_left_unquantised, weight_bytes
    from kdflow.tasks.common.teacher_loading import float32_lm_head

    model = build_quantised(QUICK_SHAPES, "cpu")
    whole = build_random(QUICK_SHAPES, QUICK_SHAPES["num_hidden_layers"], "cpu")
    float32_lm_head(whole)
    quantise_in_place(whole)
    assert weight_bytes(model) == weight_bytes(whole) and experts_left_unquantised(model) == []
    assert {n: type(m).__name__ for n, m in model.named_modules()} == {
        n: type(m).__name__ for n, m in whole.named_modules()}
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, whole.model.rotary_emb.inv_freq)
    ids = torch.randint(2, QUICK_SHAPES["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    out = capped(QUICK_SHAPES, "cpu", 24.0, 16, [2, 4], 8, 64)
    assert [(c["experts"], c["micro_batch"], c["status"]) for c in out["candidates"]] == [
        ("grouped_mm", 4, "ok"), ("grouped_mm", 2, "ok"), ("kdflow_fused", 4, "ok"), ("kdflow_fused", 2, "ok")]
    assert out["fits_micro_batch"] == 4 and out["fits_by_experts"] == {"grouped_mm": 4, "kdflow_fused": 4}
    assert out["cap_gib"] is None and not out["llmjp_micro_batch_fits"]  # a CPU has no cap; 56 not tried
