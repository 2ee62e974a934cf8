"""The teacher pass: every token shard -> an aligned top-K shard in topk/TAG/ (no Prefect here).

Per micro-batch of exactly `micro_batch` sequences (the last one of a shard is padded, so the batch shape
on the device never changes): hidden states from the model body, top-K and the full-vocabulary
log-sum-exp chunk by chunk (`kdflow.tasks.teacher.topk`), one copy to the host, and the encoding and Arrow
write (v2: `kdflow.schemas.codec`, with the exact tail; v1: raw columns) handed to a background thread so that
it overlaps the next forward. Each shard is committed (data file, then its
commit record) and a rerun skips committed shards. Before computing a shard a process takes a lease file,
so that two processes on one run root do not compute the same shard; a lost race would still be harmless.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kdflow.schemas.codec import TopkCodec
from kdflow.schemas.commits import (CommitRecord, StageComplete, TopkCompleteInfo, TopkShardInfo, check_commit,
                                    check_commits, commit_or_remove, list_commits, read_complete, stage_dir,
                                    write_complete)
from kdflow.schemas.config import KDFlowConfig, dump_config
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.fingerprints import corpus_fingerprint, tokenizer_fingerprint, tokens_fingerprint, topk_fingerprint
from kdflow.schemas.layout import CONFIG_FILE, data_file_name, temp_prefix
from kdflow.schemas.shards import read_token_shard, topk_shard_writer, topk_v2_shard_writer
from kdflow.schemas.storage import DiskFull, RunRoot, remove_stale_temp_files
from kdflow.schemas.stores import TopkStoreInfo, format_mismatch, read_store_info, store_format, teacher_section, write_store_info
from kdflow.tasks.common import faults
from kdflow.tasks.common.model_configs import tokenizer_mismatch
from kdflow.tasks.common.models import output_layer, resolve_device, teacher_fingerprint, teacher_identity
from kdflow.tasks.common.progress import Progress
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.teacher.host_writer import WRITE_QUEUE_DEPTH, BackgroundWriter, HostCopies
from kdflow.tasks.teacher.leases import ShardLeases
from kdflow.tasks.teacher.loading import (check_store_tokenizer, check_teacher_limits, check_tokenizer_fits,
                                          load_teacher, load_teacher_config, vocab_rows)
from kdflow.tasks.teacher.sampled_pass import SampledPass, check_sampling_fits
from kdflow.tasks.teacher.store_codec import store_codec
from kdflow.tasks.teacher.store_report import pass_fidelity
from kdflow.tasks.teacher.topk import TeacherTopkStep, choose_chunk_tokens

logger = logging.getLogger("kdflow.precompute")


# --- one shard: device -> host -> Arrow, overlapped (kdflow.tasks.teacher.host_writer) -------------------


class ShardComputer:
    """Everything fixed for one pass: the teacher step, the store, the batch shape."""

    def __init__(self, cfg: KDFlowConfig, model: torch.nn.Module, run_root: RunRoot, store: str, tag: str,
                 info: TopkShardInfo, tokens_done: StageComplete) -> None:
        pre = cfg.precompute
        self.cfg, self.run_root, self.store, self.tag = cfg, run_root, store, tag
        self.device = next(model.parameters()).device
        self.vocab_rows = vocab_rows(model)
        vocab = getattr(output_layer(model), "out_features", None) or self.vocab_rows
        chunk_tokens = pre.chunk_tokens or choose_chunk_tokens(vocab, pre.chunk_memory_mib << 20)
        try:
            self.sampled = None if pre.targets == "topk" else SampledPass.create(  # replaces step, codec, host copies
                cfg, model, run_root, store, tokens_done, int(vocab), WRITE_QUEUE_DEPTH + 2)
            self.step = TeacherTopkStep(model, pre.top_k, chunk_tokens) if self.sampled is None else self.sampled
        except NotImplementedError as error:
            raise ConfigError(f"teacher not supported: {error}") from None
        # vocab_size: the teacher's output rows; `kdflow validate` bounds top-K ids by it.
        self.codec = store_codec(cfg, run_root, store, tokens_done, int(vocab)) if self.sampled is None else None  # None: v1
        coded = self.sampled.codec if self.sampled is not None else self.codec
        self.info = info.model_copy(update={"chunk_tokens": self.step.chunk_tokens, "vocab_size": int(vocab)} | (
            {} if coded is None else {"format": "v2", "codec": coded.settings()}))
        # v2 codes float32 log-probs (its own float16 option rounds them itself); v1 stores logprobs_dtype.
        storage = torch.float16 if self.codec is None and pre.logprobs_dtype == "float16" else torch.float32
        self.host = HostCopies(self.device, (pre.micro_batch, cfg.seq_len, pre.top_k), storage, 0 if self.sampled else WRITE_QUEUE_DEPTH + 2)

    def compute(self, shard_id: int, token_record: CommitRecord, leases: ShardLeases,
                on_rows: Callable[[int, int], None] = lambda done, rows: None) -> CommitRecord:
        """One shard, written and returned as its commit record (not yet committed); `on_rows(done, rows)`
        after every micro-batch."""
        cfg, pre = self.cfg, self.cfg.precompute
        tokens_store = stage_dir(self.run_root, "tokens")
        input_ids = read_token_shard(self.run_root, f"{tokens_store}/{token_record.data_file}", cfg.seq_len)  # (rows, T)
        if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= self.vocab_rows):
            raise StoreError(f"token shard {shard_id} holds id {int(input_ids.max())}, outside the teacher's "
                             f"embedding of {self.vocab_rows} rows")
        started = time.perf_counter()
        name = data_file_name("topk", shard_id)
        path = f"{self.store}/{name}"
        opened = (topk_shard_writer(self.run_root, path, cfg.seq_len, pre.top_k, pre.logprobs_dtype) if self.codec is None
                  else topk_v2_shard_writer(self.run_root, path, self.codec))
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
        except DiskFull as error:  # v1 knows what the whole shard needs: ids and log-probs of every position
            itemsize = 2 if pre.logprobs_dtype == "float16" else 4
            needed = input_ids.size * pre.top_k * (4 + itemsize) if self.codec is None and self.sampled is None else None
            raise error.needing(needed) from error.__cause__
        seconds = time.perf_counter() - started
        rows = len(input_ids)
        return CommitRecord(
            stage="topk", shard_id=shard_id, data_file=name, rows=rows, tokens=rows * cfg.seq_len, bytes=writer.sink.nbytes,
            sha256=writer.sink.sha256, input_sha256=token_record.sha256, fingerprint=self.tag,
            extra=self.info.model_copy(update={"seconds": round(seconds, 3),
                                               "tokens_per_s": round(rows * cfg.seq_len / max(seconds, 1e-9), 1)}),
        )

    def _micro_batch(self, batch: np.ndarray, background: BackgroundWriter, shard_id: int, micro_batch: int) -> None:
        rows = len(batch)  # (rows, T); padded to the fixed micro-batch so the device never sees a new shape
        padded = np.zeros((self.cfg.precompute.micro_batch, batch.shape[1]), dtype=np.int64)
        padded[:rows] = batch
        input_ids = torch.from_numpy(padded).to(self.device, non_blocking=True)  # (B, T)
        outputs = self.step(input_ids) if self.sampled is None else ()  # (B, T, K), (B, T, K), (B, T) on the device
        if faults.active_faults():
            background.drain(flush=True)  # a `kill` fault must find the earlier micro-batches in the file
            faults.maybe_fire("micro_batch", self.run_root, stage="precompute", shard=shard_id, micro_batch=micro_batch)
        *host, ready, release = (self.host.copy(*(t[:rows] for t in outputs)) if self.sampled is None  # sampled: seeded by row
                                 else self.sampled(input_ids, rows, shard=shard_id, first_row=micro_batch * len(padded)))
        background.put(tuple(host), ready, release, micro_batch)


# --- the pass ---------------------------------------------------------------------------------------------


def _token_store(run_root: RunRoot, cfg: KDFlowConfig, tokenizer_fp: str) -> tuple[str, StageComplete]:
    store = stage_dir(run_root, "tokens")
    done = read_complete(run_root, store)
    if done is None:
        raise StoreError(f"token store {run_root.display(store)} is not complete; run tokenise first")
    check_store_tokenizer(done.extra.tokenizer_fingerprint, tokenizer_fp, run_root.display(store))
    expected = tokens_fingerprint(corpus_fingerprint(cfg), tokenizer_fp, cfg)
    if done.fingerprint != expected:
        raise StoreError(f"token store {run_root.display(store)} was made from other inputs (fingerprint {done.fingerprint}, "
                         f"this config gives {expected}); run tokenise first")
    return store, done


def _requested(shard_ids: list[int] | None, count: int) -> list[int]:
    if shard_ids is None:
        return list(range(count))
    outside = [i for i in shard_ids if not 0 <= i < count]
    if outside:
        raise ConfigError(f"shard {outside[0]} does not exist: the token store has shards 0-{count - 1}")
    return sorted(set(shard_ids))


def _stale_temp_files(run_root: RunRoot, store: str, shard_id: int) -> None:
    """Remove temp files a killed writer left for this shard (RunRoot.atomic_writer's `.NAME.tmp-*`), whoever
    wrote them: the caller holds the shard's lease, so no live writer fills them."""
    if run_root.is_local:
        prefix = temp_prefix(data_file_name('topk', shard_id))
        for name in run_root.listdir(store):
            if name.startswith(prefix):
                run_root.remove(f"{store}/{name}")


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Deterministic kernels for the pass (warn-only where an op has none), restored afterwards."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@dataclass
class PassPlan:
    """What a pass was asked for and what is left, worked out before any weights load."""

    run_root: RunRoot
    device: torch.device
    tokenizer: Any
    tokens_store: str
    tokens_done: StageComplete
    wanted: list[int]
    teacher_fp: str
    tag: str
    store: str
    todo: list[int]


def plan_pass(cfg: KDFlowConfig, shard_ids: list[int] | None, device: torch.device) -> PassPlan:
    """The cheap checks first (teacher config, tokenizer, token store), then the shards still to compute."""
    run_root = RunRoot(cfg.run_root)
    check_teacher_limits(teacher_config := load_teacher_config(cfg.teacher), top_k=cfg.precompute.top_k, seq_len=cfg.seq_len)
    check_sampling_fits(cfg.precompute, teacher_config)
    mismatch = tokenizer_mismatch(cfg.tokenizer, cfg.teacher)  # ids of another vocabulary would be silent garbage
    if mismatch is not None:
        raise ConfigError(mismatch)
    tokenizer = load_tokenizer(cfg)
    tokens_store, tokens_done = _token_store(run_root, cfg, tokenizer_fingerprint(tokenizer))
    wanted = _requested(shard_ids, tokens_done.shards)
    teacher_fp = teacher_fingerprint(cfg.teacher, device=device)
    tag = topk_fingerprint(teacher_fp, tokens_done.fingerprint, cfg)
    store = stage_dir(run_root, "topk", tag)
    existing = read_store_info(run_root, store)
    mismatch = format_mismatch(existing, cfg, run_root.display(store)) if existing is not None else None
    if mismatch is not None:  # the tag names the format, so only a damaged or foreign _store.json gets here
        raise StoreError(mismatch)
    committed = list_commits(run_root, store, "topk", tag)  # one listing, not a request per shard
    todo = [i for i in wanted if i not in committed]
    return PassPlan(run_root, device, tokenizer, tokens_store, tokens_done, wanted, teacher_fp, tag, store, todo)


def precompute_shards(
    cfg: KDFlowConfig,
    shard_ids: list[int] | None = None,
    *,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    device: torch.device | str | None = None,
    model: torch.nn.Module | None = None,
    wait_for_others: bool = True,
) -> dict[str, Any]:
    """Compute and commit the top-K shards of `shard_ids` (default: all) that are not committed yet.

    `model`: an already loaded teacher (else loaded here, only if there is work). With `wait_for_others`,
    shards leased by another live process are waited for (taken over if their lease expires).
    """
    started = time.perf_counter()
    target = next(model.parameters()).device if model is not None else resolve_device(str(device or cfg.teacher.device))
    plan = plan_pass(cfg, shard_ids, target)
    run_root, store, tag = plan.run_root, plan.store, plan.tag
    written, tokens_written, compute_seconds, leased_elsewhere, fidelity = 0, 0, 0.0, [], None
    if not plan.todo:
        logger.info("precompute: %d/%d shards already committed in %s, nothing to do", len(plan.wanted), len(plan.wanted),
                    run_root.display(store))
    else:
        logger.info("precompute: loading the teacher for %d shards (%d of %d already committed)", len(plan.todo),
                    len(plan.wanted) - len(plan.todo), len(plan.wanted))
        if on_progress is not None:  # seen before the weights load, which takes minutes for a large teacher
            on_progress({"stage": "precompute", "phase": "loading the teacher", "tag": tag, "done": 0, "tokens": 0,
                         "total": len(plan.todo), "skipped": len(plan.wanted) - len(plan.todo)})
        token_checks = check_commits(run_root, plan.tokens_store, "tokens", plan.tokens_done.fingerprint)
        token_records = {i: _valid_token_record(run_root, plan.tokens_store, i, token_checks) for i in plan.todo}
        run_root.ensure_writable()
        model = model if model is not None else load_teacher(cfg.teacher, device=target)
        check_tokenizer_fits(plan.tokenizer, model)
        info = TopkShardInfo(teacher_fingerprint=plan.teacher_fp, tokens_fingerprint=plan.tokens_done.fingerprint,
                             top_k=cfg.precompute.top_k, seq_len=cfg.seq_len, logprobs_dtype=cfg.precompute.logprobs_dtype,
                             micro_batch=cfg.precompute.micro_batch)
        computer = ShardComputer(cfg, model, run_root, store, tag, info, plan.tokens_done)
        remove_stale_temp_files(run_root, store)  # what killed writers left (live writers' files are kept)
        _write_store_files(cfg, plan, computer.codec if computer.sampled is None else computer.sampled.codec)
        leases = ShardLeases(run_root, store, cfg.precompute.lease_ttl_s)
        progress = Progress("precompute", len(plan.todo), unit="shard", on_update=on_progress,
                            context={"tag": tag, "skipped": len(plan.wanted) - len(plan.todo)})
        progress.start()
        try:
            with deterministic_algorithms():
                written, tokens_written, compute_seconds, leased_elsewhere = _run(
                    computer, leases, plan.todo, token_records, progress, wait_for_others)
        finally:
            progress.close()
        if written and cfg.precompute.report_rows:  # the store report's KL, while the teacher is loaded
            fidelity = pass_fidelity(computer.step, run_root, tag, plan.todo, cfg.precompute.report_rows,
                                     cfg.precompute.micro_batch)
    complete_if_done(run_root, store, tag, plan.tokens_done)
    in_store = list_commits(run_root, store, "topk", tag)
    committed = [in_store[i] for i in plan.wanted if i in in_store]
    return {
        "tag": tag, "store": run_root.display(store), "shards": len(plan.wanted), "written": written,
        "skipped": len(plan.wanted) - len(plan.todo), "leased_elsewhere": leased_elsewhere, "committed": len(committed),
        "tokens": sum(r.tokens for r in committed), "seconds": round(time.perf_counter() - started, 3),
        "tokens_per_s": round(tokens_written / max(compute_seconds, 1e-9), 1), "peak_device_memory_mib": _peak_device_memory_mib(target),
        "teacher_fingerprint": plan.teacher_fp, "device": str(target), "complete": read_complete(run_root, store) is not None,
        "fidelity": fidelity,
    }


def _valid_token_record(run_root: RunRoot, store: str, shard_id: int,
                        checks: dict[int, tuple[CommitRecord | None, str]]) -> CommitRecord:
    record, reason = checks.get(shard_id, (None, "no commit record"))
    if record is None:
        raise StoreError(f"token shard {shard_id} in {run_root.display(store)} is not committed ({reason}); run tokenise again")
    return record


def _run(computer: ShardComputer, leases: ShardLeases, todo: list[int], token_records: dict[int, CommitRecord],
         progress: Progress, wait_for_others: bool) -> tuple[int, int, float, list[int]]:
    """Compute every shard in `todo`; -> (shards written, their tokens, seconds computing, shards leased elsewhere)."""
    run_root, store, tag = computer.run_root, computer.store, computer.tag
    written, tokens, seconds, pending = 0, 0, 0.0, list(todo)
    while pending:
        waiting = []
        for shard_id in pending:
            if check_commit(run_root, store, "topk", shard_id, tag)[0] is not None:
                progress.update(1, 0)  # another process committed it meanwhile
                continue
            if not leases.acquire(shard_id):
                waiting.append(shard_id)
                continue
            try:
                if check_commit(run_root, store, "topk", shard_id, tag)[0] is None:  # it may have landed before our lease
                    _stale_temp_files(run_root, store, shard_id)
                    record = computer.compute(shard_id, token_records[shard_id], leases,
                                              on_rows=lambda done, rows, i=shard_id: progress.partial(
                                                  done, rows, i, tokens=done * computer.cfg.seq_len))
                    if not commit_or_remove(run_root, store, record, exclusive=True):
                        progress.update(1, 0)  # another process committed it first: its record stands
                        continue
                    written, tokens, seconds = written + 1, tokens + record.tokens, seconds + record.extra.seconds
                    peak = _peak_device_memory_mib(computer.device)
                    progress.update(1, record.tokens, **({"peak_device_memory_mib": peak} if peak is not None else {}))
            finally:
                leases.release(shard_id)
        if not waiting or not wait_for_others:
            return written, tokens, seconds, waiting
        time.sleep(min(10.0, leases.ttl_s / 10))
        pending = waiting
    return written, tokens, seconds, []


def _write_store_files(cfg: KDFlowConfig, plan: PassPlan, codec: TopkCodec | None) -> None:
    """The resolved config, and _store.json: what made this store, for readers that do not load the teacher."""
    plan.run_root.write_bytes_atomic(f"{plan.store}/{CONFIG_FILE}", dump_config(cfg).encode())
    v2 = {} if codec is None else {"format": "v2", "store": store_format(cfg), "codec": codec.settings()}
    write_store_info(plan.run_root, plan.store, TopkStoreInfo(
        tag=plan.tag, teacher_fingerprint=plan.teacher_fp, tokens_fingerprint=plan.tokens_done.fingerprint,
        teacher=teacher_section(cfg), teacher_identity=teacher_identity(cfg.teacher, device=plan.device),
        top_k=cfg.precompute.top_k, logprobs_dtype=cfg.precompute.logprobs_dtype, seq_len=cfg.seq_len, **v2))


def complete_if_done(run_root: RunRoot, store: str, tag: str, tokens_done: StageComplete) -> None:
    """Write _complete.json once every token shard has its top-K shard (and not again on a rerun).

    Also called by the fan-out flow: two range runs finishing at once may each miss the other's last shard."""
    existing = read_complete(run_root, store)
    if existing is not None and existing.fingerprint == tag and existing.shards == tokens_done.shards:
        return
    in_store = list_commits(run_root, store, "topk", tag)
    if any(i not in in_store for i in range(tokens_done.shards)):
        return
    records = [in_store[i] for i in range(tokens_done.shards)]
    first = records[0].extra if records else TopkShardInfo()
    extra = TopkCompleteInfo(tokens_fingerprint=tokens_done.fingerprint, teacher_fingerprint=first.teacher_fingerprint,
                             seq_len=first.seq_len, top_k=first.top_k)
    write_complete(run_root, store, StageComplete(stage="topk", shards=len(records), rows=sum(r.rows for r in records),
                                                  tokens=sum(r.tokens for r in records), fingerprint=tag, extra=extra))


def _peak_device_memory_mib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
