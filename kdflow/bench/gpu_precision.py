"""The GPU check's logits-precision step: how far bf16 logits move what the teacher pass stores, against a
float32 lm_head on the same hidden states, and what `teacher.lm_head_float32` (the float32 head) costs in time.
Like the other steps (kdflow/bench/gpu_steps.py) it imports no Prefect."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CODEC_BUDGET_NATS = 1.3e-4  # the store codec's whole KL budget per position (issue 24): what rounding may cost


def logits_precision(teacher: Path, device: str, tokens: int, top_k: int = 128) -> dict[str, Any]:
    """How far bf16 logits move what the pass stores, against a float32 lm_head on the same hidden states:
    KL(float32 || bf16) per position over the full vocabulary, the top-K id sets' overlap and the tail mass.
    The teacher's weights are random, so its distributions are flatter than a trained one's: a lower bound of
    the reference's error, not its value."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.bfloat16).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 384, (max(1, tokens // 512), min(tokens, 512)), generator=generator).to(device)
    kl, overlap, tail_diff = [], [], []
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state.flatten(0, 1)
        weight = model.lm_head.weight
        weight_f32 = weight.float()  # once: what teacher.lm_head_float32 holds, also timed below
        for rows in hidden.split(2048):
            exact = torch.log_softmax(rows.float() @ weight_f32.T, dim=-1)
            rounded = torch.log_softmax((rows @ weight.T).float(), dim=-1)
            kl.append((exact.exp() * (exact - rounded)).sum(-1))
            top_exact, top_rounded = exact.topk(top_k).indices, rounded.topk(top_k).indices
            same = (top_exact.unsqueeze(-1) == top_rounded.unsqueeze(-2)).any(-1).float().mean(-1)
            overlap.append(same)
            kept_exact = exact.gather(-1, top_exact).exp().sum(-1)
            tail_diff.append((kept_exact - rounded.gather(-1, top_rounded).exp().sum(-1)).abs())
    kl_all, overlap_all, tail_all = torch.cat(kl), torch.cat(overlap), torch.cat(tail_diff)
    mean_kl = float(kl_all.mean())
    return {"positions": int(kl_all.numel()), "top_k": top_k, "kl_mean_nats": mean_kl,
            "kl_max_nats": float(kl_all.max()), "topk_id_overlap_mean": float(overlap_all.mean()),
            "topk_id_overlap_min": float(overlap_all.min()), "tail_mass_abs_diff_mean": float(tail_all.mean()),
            "codec_budget_nats": CODEC_BUDGET_NATS, "above_codec_budget": mean_kl > CODEC_BUDGET_NATS,
            "lm_head_float32": _float32_head_cost(hidden, weight, weight_f32, top_k),
            "recommend_lm_head_float32": mean_kl > CODEC_BUDGET_NATS}


def _float32_head_cost(hidden: Any, weight: Any, weight_f32: Any, top_k: int) -> dict[str, Any]:
    """The pass's chunked top-K on the same hidden states with the bf16 lm_head and with its float32 copy (what
    `teacher.lm_head_float32` does): seconds of each (after one warm-up), and how far the stored values move."""
    import time

    import torch

    from kdflow.tasks.teacher.topk import chunked_topk

    chunk = min(hidden.shape[0], 4096)
    results, seconds = {}, {}
    for name, head in (("bf16", weight), ("float32", weight_f32)):
        for _ in range(2):  # the first is a warm-up
            if hidden.is_cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            results[name] = chunked_topk(hidden, head, top_k, chunk, return_tail=True)
            if hidden.is_cuda:
                torch.cuda.synchronize()
            seconds[name] = time.perf_counter() - started
    (ids_a, values_a, tail_a), (ids_b, values_b, tail_b) = results["bf16"], results["float32"]
    return {"tokens": int(hidden.shape[0]), "chunk_tokens": chunk, "seconds": {k: round(v, 4) for k, v in
                                                                               seconds.items()},
            "float32_over_bf16_time": round(seconds["float32"] / seconds["bf16"], 3),
            "same_ids_share": float((ids_a == ids_b).float().mean()),
            "logprob_max_abs_diff": float((values_a - values_b).abs().max()),
            "tail_logprob_max_abs_diff": float((tail_a - tail_b).abs().max())}
