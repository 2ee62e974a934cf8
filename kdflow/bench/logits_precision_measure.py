"""How far 16-bit logits move what the teacher pass stores, against float32 logits on the same hidden states, and
what `teacher.lm_head_float32` (`Float32Logits`: the same matmul with float32 output) costs in time. Used by the GPU
check's logits-precision step (random teachers at the reference shapes) and by `kdflow bench logits-precision`
(the demo's trained teacher on real text). Like the GPU check's other steps it imports no Prefect."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CODEC_BUDGET_NATS = 1.3e-4  # the store codec's whole KL budget per position (schemas/codec.py): what rounding may cost


def logits_precision(teacher: Path, device: str, tokens: int, top_k: int = 128, input_ids: Any = None,
                     dtype: str = "bfloat16") -> dict[str, Any]:
    """The teacher at `teacher` loaded in `dtype` on `device`; its hidden states for `input_ids` (B, T), or for
    random ids of the first 384 (`tokens` of them, rows of 512), measured by `precision`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=getattr(torch, dtype)).to(device).eval()
    if input_ids is None:
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, 384, (max(1, tokens // 512), min(tokens, 512)), generator=generator)
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids.to(device)).last_hidden_state.flatten(0, 1)
    return precision(hidden, model.lm_head, top_k)


def precision(hidden: Any, head: Any, top_k: int = 128) -> dict[str, Any]:
    """16-bit logits against float32 ones on the same 16-bit hidden states (N, H) and head (a 16-bit nn.Linear):
    KL(float32 || 16-bit) per position over the whole vocabulary, the top-K id sets' overlap, the tail mass, and
    the KL of float32 logits merely rounded to 16 bits (the same as the first where rounding the output is the
    whole error, which is then the same on any device). A random teacher's flat distributions give a lower bound
    of a trained one's error, not its value."""
    import torch

    kl, rounding_kl, overlap, tail_diff = [], [], [], []
    with torch.no_grad():
        weight = head.weight
        weight_f32 = weight.float()  # the exact reference (an upcast copy: bf16 values are float32 values)
        for rows in hidden.split(2048):
            exact_logits = rows.float() @ weight_f32.T
            exact = torch.log_softmax(exact_logits, dim=-1)
            rounded = torch.log_softmax((rows @ weight.T).float(), dim=-1)
            only_rounded = torch.log_softmax(exact_logits.to(weight.dtype).float(), dim=-1)
            kl.append((exact.exp() * (exact - rounded)).sum(-1, dtype=torch.float64))  # a sum of V tiny terms
            rounding_kl.append((exact.exp() * (exact - only_rounded)).sum(-1, dtype=torch.float64))
            top_exact, top_rounded = exact.topk(top_k).indices, rounded.topk(top_k).indices
            overlap.append(_set_overlap(top_exact, top_rounded))
            kept_exact = exact.gather(-1, top_exact).exp().sum(-1)
            tail_diff.append((kept_exact - rounded.gather(-1, top_rounded).exp().sum(-1)).abs())
    kl_all, overlap_all, tail_all = torch.cat(kl), torch.cat(overlap), torch.cat(tail_diff)
    mean_kl = float(kl_all.mean())
    return {"positions": int(kl_all.numel()), "vocab": int(weight.shape[0]), "top_k": top_k,
            "logits_dtype": str(weight.dtype).removeprefix("torch."), "kl_mean_nats": mean_kl,
            "kl_median_nats": float(kl_all.median()), "kl_p99_nats": float(kl_all.quantile(0.99)),
            "kl_max_nats": float(kl_all.max()), "rounding_only_kl_mean_nats": float(torch.cat(rounding_kl).mean()),
            "topk_id_overlap_mean": float(overlap_all.mean()), "topk_id_overlap_min": float(overlap_all.min()),
            "tail_mass_abs_diff_mean": float(tail_all.mean()), "codec_budget_nats": CODEC_BUDGET_NATS,
            "above_codec_budget": mean_kl > CODEC_BUDGET_NATS,
            "lm_head_float32": _float32_head_cost(hidden, head, weight_f32, top_k),
            "recommend_lm_head_float32": mean_kl > CODEC_BUDGET_NATS}


def _set_overlap(a: Any, b: Any) -> Any:
    """The share of each row's ids in `a` (N, K) that are also among its ids in `b` (N, K)."""
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).float().mean(-1)


def _float32_head_cost(hidden: Any, head: Any, weight_f32: Any, top_k: int) -> dict[str, Any]:
    """The pass's chunked top-K on the same hidden states with the 16-bit head as is and wrapped in
    `Float32Logits` (what `teacher.lm_head_float32` does): seconds of each (after one warm-up), how far the
    stored values move between them, and how far the float32 path is from the exact top-K (an upcast copy)."""
    import time

    import torch

    from kdflow.tasks.common.float32_logits import Float32Logits, float32_output_matmul
    from kdflow.tasks.teacher.topk import chunked_topk

    chunk = min(hidden.shape[0], 4096)
    results, seconds = {}, {}
    for name, lm_head in (("bf16", head), ("float32", Float32Logits(head)), ("exact", weight_f32)):
        for _ in range(2 if name != "exact" else 1):  # the first is a warm-up
            if hidden.is_cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            results[name] = chunked_topk(hidden, lm_head, top_k, chunk, return_tail=True)
            if hidden.is_cuda:
                torch.cuda.synchronize()
            seconds[name] = time.perf_counter() - started
    (ids_a, values_a, tail_a), (ids_b, values_b, tail_b) = results["bf16"], results["float32"]
    ids_x, values_x, tail_x = results["exact"]
    return {"tokens": int(hidden.shape[0]), "chunk_tokens": chunk,
            "float32_output_matmul": float32_output_matmul(hidden.device),
            "seconds": {k: round(seconds[k], 4) for k in ("bf16", "float32")},
            "float32_over_bf16_time": round(seconds["float32"] / seconds["bf16"], 3),
            "id_overlap_mean": float(_set_overlap(ids_a, ids_b).mean()),
            "logprob_max_abs_diff": float((values_a - values_b).abs().max()),
            "logprob_mean_abs_diff": float((values_a - values_b).abs().mean()),
            "tail_logprob_max_abs_diff": float((tail_a - tail_b).abs().max()),
            "float32_vs_exact_logprob_max_abs_diff": float((values_b - values_x).abs().max()),
            "float32_vs_exact_tail_max_abs_diff": float((tail_b - tail_x).abs().max()),
            "float32_vs_exact_id_overlap_mean": float(_set_overlap(ids_b, ids_x).mean())}
