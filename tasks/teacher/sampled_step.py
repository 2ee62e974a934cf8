"""One micro-batch of sampled targets through the teacher: its body, then its head by the slab loop's sampler
(`kdflow.tasks.teacher.sampling`) or, with `precompute.head: tiled`, the tiled sampler
(`kdflow.tasks.teacher.sampled_tiles`; its Triton kernels on CUDA; with `tiled-gemm` its tile statistics made by
the lm_head GEMM, `kdflow.tasks.teacher.head_gemm`), which needs a plain lm_head weight, the whole
vocabulary at once, no final-logit transform and kdflow.2 noise. Both draw the same targets from the same logits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kdflow.tasks.common.models import final_logit_transform, output_layer
from kdflow.tasks.common.sampled import SampledTargets, cat_targets
from kdflow.tasks.teacher.fused_moe import teacher_body_runner
from kdflow.tasks.teacher.gemm_tiles import GemmTiles
from kdflow.tasks.teacher.head_gemm import head_gemm_sample_stats
from kdflow.tasks.teacher.sampled_tiles import TORCH_KERNELS, SampleKernels, tiled_sample
from kdflow.tasks.teacher.sampling import SamplingPlan, chunked_sampled
from kdflow.tasks.teacher.sampling_noise import position_streams, stream_words
from kdflow.tasks.teacher.tiled_topk import (TILED_HEADS, TRITON_TILED, check_tiled_variant, float32_head,
                                             logit_blocks, logit_buffers, tiled_head_fits, tiled_variant)

__all__ = ["TeacherSampledStep", "sample_kernels", "sampled_head", "tiled_head_sample"]


def sampled_head(model: nn.Module, plan: SamplingPlan, head: str, vocab_chunk: int | None = None) -> str:
    """What reads this teacher's logits for `precompute.head`: "slab", or what a tiled head runs
    (`tiled_topk.tiled_variant`: tiled, tiled-triton, tiled-gemm) where the tiled sampler fits (a plain lm_head, the
    whole vocabulary, no final-logit transform, kdflow.2)."""
    fits = tiled_head_fits(output_layer(model), final_logit_transform(model.config), vocab_chunk)
    tiled = head in TILED_HEADS and plan.hash_version == "kdflow.2" and fits
    return tiled_variant(next(model.parameters()).device, head) if tiled else "slab"


def sample_kernels(variant: str) -> SampleKernels:
    """The tiled sampler's kernels for a head variant: Triton's for "tiled-triton" and "tiled-gemm" (whose GEMM
    makes the statistics; the picked tiles' keys are still the kernel's), torch's otherwise."""
    if variant in TRITON_TILED:
        from kdflow.tasks.teacher.sample_tile_kernel import TRITON_KERNELS

        return TRITON_KERNELS
    return TORCH_KERNELS


def tiled_head_sample(hidden: Tensor, weight: Tensor, plan: SamplingPlan, chunk_tokens: int, *, shard: int,
                      rows: Tensor, positions: Tensor, tile: int = 128, variant: str = "tiled",
                      float32: bool = False, gemm_tiling: GemmTiles | None = None) -> SampledTargets:
    """`chunked_sampled`'s contract for a plain lm_head weight (V, H), no final-logit transform and kdflow.2 noise:
    `tiled_sample` over each block of `tiled_topk.logit_blocks` (`variant` tiled or tiled-triton), or of the
    logits and tile statistics the Triton GEMM writes (tiled-gemm; `gemm_tiling`: its `GemmTiles`, default the
    device's)."""
    check_tiled_variant(variant)
    kernels, parts = sample_kernels(variant), []
    with torch.inference_mode():
        blocks = logit_buffers if variant == "tiled-gemm" else logit_blocks
        for start, stop, logits in blocks(hidden, weight, chunk_tokens, float32):
            streams = position_streams(plan.seed, shard, rows[start:stop], positions[start:stop])
            stats = None
            if variant == "tiled-gemm":
                stats = head_gemm_sample_stats(hidden[start:stop].to(weight.dtype), weight, logits,
                                               stream_words(streams), plan.scheme, tile, gemm_tiling)
            parts.append(tiled_sample(logits, plan, streams, tile, kernels, stats))
    return cat_targets(parts)


class TeacherSampledStep:
    """One micro-batch through the teacher: body hidden states, then chunked sampled targets with the model's
    own final-logit transform. Results stay on the model's device. `head`: "slab", "tiled" or "tiled-gemm" (taken
    where it fits, see the module's docstring; `self.head` says which runs: slab, tiled, tiled-triton or tiled-gemm)."""

    def __init__(self, model: nn.Module, plan: SamplingPlan, chunk_tokens: int, *,
                 vocab_chunk: int | None = None, head: str = "slab", compile_body: bool = False) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.model, self.plan, self.chunk_tokens, self.vocab_chunk = model, plan, chunk_tokens, vocab_chunk
        self.body = teacher_body_runner(model, compile_body)  # compile_body: torch.compile at the fixed shape
        self.lm_head = output_layer(model)
        self.logit_transform = final_logit_transform(model.config)
        vocab_size = getattr(self.lm_head, "out_features", None)
        if isinstance(vocab_size, int):
            plan.check(vocab_size)
        self.head = sampled_head(model, plan, head, vocab_chunk)

    def __call__(self, input_ids: Tensor, *, shard: int, first_row: int,
                 attention_mask: Tensor | None = None) -> SampledTargets:
        """input_ids (B, T), rows first_row.. of shard `shard` -> SampledTargets with (B, T, ...) fields."""
        batch, seq_len = input_ids.shape
        hidden = self.body(input_ids, attention_mask)  # (B, T, D)
        device = hidden.device
        rows = (torch.arange(batch, device=device) + first_row).repeat_interleave(seq_len)  # (B * T,)
        positions = torch.arange(seq_len, device=device).repeat(batch)  # (B * T,)
        if self.head != "slab":
            flat = tiled_head_sample(hidden.flatten(0, 1), self.lm_head.weight, self.plan, self.chunk_tokens,
                                     shard=shard, rows=rows, positions=positions, variant=self.head,
                                     float32=float32_head(self.lm_head))
        else:
            flat = chunked_sampled(hidden.flatten(0, 1), self.lm_head, self.plan, self.chunk_tokens, shard=shard,
                                   rows=rows, positions=positions, vocab_chunk=self.vocab_chunk,
                                   logit_transform=self.logit_transform)
        return flat.map(lambda t: t.view(batch, seq_len, *t.shape[1:]))
