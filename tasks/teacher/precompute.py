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
from dataclasses import dataclass, replace
from typing import Any

import torch

from kdflow.schemas.codec import TopkCodec
from kdflow.schemas.commits import (CommitRecord, StageComplete, TopkCompleteInfo, TopkShardInfo, check_commit,
                                    check_commits, commit_or_remove, list_commits, read_complete, stage_dir,
                                    stored_record, write_complete)
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.fingerprints import tokenizer_fingerprint
from kdflow.schemas.layout import CONFIG_FILE, data_file_name, temp_prefix
from kdflow.schemas.stage_settings import TeacherPassSettings
from kdflow.schemas.storage import RunRoot, remove_stale_temp_files
from kdflow.schemas.store_info import (TopkStoreInfo, find_topk_stores, format_mismatch, read_store_info,
                                      store_format, teacher_section, write_store_info)
from kdflow.schemas.token_store import open_token_store
from kdflow.tasks.common import faults
from kdflow.tasks.common.model_configs import tokenizer_mismatch
from kdflow.tasks.common.models import resolve_device, teacher_fingerprint, teacher_identity
from kdflow.tasks.common.progress import Progress
from kdflow.tasks.common.teacher_loading import load_teacher
from kdflow.tasks.common.tokenizer import load_tokenizer
from kdflow.tasks.common.units import MIB
from kdflow.tasks.teacher.leases import ShardLeases
from kdflow.tasks.teacher.loading import check_teacher_limits, check_tokenizer_fits, load_teacher_config
from kdflow.tasks.teacher.micro_batch import device_label, start_micro_batch
from kdflow.tasks.teacher.sampling import check_sampling_fits
from kdflow.tasks.teacher.shard_computer import ShardComputer
from kdflow.tasks.teacher.store_quality import pass_fidelity

logger = logging.getLogger("kdflow.precompute")


# --- the pass ---------------------------------------------------------------------------------------------


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
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
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
    committed: dict[int, CommitRecord]  # the store's commit records when the plan was made


def plan_pass(run_root: RunRoot, settings: TeacherPassSettings, shard_ids: list[int] | None,
              device: torch.device) -> PassPlan:
    """The cheap checks first (teacher config, tokenizer, token store), then the shards still to compute."""
    teacher, pre = settings.teacher, settings.precompute
    check_teacher_limits(teacher_config := load_teacher_config(teacher), top_k=pre.top_k, seq_len=settings.seq_len)
    check_sampling_fits(pre, teacher_config)
    mismatch = tokenizer_mismatch(settings.tokenizer, teacher)  # ids of another vocabulary would be silent garbage
    if mismatch is not None:
        raise ConfigError(mismatch)
    tokenizer = load_tokenizer(teacher, settings.tokenizer)
    tokenizer_fp = tokenizer_fingerprint(tokenizer)
    tokens = open_token_store(run_root, tokenizer_fp, settings.tokens_fingerprint(tokenizer_fp))
    tokens_store, tokens_done = tokens.path, tokens.complete
    wanted = _requested(shard_ids, tokens_done.shards)
    teacher_fp = teacher_fingerprint(teacher, device=device)
    tag = settings.topk_fingerprint(teacher_fp, tokens_done.fingerprint)
    store = stage_dir(run_root, "topk", tag)
    existing = read_store_info(run_root, store)
    mismatch = format_mismatch(existing, pre, run_root.display(store)) if existing is not None else None
    if mismatch is not None:  # the tag names the format, so only a damaged or foreign _store.json gets here
        raise StoreError(mismatch)
    committed = list_commits(run_root, store, "topk", tag)  # one listing, not a request per shard
    if existing is None and pre.targets != "topk":
        _say_other_draws(run_root, settings, tag)
    todo = [i for i in wanted if i not in committed]
    return PassPlan(run_root, device, tokenizer, tokens_store, tokens_done, wanted, teacher_fp, tag, store, todo,
                    committed)


def _say_other_draws(run_root: RunRoot, settings: TeacherPassSettings, tag: str) -> None:
    """A new sampled store beside one of the same targets drawn with another noise hash (a store begun before
    kdflow.2 became the default): say how to finish that one instead of starting this one."""
    for other in find_topk_stores(run_root, settings.teacher, settings.precompute, to_train=True):
        if other == tag:
            continue
        info = read_store_info(run_root, stage_dir(run_root, "topk", other))
        drawn = ((info.store_format().get("sampling") or {}) if info is not None else {}).get("hash_version")
        logger.warning("precompute: starting top-K store %s; %s holds the same targets drawn with %s noise: to "
                       "finish that one instead, set precompute.sampling.hash_version: %s", tag,
                       run_root.display(stage_dir(run_root, "topk", other)), drawn, drawn)


def precompute_shards(
    run_root: RunRoot,
    settings: TeacherPassSettings,
    shard_ids: list[int] | None = None,
    *,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    device: torch.device | str | None = None,
    model: torch.nn.Module | None = None,
    wait_for_others: bool = True,
    micro_batch: int | None = None,
) -> dict[str, Any]:
    """Compute and commit the top-K shards of `shard_ids` (default: all) that are not committed yet.

    `model`: an already loaded teacher (else loaded here, only if there is work). With `wait_for_others`,
    shards leased by another live process are waited for (taken over if their lease expires). `micro_batch`:
    run at this instead of `precompute.micro_batch` (the flow's, after an out-of-memory); without it, at what the
    store's shards on this kind of device stepped down to, if they did (`kdflow.tasks.teacher.micro_batch`).
    """
    started = time.perf_counter()
    pre = settings.precompute
    target = (next(model.parameters()).device if model is not None
              else resolve_device(str(device or settings.teacher.device)))
    plan = plan_pass(run_root, settings, shard_ids, target)
    store, tag = plan.store, plan.tag
    marks = {"plan": time.perf_counter()}  # where a call's seconds go: plan, setup (loading included), shards, finish
    written, tokens_written, compute_seconds, leased_elsewhere, fidelity, writer = 0, 0, 0.0, [], None, None
    configured = pre.micro_batch
    if not plan.todo:
        logger.info("precompute: %d/%d shards already committed in %s, nothing to do", len(plan.wanted),
                    len(plan.wanted), run_root.display(store))
    else:
        device_name = device_label(target)
        micro_batch, learned = start_micro_batch(plan.committed.values(), device_name, configured, micro_batch)
        if learned is not None:
            logger.warning("precompute: micro-batch %d, as shard %d of this store ran on this device (%s) after %d "
                           "ran out of its memory (set precompute.micro_batch to start at another)", micro_batch,
                           learned.shard_id, device_name, configured)
        settings = replace(settings, precompute=pre.model_copy(update={"micro_batch": micro_batch}))
        pre = settings.precompute
        logger.info("precompute: loading the teacher for %d shard%s (%d of %d already committed)", len(plan.todo),
                    "" if len(plan.todo) == 1 else "s", len(plan.wanted) - len(plan.todo), len(plan.wanted))
        if on_progress is not None:  # seen before the weights load, which takes minutes for a large teacher
            on_progress({"stage": "precompute", "phase": "loading the teacher", "tag": tag, "done": 0, "tokens": 0,
                         "total": len(plan.todo), "skipped": len(plan.wanted) - len(plan.todo),
                         "micro_batch": pre.micro_batch})
        token_checks = check_commits(run_root, plan.tokens_store, "tokens", plan.tokens_done.fingerprint)
        token_records = {i: _valid_token_record(run_root, plan.tokens_store, i, token_checks) for i in plan.todo}
        run_root.ensure_writable()
        model = model if model is not None else load_teacher(settings.teacher, device=target)
        faults.maybe_fire("load", run_root, stage="precompute")
        check_tokenizer_fits(plan.tokenizer, model)
        info = TopkShardInfo(teacher_fingerprint=plan.teacher_fp, tokens_fingerprint=plan.tokens_done.fingerprint,
                             top_k=pre.top_k, seq_len=settings.seq_len, logprobs_dtype=pre.logprobs_dtype,
                             micro_batch=pre.micro_batch, micro_batch_configured=configured,
                             device=device_name)
        computer = ShardComputer(settings, model, run_root, store, tag, info, plan.tokens_done)
        remove_stale_temp_files(run_root, store)  # what killed writers left (live writers' files are kept)
        _write_store_files(settings, plan, computer.codec if computer.sampled is None else computer.sampled.codec)
        leases = ShardLeases(run_root, store, pre.lease_ttl_s)
        progress = Progress("precompute", len(plan.todo), unit="shard", on_update=on_progress,
                            context={"tag": tag, "skipped": len(plan.wanted) - len(plan.todo)})
        progress.start()
        marks["setup"] = time.perf_counter()
        try:
            with deterministic_algorithms():
                written, tokens_written, compute_seconds, leased_elsewhere = _run(
                    computer, leases, plan.todo, token_records, progress, wait_for_others)
        finally:
            progress.close()
        marks["shards"] = time.perf_counter()
        writer = {"busy_s": round(computer.writer_busy_s, 3), "waited_for_s": round(computer.waited_for_writer_s, 3)}
        if written:  # is the host side what limits this pass? (waiting is the part that costs device time)
            logger.info("precompute: %.1f s computing %d shards; the background writer encoded and wrote for %.1f s of "
                        "it, and the pass waited %.1f s for it", compute_seconds, written, writer["busy_s"],
                        writer["waited_for_s"])
        if written and pre.report_rows:  # the store report's KL, while the teacher is loaded, run as the shards were
            with deterministic_algorithms():  # (a compiled body's guards include this state: no second compile)
                fidelity = pass_fidelity(computer.step, run_root, tag, plan.todo, pre.report_rows, pre.micro_batch)
    complete_if_done(run_root, store, tag, plan.tokens_done)
    in_store = list_commits(run_root, store, "topk", tag)
    committed = [in_store[i] for i in plan.wanted if i in in_store]
    marks["finish"], last = time.perf_counter(), started
    phases = {}
    for name, mark in marks.items():
        phases[name], last = round(mark - last, 3), mark
    return {
        "tag": tag, "store": run_root.display(store), "shards": len(plan.wanted), "written": written,
        "skipped": len(plan.wanted) - len(plan.todo), "leased_elsewhere": leased_elsewhere, "committed": len(committed),
        "tokens": sum(r.tokens for r in committed), "seconds": round(time.perf_counter() - started, 3),
        "tokens_per_s": round(tokens_written / max(compute_seconds, 1e-9), 1),
        "peak_device_memory_mib": _peak_device_memory_mib(target),
        "teacher_fingerprint": plan.teacher_fp, "device": str(target),
        "micro_batch": pre.micro_batch, "micro_batch_configured": configured,  # unequal: after an out-of-memory
        "complete": read_complete(run_root, store) is not None,
        "fidelity": fidelity,
        # the background writer's seconds encoding and writing, and the pass's seconds blocked on it (None: no work)
        "writer": writer,
        "phases_s": phases,  # plan, setup, shards, finish (the report's re-run included): seconds of each
        "computed_with": _computed_with(committed),
    }


def _computed_with(committed: list[CommitRecord]) -> dict[str, Any] | None:
    """How the newest of the shards was computed, as its commit record says (the head that ran, the experts, the
    compiled body); None when none is committed."""
    if not committed:
        return None
    info = max(committed, key=lambda record: record.created_at).extra
    return {key: getattr(info, key, None) for key in ("head", "experts", "compiled_body")}


def _valid_token_record(run_root: RunRoot, store: str, shard_id: int,
                        checks: dict[int, tuple[CommitRecord | None, str]]) -> CommitRecord:
    record, reason = checks.get(shard_id, (None, "no commit record"))
    if record is None:
        raise StoreError(f"token shard {shard_id} in {run_root.display(store)} is not committed ({reason}); "
                         "run tokenise again")
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
            with leases.holding(shard_id):
                # it may have landed before our lease
                if check_commit(run_root, store, "topk", shard_id, tag)[0] is None:
                    stale = stored_record(run_root, store, "topk", shard_id)  # invalid (its data file deleted?)
                    _stale_temp_files(run_root, store, shard_id)
                    record = computer.compute(shard_id, token_records[shard_id], leases,
                                              on_rows=lambda done, rows, i=shard_id: progress.partial(
                                                  done, rows, i, tokens=done * computer.settings.seq_len))
                    if not commit_or_remove(run_root, store, record, exclusive=True, replaces=stale):
                        progress.update(1, 0)  # another process committed it first: its record stands
                        continue
                    written, tokens, seconds = written + 1, tokens + record.tokens, seconds + record.extra.seconds
                    peak = _peak_device_memory_mib(computer.device)
                    progress.update(1, record.tokens, **({"peak_device_memory_mib": peak} if peak is not None else {}))
        if not waiting or not wait_for_others:
            return written, tokens, seconds, waiting
        time.sleep(min(10.0, leases.ttl_s / 10))
        pending = waiting
    return written, tokens, seconds, []


def _write_store_files(settings: TeacherPassSettings, plan: PassPlan, codec: TopkCodec | None) -> None:
    """The resolved config, and _store.json: what made this store, for readers that do not load the teacher."""
    pre = settings.precompute
    plan.run_root.write_bytes_atomic(f"{plan.store}/{CONFIG_FILE}", settings.resolved_config.encode())
    v2 = {} if codec is None else {"format": "v2", "store": store_format(pre), "codec": codec.settings()}
    write_store_info(plan.run_root, plan.store, TopkStoreInfo(
        tag=plan.tag, teacher_fingerprint=plan.teacher_fp, tokens_fingerprint=plan.tokens_done.fingerprint,
        teacher=teacher_section(settings.teacher), teacher_identity=teacher_identity(settings.teacher,
                                                                                     device=plan.device),
        top_k=pre.top_k, logprobs_dtype=pre.logprobs_dtype, seq_len=settings.seq_len, **v2))


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
    return round(torch.cuda.max_memory_allocated(device) / MIB, 1)
