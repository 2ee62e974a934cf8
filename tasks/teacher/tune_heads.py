"""Which head the teacher pass reads its logits with (`precompute.head`), measured on this machine: the tune
worker's `--heads` body (`kdflow tune precompute`).

The heads on one loaded teacher and the same rows at one micro-batch: `slab` (the slab loop: the logits of a chunk
of tokens, then torch's top-K or the sampler over every id), `tiled` (one read of the logits for each tile's
statistics, then only the candidate tiles; its Triton kernels on CUDA) and `tiled-gemm` (the tiles' statistics
made by the lm_head GEMM as it writes the logits: a Triton kernel, so timed only where it runs as itself, on
CUDA). Each is timed as the pass runs it (the step and its host copy, `tune_trial.pass_step`), and the
tiled heads' targets are compared with the slab loop's on the first micro-batch: log-probs as sorted values per
position (ties may order ids differently) and the tail. The recommendation is the fastest among those within
`HEAD_TOLERANCE` of the slab loop; where a tiled head cannot take this teacher (a final-logit transform, a
vocabulary split in slabs, kdflow.1 sampling) it runs the slab loop, and the record says so (`runs`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kdflow.schemas.stage_settings import TeacherPassSettings
from kdflow.schemas.storage import RunRoot

__all__ = ["HEADS", "HEAD_TOLERANCE", "agreement", "choose_head", "head_targets", "measure_heads",
           "sampled_fields"]

HEADS = ("slab", "tiled", "tiled-gemm")
HEAD_TOLERANCE = 1e-3  # nats: the log-probs and tail of two heads reading the same logits (float32 sums' order)


def sampled_fields(targets: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Sampled or hybrid targets as (ids, log-probs, tail) like the top-K's: head and samples side by side."""
    ids = torch.cat([targets.head_ids, targets.sample_ids], -1)
    return ids, torch.cat([targets.head_logprobs, targets.sample_logprobs], -1), targets.tail_logprob


def agreement(reference: tuple[Tensor, ...], result: tuple[Tensor, ...]) -> dict[str, float]:
    """How far (ids (N, K), log-probs (N, K), tail (N,)) are from the reference's: log-probs compared as sorted
    values per row, since ties may order ids differently; the share of ids that agree, as sorted ids per row."""
    ref_ids, ref_lp, ref_tail = (tensor.reshape(-1, *tensor.shape[-1:]).cpu() if tensor.dim() > 1
                                 else tensor.cpu() for tensor in reference)
    ids, lp, tail = (tensor.reshape(-1, *tensor.shape[-1:]).cpu() if tensor.dim() > 1 else tensor.cpu()
                     for tensor in result)
    same = (ref_ids.sort(-1).values == ids.sort(-1).values).float().mean().item()
    ref_lp, lp = ref_lp.float().sort(-1).values, lp.float().sort(-1).values
    finite = torch.isfinite(ref_lp) & torch.isfinite(lp)
    return {"max_logprob_diff": float((ref_lp - lp)[finite].abs().max()) if bool(finite.any()) else 0.0,
            "max_tail_diff": float((ref_tail.float() - tail.float()).abs().max()), "ids_agree": round(same, 6)}


def head_targets(settings: TeacherPassSettings, model: torch.nn.Module, vocab: int,
                 input_ids: Tensor) -> tuple[str, tuple[Tensor, Tensor, Tensor]]:
    """One micro-batch's targets under the settings' head -> (what ran: slab, tiled, tiled-triton or tiled-gemm, (ids,
    log-probs, tail) with a position per row, on the host)."""
    from kdflow.tasks.teacher.sampled_pass import sampled_step
    from kdflow.tasks.teacher.topk import TeacherTopkStep, topk_chunk_tokens

    pre = settings.precompute
    with torch.inference_mode():
        if pre.targets == "topk":
            chunk = topk_chunk_tokens(pre, vocab)
            step = TeacherTopkStep(model, pre.top_k, chunk, head=pre.head)
            ids, logprobs, tail = step(input_ids)
            ran = step.head
        else:
            sampler = sampled_step(model, pre, vocab)
            ids, logprobs, tail = sampled_fields(sampler(input_ids, shard=0, first_row=0))
            ran = sampler.head
    return ran, (ids.flatten(0, 1).cpu(), logprobs.flatten(0, 1).cpu(), tail.flatten().cpu())


def measure_heads(run_root: RunRoot, settings: TeacherPassSettings, micro_batch: int, batches: int,
                  warmup: int = 1, tolerance: float = HEAD_TOLERANCE, random_weights: bool = False) -> dict[str, Any]:
    """Both heads timed at `micro_batch` on the run's rows, the tiled one checked against the slab loop ->
    {"micro_batch", "heads": one record per head, "tolerance", "recommended_head"}."""
    from kdflow.tasks.teacher.loading import output_rows
    from kdflow.tasks.teacher.tune_trial import check_counts, load_for_trial, pass_step, time_micro_batches

    check_counts(micro_batch, batches, warmup)
    trial = load_for_trial(run_root, settings, (warmup + batches) * micro_batch, random_weights=random_weights)
    model, ids, device = trial.model, trial.ids, trial.device
    vocab = output_rows(model)
    first = torch.from_numpy(ids[:micro_batch].astype(np.int64)).to(device)
    records, reference = [], None
    for head in HEADS:
        candidate = dataclasses.replace(settings, precompute=settings.precompute.model_copy(update={"head": head}))
        ran, targets = head_targets(candidate, model, vocab, first)
        if head == "tiled-gemm" and ran != head:  # the GEMM's fallback is the tiled head, timed already
            records.append({"head": head, "runs": ran, "skipped": f"runs as {ran} here: the GEMM is a Triton kernel "
                                                                  "on CUDA"})
            continue
        step, _ = pass_step(candidate, model, vocab, micro_batch, device)
        seconds = time_micro_batches(step, ids, micro_batch, warmup, batches, device, run_root)
        record = {"head": head, "runs": ran, "tokens_per_s": round(batches * ids.shape[1] * micro_batch / seconds, 1)}
        if reference is None:
            reference = targets
        else:
            record |= agreement(reference, targets)
            record["correct"] = max(record["max_logprob_diff"], record["max_tail_diff"]) <= tolerance
        records.append(record)
        del step  # its buffers go before the next head's are made: the micro-batch was tuned to the memory
    return {"micro_batch": micro_batch, "targets": settings.precompute.targets, "heads": records,
            "tolerance": tolerance, "recommended_head": choose_head(records)}


def choose_head(records: list[dict[str, Any]]) -> str:
    """The fastest head whose targets matched the slab loop's; a head that fell back to another on this teacher
    (`runs`: slab for a tiled head, tiled for tiled-gemm) is not a choice of its own."""
    fitting = [r for r in records if "tokens_per_s" in r and r.get("correct", True) and r["runs"].startswith(r["head"])]
    return max(fitting, key=lambda r: r["tokens_per_s"])["head"]
