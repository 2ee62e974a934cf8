"""The teacher pass: every token shard -> an aligned top-K shard in topk/TAG/ (no Prefect here).

Per micro-batch of exactly `micro_batch` sequences (the last one of a shard is padded, so the batch shape
on the device never changes): hidden states from the model body, top-K and the full-vocabulary
log-sum-exp chunk by chunk (`kdflow.tasks.teacher.topk`), one copy to the host, and the Arrow write handed to a
background thread so that it overlaps the next forward. Each shard is committed (data file, then its
commit record) and a rerun skips committed shards. Before computing a shard a process takes a lease file,
so that two processes on one run root do not compute the same shard; a lost race would still be harmless.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kdflow.schemas.commits import (CommitRecord, StageComplete, TopkCompleteInfo, TopkShardInfo, check_commit,
                                    check_commits, list_commits, read_complete, stage_dir, write_commit,
                                    write_complete)
from kdflow.schemas.config import KDFlowConfig, dump_config
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.fingerprints import corpus_fingerprint, tokenizer_fingerprint, tokens_fingerprint, topk_fingerprint
from kdflow.schemas.layout import CONFIG_FILE, data_file_name, temp_prefix
from kdflow.schemas.shards import StreamShardWriter, read_token_shard, topk_batch, topk_shard_writer
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.stores import TopkStoreInfo, teacher_section, write_store_info
from kdflow.tasks.common.models import output_layer, resolve_device, teacher_fingerprint, teacher_identity
from kdflow.tasks.common.progress import Progress
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.teacher import faults
from kdflow.tasks.teacher.leases import ShardLeases
from kdflow.tasks.teacher.loading import (check_store_tokenizer, check_teacher_limits, check_tokenizer_fits,
                                          load_teacher, load_teacher_config, vocab_rows)
from kdflow.tasks.teacher.topk import TeacherTopkStep, choose_chunk_tokens

WRITE_QUEUE_DEPTH = 2


# --- one shard: device -> host -> Arrow, overlapped -------------------------------------------------------


class HostCopies:
    """Copies a micro-batch's results to the host once: on CUDA into a ring of pinned buffers, without blocking
    (an event tells the writer when the copy landed); on the CPU the results already are host tensors."""

    def __init__(self, device: torch.device, shape: tuple[int, int, int], logprobs_dtype: torch.dtype, slots: int) -> None:
        self.on_cuda = device.type == "cuda"
        self.logprobs_dtype = logprobs_dtype
        self.free: queue.Queue[tuple[torch.Tensor, torch.Tensor]] = queue.Queue()
        for _ in range(slots if self.on_cuda else 0):
            self.free.put((torch.empty(shape, dtype=torch.int32, pin_memory=True),
                           torch.empty(shape, dtype=logprobs_dtype, pin_memory=True)))

    def copy(self, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> tuple[np.ndarray, np.ndarray, Any, Callable[[], None]]:
        """(rows, T, K) device tensors -> host arrays, a CUDA event (or None) and a release callback."""
        topk_logprobs = topk_logprobs.to(self.logprobs_dtype)  # on the device: halves the transfer for float16
        if not self.on_cuda:
            return topk_ids.numpy(), topk_logprobs.numpy(), None, lambda: None
        slot = self.free.get()
        rows = topk_ids.shape[0]
        host_ids, host_logprobs = slot[0][:rows], slot[1][:rows]
        host_ids.copy_(topk_ids, non_blocking=True)
        host_logprobs.copy_(topk_logprobs, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host_ids.numpy(), host_logprobs.numpy(), event, lambda: self.free.put(slot)


class BackgroundWriter:
    """One thread writing queued micro-batches into an open shard file while the next forward runs."""

    def __init__(self, writer: StreamShardWriter, logprobs_dtype: str, run_root: RunRoot, shard_id: int) -> None:
        self.writer, self.logprobs_dtype, self.run_root, self.shard_id = writer, logprobs_dtype, run_root, shard_id
        self.queue: queue.Queue[tuple | None] = queue.Queue(maxsize=WRITE_QUEUE_DEPTH)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"topk-writer-{shard_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            topk_ids, topk_logprobs, ready, release, micro_batch = item
            try:
                if self.error is None:
                    if ready is not None:
                        ready.synchronize()
                    faults.maybe_fire("write", self.run_root, shard=self.shard_id, micro_batch=micro_batch)
                    self.writer.write(*topk_batch(topk_ids, topk_logprobs, self.logprobs_dtype))
            except BaseException as error:  # handed to the producer, which raises it
                self.error = error
            finally:
                release()
                self.queue.task_done()
        self.queue.task_done()

    def put(self, topk_ids: np.ndarray, topk_logprobs: np.ndarray, ready: Any, release: Callable[[], None], micro_batch: int) -> None:
        self._raise()
        self.queue.put((topk_ids, topk_logprobs, ready, release, micro_batch))

    def drain(self, flush: bool = False) -> None:
        """Wait until every queued micro-batch is in the file (flushed to the OS if asked); raise its error."""
        self.queue.join()
        self._raise()
        if flush:
            self.writer.sink.flush()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the thread. Bounded: after a driver failure a CUDA call in it may never return, and the worker
        must still exit (the daemon thread dies with the process)."""
        with contextlib.suppress(queue.Full):
            self.queue.put(None, timeout=timeout_s)
        self.thread.join(timeout_s)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


class ShardComputer:
    """Everything fixed for one pass: the teacher step, the store, the batch shape."""

    def __init__(self, cfg: KDFlowConfig, model: torch.nn.Module, run_root: RunRoot, store: str, tag: str,
                 info: TopkShardInfo) -> None:
        pre = cfg.precompute
        self.cfg, self.run_root, self.store, self.tag = cfg, run_root, store, tag
        self.device = next(model.parameters()).device
        self.vocab_rows = vocab_rows(model)
        vocab = getattr(output_layer(model), "out_features", None) or self.vocab_rows
        chunk_tokens = pre.chunk_tokens or choose_chunk_tokens(vocab, pre.chunk_memory_mib << 20)
        try:
            self.step = TeacherTopkStep(model, pre.top_k, chunk_tokens)
        except NotImplementedError as error:
            raise ConfigError(f"teacher not supported: {error}") from None
        # vocab_size: the teacher's output rows; `kdflow validate` bounds top-K ids by it.
        self.info = info.model_copy(update={"chunk_tokens": chunk_tokens, "vocab_size": int(vocab)})
        storage = torch.float16 if pre.logprobs_dtype == "float16" else torch.float32
        self.host = HostCopies(self.device, (pre.micro_batch, cfg.seq_len, pre.top_k), storage, WRITE_QUEUE_DEPTH + 2)

    def compute(self, shard_id: int, token_record: CommitRecord, leases: ShardLeases) -> CommitRecord:
        cfg, pre = self.cfg, self.cfg.precompute
        tokens_store = stage_dir(self.run_root, "tokens")
        input_ids = read_token_shard(self.run_root, f"{tokens_store}/{token_record.data_file}", cfg.seq_len)  # (rows, T)
        if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= self.vocab_rows):
            raise StoreError(f"token shard {shard_id} holds id {int(input_ids.max())}, outside the teacher's "
                             f"embedding of {self.vocab_rows} rows")
        started = time.perf_counter()
        name = data_file_name("topk", shard_id)
        with topk_shard_writer(self.run_root, f"{self.store}/{name}", cfg.seq_len, pre.top_k, pre.logprobs_dtype) as writer:
            background = BackgroundWriter(writer, pre.logprobs_dtype, self.run_root, shard_id)
            try:
                for micro_batch, start in enumerate(range(0, len(input_ids), pre.micro_batch)):
                    self._micro_batch(input_ids[start:start + pre.micro_batch], background, shard_id, micro_batch)
                    leases.renew(shard_id)
                background.drain()
            finally:
                background.close()
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
        topk_ids, topk_logprobs = self.step(input_ids)  # (B, T, K) on the device
        if faults.active_faults():
            background.drain(flush=True)  # a `kill` fault must find the earlier micro-batches in the file
            faults.maybe_fire("micro_batch", self.run_root, shard=shard_id, micro_batch=micro_batch)
        host_ids, host_logprobs, ready, release = self.host.copy(topk_ids[:rows], topk_logprobs[:rows])
        background.put(host_ids, host_logprobs, ready, release, micro_batch)


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
    """Remove temp files a killed writer left for this shard (RunRoot.atomic_writer's `.NAME.tmp-*`)."""
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
    check_teacher_limits(load_teacher_config(cfg.teacher), top_k=cfg.precompute.top_k, seq_len=cfg.seq_len)
    tokenizer = load_tokenizer(cfg)
    tokens_store, tokens_done = _token_store(run_root, cfg, tokenizer_fingerprint(tokenizer))
    wanted = _requested(shard_ids, tokens_done.shards)
    teacher_fp = teacher_fingerprint(cfg.teacher, device=device)
    tag = topk_fingerprint(teacher_fp, tokens_done.fingerprint, cfg)
    store = stage_dir(run_root, "topk", tag)
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
    written, tokens_written, compute_seconds, leased_elsewhere = 0, 0, 0.0, []
    if plan.todo:
        token_checks = check_commits(run_root, plan.tokens_store, "tokens", plan.tokens_done.fingerprint)
        token_records = {i: _valid_token_record(run_root, plan.tokens_store, i, token_checks) for i in plan.todo}
        run_root.ensure_writable()
        model = model if model is not None else load_teacher(cfg.teacher, device=target)
        check_tokenizer_fits(plan.tokenizer, model)
        info = TopkShardInfo(teacher_fingerprint=plan.teacher_fp, tokens_fingerprint=plan.tokens_done.fingerprint,
                             top_k=cfg.precompute.top_k, seq_len=cfg.seq_len, logprobs_dtype=cfg.precompute.logprobs_dtype,
                             micro_batch=cfg.precompute.micro_batch)
        computer = ShardComputer(cfg, model, run_root, store, tag, info)
        _write_store_files(cfg, plan)
        leases = ShardLeases(run_root, store, cfg.precompute.lease_ttl_s)
        progress = Progress("precompute", len(plan.todo), unit="shard", on_update=on_progress)
        try:
            with deterministic_algorithms():
                written, tokens_written, compute_seconds, leased_elsewhere = _run(
                    computer, leases, plan.todo, token_records, progress, wait_for_others)
        finally:
            progress.close()
    complete_if_done(run_root, store, tag, plan.tokens_done)
    in_store = list_commits(run_root, store, "topk", tag)
    committed = [in_store[i] for i in plan.wanted if i in in_store]
    return {
        "tag": tag, "store": run_root.display(store), "shards": len(plan.wanted), "written": written,
        "skipped": len(plan.wanted) - len(plan.todo), "leased_elsewhere": leased_elsewhere, "committed": len(committed),
        "tokens": sum(r.tokens for r in committed), "seconds": round(time.perf_counter() - started, 3),
        "tokens_per_s": round(tokens_written / max(compute_seconds, 1e-9), 1), "peak_device_memory_mib": _peak_device_memory_mib(target),
        "teacher_fingerprint": plan.teacher_fp, "device": str(target), "complete": read_complete(run_root, store) is not None,
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
                    record = computer.compute(shard_id, token_records[shard_id], leases)
                    if not _commit_or_remove(run_root, store, record):
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


def _commit_or_remove(run_root: RunRoot, store: str, record: CommitRecord) -> bool:
    """Write the shard's commit record (-> False if another process's valid record was there first); if that
    fails (a full disk), remove its data file too: an uncommitted file is never read, and the disk wants its
    space back."""
    try:
        return write_commit(run_root, store, record, exclusive=True)
    except BaseException:
        run_root.remove(f"{store}/{record.data_file}")
        raise


def _write_store_files(cfg: KDFlowConfig, plan: PassPlan) -> None:
    """The resolved config, and _store.json: what made this store, for readers that do not load the teacher."""
    plan.run_root.write_bytes_atomic(f"{plan.store}/{CONFIG_FILE}", dump_config(cfg).encode())
    write_store_info(plan.run_root, plan.store, TopkStoreInfo(
        tag=plan.tag, teacher_fingerprint=plan.teacher_fp, tokens_fingerprint=plan.tokens_done.fingerprint,
        teacher=teacher_section(cfg), teacher_identity=teacher_identity(cfg.teacher, device=plan.device),
        top_k=cfg.precompute.top_k, logprobs_dtype=cfg.precompute.logprobs_dtype, seq_len=cfg.seq_len))


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
