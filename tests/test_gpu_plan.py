"""The GPU check's plan (kdflow/bench/gpu_plan.py): the reference shapes it builds, what each step would run at full
size on a device of a given memory (an H200, an H100, a smaller card), and how its steps spread over the calls."""

from __future__ import annotations

import json
from typing import Any

import pytest


@pytest.mark.unit
def test_plan_at_full_size_skips_only_the_dense_loss_at_32k(capsys: pytest.CaptureFixture[str]) -> None:
    """The H200's plan: every teacher pass fits; the dense loss at 32K tokens x 196,608 ids is a planned skip."""
    from kdflow.bench.gpu import main

    assert main(["--plan"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["bench"] == "gpu_check_plan" and not plan["quick"] and plan["depths"] == [2, 4]
    assert plan["card_counts_match"] == {"embedding": True, "non_embedding": True, "activated": True, "total": True}
    assert plan["would_skip"] == ["loss_dense_32768"]
    steps = plan["steps"]
    assert {name for name in steps if name.startswith("teacher_pass_")} == {
        f"teacher_pass_L{d}_{b}" for d in (2, 4) for b in ("4bit", "bf16")}
    assert all(steps[f"teacher_pass_L{d}_{b}"]["would"] == "run" for d in (2, 4) for b in ("4bit", "bf16"))
    assert steps["loss_dense_8192"]["would"] == "run" and steps["loss_fused_32768"]["would"] == "run"
    assert steps["loss_dense_32768"]["estimated_gib"] > 0.6 * 139
    full = steps["full_depth"]  # measured now, no longer extrapolated: bf16 (~60 GiB) and 4-bit fit the H200
    assert full["would"] == "run" and full["layers"] == 32
    assert 55 < full["weights_bf16_gib"] < full["bf16_estimated_gib"]
    assert full["bf16"] == {"build": "run", "body_topk": "run", "forward": "run"}
    time_s = plan["time_s"]  # issue 44's steps run before 2026-12-04's, which spill to a second call
    issue = ["profile", "full_depth", "bench_head", "body_variants", "capped_24gib", "hub_layout_load",
             "tune_capped_24gib"]
    assert time_s["issue_steps"] == issue and all(steps[name]["would"] == "run" for name in issue)
    assert time_s["total"] == time_s["last_check"] + sum(steps[name]["estimated_s"] for name in issue)
    assert time_s["first_call"] <= time_s["limit"] == 540 < time_s["total"]  # one call of at most 9 minutes
    assert time_s["second_call_steps"][:3] == ["teacher_weights_4bit", "teacher_pass_L2_4bit", "teacher_pass_L4_4bit"]
    assert time_s["second_call_steps"][-1] == "train_bf16" and not set(time_s["second_call_steps"]) & set(issue)
    # optional: 2026-12-04's figures again, its own budget (what the lease leaves, ~240 s) skipping the last of them
    assert 0 < time_s["second_call"] <= time_s["limit"]
    assert steps["hub_layout_load"]["would"] == "run" and 5 < steps["hub_layout_load"]["checkpoint_gib"] < 6
    assert steps["capped_24gib"]["estimated_gib"] == 24 and 56 in steps["capped_24gib"]["micro_batches"]
    h100 = plan_at(78.0)["steps"]["full_depth"]  # bf16's weights fit an H100, not its whole logits beside them
    assert h100["would"] == "run" and h100["bf16"]["build"] == h100["bf16"]["body_topk"] == "run"
    assert h100["bf16"]["forward"].startswith("may run out of memory")
    small = plan_at(40.0)
    assert "teacher_pass_L4_bf16" not in small["would_skip"] and "loss_dense_8192" in small["would_skip"]
    assert "full_depth" not in small["would_skip"]  # 60 GiB of bf16 weights on a 40 GiB device: 4-bit alone
    assert small["steps"]["full_depth"]["bf16"]["build"].startswith("skip: weights 59.9 GiB")
    assert small["steps"]["full_depth"]["estimated_gib"] < 34


def plan_at(memory_gib: float) -> dict[str, Any]:
    from kdflow.bench.gpu_plan import plan

    return json.loads(json.dumps(plan(False, memory_gib)))


@pytest.mark.unit
def test_reference_shapes_count_as_a_real_qwen3_moe() -> None:
    """The plan's parameter arithmetic (which reproduces the reference card's four counts exactly) against a
    Qwen3-MoE built from shapes of the same kind, every dimension distinct, on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from kdflow.bench.gpu_plan import REFERENCE_SHAPES, derived_shapes_check, model_parameters

    shapes = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 24,
              "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40, "num_hidden_layers": 3,
              "vocab_size": 1000}
    config = Qwen3MoeConfig(**shapes, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == model_parameters(shapes)["total"]
    assert all(derived_shapes_check().values()) and REFERENCE_SHAPES["vocab_size"] == 196_608
