"""The teacher pass's profile by kernel family (kdflow/bench/gpu_profile.py): the classifier's table on op names
collected from a CPU profile of a tiny Qwen3-MoE pass (and the CUDA kernel names an H200 shows), and one real
micro-batch of a tiny 4-bit Qwen3-MoE teacher profiled: every family the pass has shows up, with its time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kdflow.bench.gpu_profile import FAMILIES, classify

pytestmark = pytest.mark.unit

# (innermost label, op name [+ kernel names]) -> family: the CPU ones as a profile of the tiny teacher's pass
# (transformers 5.25, torch 2.13) named them.
SEEN = [
    ("attention", "aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("attention", "aten::mm", "attention"),
    ("rotary", "aten::mul", "attention"),
    ("norm", "aten::pow", "norms"), ("norm", "aten::mean", "norms"),  # q_norm inside the attention: a norm
    ("router", "aten::topk", "router_topk"), ("router", "aten::_softmax", "router_topk"),
    ("router", "aten::mm", "router_topk"),
    ("experts", "aten::_grouped_mm", "expert_gemm"), ("experts", "aten::mm", "expert_gemm"),
    ("experts", "aten::index", "permute_unpermute"), ("experts", "aten::sort", "permute_unpermute"),
    ("experts", "aten::index_add_", "permute_unpermute"), ("moe_block", "kdflow::moe_block", "permute_unpermute"),
    ("experts", "bitsandbytes::dequantize_4bit", "expert_dequantisation"),
    ("activation", "aten::silu", "activations"), ("experts", "aten::mul", "activations"),
    ("step", "aten::mm", "lm_head_matmul"), ("lm_head", "aten::linear", "lm_head_matmul"),
    ("step", "aten::exp_", "log_sum_exp"), ("step", "aten::log", "log_sum_exp"), ("step", "aten::sum", "log_sum_exp"),
    ("step", "aten::scatter_", "log_sum_exp"),
    ("experts", "kdflow::fused expert_gate_up", "expert_gemm"), ("experts", "expert_down", "expert_gemm"),
    ("step", "sample_tile_stats", "log_sum_exp"), ("step", "tile_stats", "log_sum_exp"), ("step", "tile_keys", "top_k"),
    ("step", "aten::topk", "top_k"), ("step", "aten::gather", "top_k"),
    ("d2h", "aten::to", "device_to_host"), ("encode", "kdflow::encode", "encoding"),
    ("body", "aten::add", "other"), ("embedding", "aten::index_select", "other"), ("step", "aten::copy_", "other"),
    # CUDA: the op with the kernels it launched
    ("experts", "aten::linear void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, ...)",
     "expert_dequantisation"),
    ("step", "aten::mm sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "lm_head_matmul"),
    ("step", "aten::topk void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "top_k"),
    ("", "aten::copy_ Memcpy DtoH (Device -> Pinned)", "device_to_host"),
    ("attention", "aten::_scaled_dot_product_flash_attention pytorch_flash::flash_fwd_kernel", "attention"),
]


@pytest.mark.parametrize(("scope", "name", "family"), SEEN)
def test_each_seen_op_falls_in_its_family(scope: str, name: str, family: str) -> None:
    assert classify(scope, name) == family


def test_a_profiled_micro_batch_of_a_4bit_moe_teacher_times_every_family(tiny_moe_teacher_dir: Path) -> None:
    """The CPU rehearsal's table has the GPU's shape: every family named, shares summing to one, and each part
    of the pass seen (the 4-bit experts' dequantisation included), the unclassified rest small."""
    pytest.importorskip("bitsandbytes")
    import torch

    from kdflow.bench.gpu_profile import profile_micro_batch
    from kdflow.schemas.codec import TopkCodec
    from kdflow.schemas.config import TeacherConfig
    from kdflow.tasks.common.teacher_loading import load_teacher

    model = load_teacher(TeacherConfig(model=str(tiny_moe_teacher_dir), device="cpu", dtype="bfloat16",
                                       load_in_4bit=True))
    vocab = model.get_output_embeddings().out_features
    ids = torch.randint(2, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    out = profile_micro_batch(model, ids, 8, 16, TopkCodec(16, 8, vocab))
    assert out["time_basis"] == "cpu_us" and out["tokens"] == 32 and out["seconds"] > 0
    assert tuple(out["share"]) == FAMILIES and sum(out["share"].values()) == pytest.approx(1, abs=1e-3)
    seen = {family for family, us in out["cpu_us"].items() if us > 0}
    assert seen >= set(FAMILIES) - {"other"}, set(FAMILIES) - seen
    assert out["device_us"] == dict.fromkeys(FAMILIES, 0.0)
    # The unclassified rest is glue (the labels' own Python time, copies, adds, views), never an op that does a
    # family's work; judged by names, not by its time share, which rises with the machine's load.
    work = re.compile(r"mm|matmul|linear|softmax|topk|sort|logsumexp|dequant|silu|norm|rsqrt|attention|"
                      r"histc|bincount|scatter|gather|exp\b|log\b", re.IGNORECASE)
    assert not [name for name in out["ops"].get("other", []) if work.search(name.split(": ", 1)[1])]
    assert any("dequantize" in name for name in out["ops"]["expert_dequantisation"])
