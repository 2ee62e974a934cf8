"""The teacher pass for sampled targets (`precompute.targets: sampled | hybrid`): what `precompute.py` calls
instead of the top-K step when the config asks for samples.

Per micro-batch: `TeacherSampledStep` (body hidden states, then the chunked sampler of
`kdflow.tasks.teacher.sampling`, seeded by (seed, shard, row, position)), one copy of its six fields to
the host (CUDA: a ring of pinned buffers and an event, like the top-K pass), and the encoding into a v2
shard (`kdflow.schemas.codec_sampled`, with the store's unigram renumbering table) in the writer thread.
"""

from __future__ import annotations

import queue
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from kdflow.schemas.codec_meta import Renumbering
from kdflow.schemas.codec_sampled import DecodedSampled, SampledCodec, encode_sampled
from kdflow.schemas.commits import StageComplete
from kdflow.schemas.config import PrecomputeConfig
from kdflow.schemas.shards import StreamShardWriter
from kdflow.schemas.stage_settings import TeacherPassSettings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.sampled import SampledTargets
from kdflow.tasks.teacher.sampled_step import TeacherSampledStep, sampled_head
from kdflow.tasks.teacher.sampling import SAMPLER_BYTES_PER_LOGIT, SamplingPlan
from kdflow.tasks.teacher.store_codec import renumbering_table
from kdflow.tasks.teacher.tiled_topk import TRITON_TILED
from kdflow.tasks.teacher.topk import choose_chunk_tokens

__all__ = ["SampledPass", "sampled_chunk_tokens", "sampled_codec", "sampled_step"]
_HOST_DTYPES = {"head_ids": torch.int32, "head_logprobs": torch.float32, "tail_logprob": torch.float32,
                "sample_ids": torch.int32, "sample_logprobs": torch.float32, "log_threshold": torch.float32}


def sampled_chunk_tokens(pre: PrecomputeConfig, vocab: int, head: str = "slab") -> int:
    """Rows per chunk: precompute.chunk_tokens, else ~3x fewer than the top-K pass takes in the same budget
    (the sampler in torch holds ~24 bytes per logit, the top-K pass ~8), or as many as the top-K pass where the
    Triton kernels read the logits (`head` tiled-triton or tiled-gemm: nothing but the logits per row)."""
    if pre.chunk_tokens:
        return pre.chunk_tokens
    per_logit = {} if head in TRITON_TILED else {"logits_dtype_bytes": SAMPLER_BYTES_PER_LOGIT}
    return choose_chunk_tokens(vocab, pre.chunk_memory_mib << 20, **per_logit)


def sampled_codec(pre: PrecomputeConfig, seq_len: int, vocab: int, table: Renumbering | None = None) -> SampledCodec:
    """The codec of this config's sampled store: H, S, scheme, seed, the head's values as precompute.store; `table`:
    the store's renumbering table (None: ids as they are, as `kdflow tune` times the pass without a store)."""
    plan = SamplingPlan.from_config(pre)
    store_settings, sampling = pre.store, pre.sampling
    codec = SampledCodec(seq_len, plan.head, plan.samples, vocab, scheme=plan.scheme, seed=plan.seed,
                         hash_version=plan.hash_version, head_values=store_settings.values,
                         levels=store_settings.levels, tail=store_settings.tail, sample_values=sampling.values,
                         zstd_level=store_settings.zstd_level, renumbering=table)
    codec.schema()  # built once (compresses the table), shared by every shard and the writer thread
    return codec


def sampled_step(model: torch.nn.Module, pre: PrecomputeConfig, vocab: int) -> TeacherSampledStep:
    """The teacher step of this config's sampled targets, as the pass builds it (for the store report)."""
    plan = SamplingPlan.from_config(pre)
    chunk_tokens = sampled_chunk_tokens(pre, vocab, sampled_head(model, plan, pre.head))
    return TeacherSampledStep(model, plan, chunk_tokens, head=pre.head)


class SampledPass:
    """Everything fixed for a pass of sampled targets: the step, the codec, the host buffers."""

    @classmethod
    def create(cls, settings: TeacherPassSettings, model: torch.nn.Module, run_root: RunRoot, store: str,
               tokens_done: StageComplete, vocab: int, slots: int) -> SampledPass:
        pre = settings.precompute
        table = renumbering_table(run_root, store, tokens_done, vocab) if pre.store.renumbering == "unigram" else None
        return cls(settings, model, sampled_codec(pre, settings.seq_len, vocab, table),
                   sampled_step(model, pre, vocab).chunk_tokens, slots)

    def __init__(self, settings: TeacherPassSettings, model: torch.nn.Module, codec: SampledCodec, chunk_tokens: int,
                 slots: int) -> None:
        self.codec, self.micro_batch, self.chunk_tokens = codec, settings.precompute.micro_batch, chunk_tokens
        self.step = TeacherSampledStep(model, SamplingPlan.from_config(settings.precompute), chunk_tokens,
                                       head=settings.precompute.head, compile_body=settings.precompute.compile_body)
        self.head = self.step.head  # slab, tiled, tiled-triton or tiled-gemm: each shard's commit records which ran
        self.device = next(model.parameters()).device
        self.free: queue.Queue[dict[str, torch.Tensor]] = queue.Queue()
        shapes = {"head_ids": (codec.head,), "head_logprobs": (codec.head,), "tail_logprob": (),
                  "sample_ids": (codec.samples,), "sample_logprobs": (codec.samples,), "log_threshold": ()}
        for _ in range(slots if self.device.type == "cuda" else 0):
            self.free.put({name: torch.empty((self.micro_batch, settings.seq_len, *shape), dtype=_HOST_DTYPES[name],
                                             pin_memory=True) for name, shape in shapes.items()})

    def writer(self, run_root: RunRoot, path: str) -> StreamShardWriter:
        return StreamShardWriter(run_root, path, self.codec.schema())

    def encode(self, *arrays: np.ndarray) -> Any:
        """The writer thread's half: host arrays (DecodedSampled order) -> one Arrow record per row."""
        return encode_sampled(self.codec, DecodedSampled(*arrays))

    def __call__(self, input_ids: torch.Tensor, rows: int, *, shard: int, first_row: int
                 ) -> tuple[Any, ...]:
        """input_ids (B, T) on the device, the first `rows` real -> (*host arrays, CUDA event or None, release)."""
        targets = self.step(input_ids, shard=shard, first_row=first_row)  # (B, T, ...) fields on the device
        device_fields = [getattr(targets, f.name)[:rows] for f in fields(SampledTargets)]
        if self.device.type != "cuda":
            return *(t.numpy() for t in device_fields), None, lambda: None
        slot = self.free.get()
        host = [slot[f.name][:rows] for f in fields(SampledTargets)]
        for target, source in zip(host, device_fields, strict=True):
            target.copy_(source, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return *(t.numpy() for t in host), event, lambda: self.free.put(slot)
