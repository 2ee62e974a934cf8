"""One top-K shard of the teacher pass (kdflow.tasks.teacher.precompute): device -> host -> Arrow, overlapped.

Per micro-batch of exactly `micro_batch` sequences (the last one of a shard is padded, so the batch shape on
the device never changes): the teacher step on the device, one copy to the host, and the encoding and write
handed to a background thread (kdflow.tasks.teacher.host_writer) so that it overlaps the next forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from kdflow.schemas.commits import CommitRecord, StageComplete, TopkShardInfo, stage_dir
from kdflow.schemas.disk_space import DiskFull
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.layout import data_file_name
from kdflow.schemas.shards import read_token_shard, topk_shard_writer, topk_v2_shard_writer
from kdflow.schemas.stage_settings import TeacherPassSettings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common import faults
from kdflow.tasks.teacher.body_variants import use_experts
from kdflow.tasks.teacher.host_writer import WRITE_QUEUE_DEPTH, BackgroundWriter, HostCopies
from kdflow.tasks.teacher.leases import ShardLeases
from kdflow.tasks.teacher.loading import output_rows, vocab_rows
from kdflow.tasks.teacher.sampled_pass import SampledPass
from kdflow.tasks.teacher.store_codec import store_codec
from kdflow.tasks.teacher.topk import topk_step


class ShardComputer:
    """Everything fixed for one pass: the teacher step, the store, the batch shape."""

    def __init__(self, settings: TeacherPassSettings, model: torch.nn.Module, run_root: RunRoot, store: str, tag: str,
                 info: TopkShardInfo, tokens_done: StageComplete) -> None:
        pre = settings.precompute
        self.settings, self.run_root, self.store, self.tag = settings, run_root, store, tag
        self.device = next(model.parameters()).device
        self.vocab_rows = vocab_rows(model)
        experts = use_experts(model, pre.experts)  # None: a dense teacher
        vocab = output_rows(model)
        try:
            self.sampled = None if pre.targets == "topk" else SampledPass.create(  # replaces step, codec, host copies
                settings, model, run_root, store, tokens_done, vocab, WRITE_QUEUE_DEPTH + 2)
            self.step = topk_step(model, pre, vocab) if self.sampled is None else self.sampled
        except NotImplementedError as error:
            raise ConfigError(f"teacher not supported: {error}") from None
        # vocab_size: the teacher's output rows; `kdflow validate` bounds top-K ids by it.
        # None: v1
        self.codec = store_codec(settings, run_root, store, tokens_done, vocab) if self.sampled is None else None
        coded = self.sampled.codec if self.sampled is not None else self.codec
        self.info = info.model_copy(update={"chunk_tokens": self.step.chunk_tokens, "vocab_size": vocab,
                                            "head": self.step.head, "experts": experts,
                                            "compiled_body": pre.compile_body} | (
            {} if coded is None else {"format": "v2", "codec": coded.settings()}))
        # v2 codes float32 log-probs (its own float16 option rounds them itself); v1 stores logprobs_dtype.
        storage = torch.float16 if self.codec is None and pre.logprobs_dtype == "float16" else torch.float32
        self.writer_busy_s = self.waited_for_writer_s = 0.0  # over every shard: see BackgroundWriter
        self.host = HostCopies(self.device, (pre.micro_batch, settings.seq_len, pre.top_k), storage,
                               0 if self.sampled else WRITE_QUEUE_DEPTH + 2)

    def compute(self, shard_id: int, token_record: CommitRecord, leases: ShardLeases,
                on_rows: Callable[[int, int], None] = lambda done, rows: None) -> CommitRecord:
        """One shard, written and returned as its commit record (not yet committed); `on_rows(done, rows)`
        after every micro-batch."""
        seq_len, pre = self.settings.seq_len, self.settings.precompute
        tokens_store = stage_dir(self.run_root, "tokens")
        # (rows, T)
        input_ids = read_token_shard(self.run_root, f"{tokens_store}/{token_record.data_file}", seq_len)
        if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= self.vocab_rows):
            raise StoreError(f"token shard {shard_id} holds id {int(input_ids.max())}, outside the teacher's "
                             f"embedding of {self.vocab_rows} rows")
        started = time.perf_counter()
        name = data_file_name("topk", shard_id)
        path = f"{self.store}/{name}"
        opened = (topk_shard_writer(self.run_root, path, seq_len, pre.top_k, pre.logprobs_dtype)
                  if self.codec is None else topk_v2_shard_writer(self.run_root, path, self.codec))
        try:
            with opened if self.sampled is None else self.sampled.writer(self.run_root, path) as writer:
                background = BackgroundWriter(writer, pre.logprobs_dtype, self.run_root, shard_id, self.codec,
                                              getattr(self.sampled, "encode", None))
                try:
                    for micro_batch, start in enumerate(range(0, len(input_ids), pre.micro_batch)):
                        self._micro_batch(input_ids[start:start + pre.micro_batch], background, shard_id, micro_batch)
                        leases.renew(shard_id)
                        on_rows(min(start + pre.micro_batch, len(input_ids)), len(input_ids))
                    background.drain()
                finally:
                    background.close()
                    self.writer_busy_s += background.busy_s
                    self.waited_for_writer_s += background.waited_s
        except DiskFull as error:  # v1 knows what the whole shard needs: ids and log-probs of every position
            itemsize = 2 if pre.logprobs_dtype == "float16" else 4
            whole = self.codec is None and self.sampled is None
            needed = input_ids.size * pre.top_k * (4 + itemsize) if whole else None
            raise error.needing(needed) from error.__cause__
        seconds = time.perf_counter() - started
        rows = len(input_ids)
        return CommitRecord(
            stage="topk", shard_id=shard_id, data_file=name, rows=rows, tokens=rows * seq_len,
            bytes=writer.sink.nbytes, sha256=writer.sink.sha256, input_sha256=token_record.sha256, fingerprint=self.tag,
            extra=self.info.model_copy(update={"seconds": round(seconds, 3),
                                               "tokens_per_s": round(rows * seq_len / max(seconds, 1e-9), 1)}),
        )

    def _micro_batch(self, batch: np.ndarray, background: BackgroundWriter, shard_id: int, micro_batch: int) -> None:
        rows = len(batch)  # (rows, T); padded to the fixed micro-batch so the device never sees a new shape
        padded = np.zeros((self.settings.precompute.micro_batch, batch.shape[1]), dtype=np.int64)
        padded[:rows] = batch
        input_ids = torch.from_numpy(padded).to(self.device, non_blocking=True)  # (B, T)
        outputs = self.step(input_ids) if self.sampled is None else ()  # (B, T, K), (B, T, K), (B, T) on the device
        if faults.active_faults():
            background.drain(flush=True)  # a `kill` fault must find the earlier micro-batches in the file
            faults.maybe_fire("micro_batch", self.run_root, stage="precompute", shard=shard_id, micro_batch=micro_batch,
                              micro_batch_size=len(padded))
        *host, ready, release = (self.host.copy(*(t[:rows] for t in outputs)) if self.sampled is None
                                 # sampled: seeded by row
                                 else self.sampled(input_ids, rows, shard=shard_id,
                                                   first_row=micro_batch * len(padded)))
        background.put(tuple(host), ready, release, micro_batch)
