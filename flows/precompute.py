"""Flow `precompute`: the teacher's top-K over every token shard, one fresh worker process per attempt.

This process never initialises CUDA: the teacher runs in `python -m kdflow.tasks.teacher.precompute_worker`, in its own
process group. A CUDA driver error ends the worker with a retryable exit code and the task retries it,
with backoff, in a new process that resumes at the first uncommitted shard; a user error (exit code 2)
fails at once with the worker's one-line message. With `precompute.shards_per_flow_run` set, shard ranges
fan out as flow runs of the per-range deployment instead (docs/architecture.md, "The pipeline").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from prefect.runtime import task_run as current_task_run
from prefect.tasks import exponential_backoff

from kdflow.flows.common import as_config, preflight_when_deployed
from kdflow.flows.precompute_progress import FanOutBoard, TeacherProgress
from kdflow.schemas.commits import check_commit, list_commits, read_complete, stage_dir
from kdflow.schemas.config import KDFlowConfig, PrecomputeConfig, TeacherConfig
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.manifests import manifest_frame, validate_manifest
from kdflow.schemas.protocol import (EXIT_CUDA_OOM, LEASE_OWNER_ENV, describe_exit_code, format_shard_ids, is_retryable,
                                     parse_shard_ids)
from kdflow.schemas.stage_settings import TeacherPassSettings, open_run_root, teacher_pass_settings
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_info import TopkStoreInfo, alignment_problem, find_topk_stores, read_store_info
from kdflow.tasks.common.launch import WorkerFailed, config_file, outcome_error, run_child
from kdflow.tasks.teacher.precompute_worker import MODULE as WORKER_MODULE

__all__ = ["precompute_flow", "precompute_shards_flow", "run_teacher_worker"]


def _retry_if_retryable(task: Any, task_run: Any, state: Any) -> bool:
    error = state.result(raise_on_failure=False)
    return isinstance(error, WorkerFailed) and is_retryable(error.exit_code)


# A task run's micro-batch after a CUDA out-of-memory: its next attempt, a fresh process (a CUDA context is never
# resized), runs half as many rows. Task run id -> that micro-batch; the same id across a task run's retries. (A
# later run of the store starts where the shards' commit records say it stepped down: kdflow.tasks.teacher.micro_batch)
_AFTER_OUT_OF_MEMORY: dict[str, int] = {}


@task(name="teacher-worker", cache_policy=NONE, retry_condition_fn=_retry_if_retryable)
def run_teacher_worker(config: KDFlowConfig, shard_ids: list[int] | None = None) -> dict[str, Any]:
    """One attempt: the teacher in a fresh process over `shard_ids` (default all); -> the worker's summary. After a
    CUDA out-of-memory, the next attempt runs half the micro-batch; each shard's commit record names the one it
    ran at (the rows are computed alike; a GPU's kernels may round differently at another batch size)."""
    logger = get_run_logger()
    attempt, run_id = current_task_run.run_count, str(current_task_run.id)
    configured = config.precompute.micro_batch
    given = _AFTER_OUT_OF_MEMORY.get(run_id)
    if given is not None:
        logger.warning("attempt %d: micro-batch %d, after running out of the GPU's memory (precompute.micro_batch "
                       "is %d; `kdflow tune precompute` measures the fastest that fits)", attempt, given, configured)
    artifact = TeacherProgress(open_run_root(config), teacher_pass_settings(config), shard_ids)
    ran: dict[str, Any] = {"micro_batch": given or configured, "began": False}  # the worker says; began: loaded

    def on_progress(update: dict[str, Any]) -> None:
        ran["micro_batch"] = update.get("micro_batch", ran["micro_batch"])
        ran["began"] = ran["began"] or not update.get("phase")
        artifact.update(update)

    with config_file(config, "kdflow-worker") as config_path:
        args = (["--config", config_path] + (["--shards", format_shard_ids(shard_ids)] if shard_ids else [])
                + (["--micro-batch", str(given)] if given is not None else []))
        outcome = run_child(
            WORKER_MODULE, args, env={LEASE_OWNER_ENV: f"task-run-{current_task_run.id}"},
            on_started=lambda pid: logger.info("attempt %d: teacher worker pid %d on shards %s", attempt, pid,
                                               format_shard_ids(shard_ids) if shard_ids else "all"),
            on_progress=on_progress, on_log=lambda pid, line: logger.info("worker %d: %s", pid, line))
    failure = outcome_error(outcome, worker="teacher worker")
    if failure is not None:
        code = failure.exit_code
        logger.error("attempt %d: worker %d ended with exit code %d (%s)%s", attempt, outcome.pid, code,
                     describe_exit_code(code),
                     ", retryable in a new process" if is_retryable(code) else ", not retryable")
        micro_batch = ran["micro_batch"]
        if code == EXIT_CUDA_OOM and not ran["began"]:
            logger.warning("attempt %d: out of memory before the first micro-batch, loading the teacher: a smaller "
                           "micro-batch would not help (what else holds the GPU? a smaller or 4-bit teacher?)", attempt)
        elif code == EXIT_CUDA_OOM and micro_batch > 1:
            _AFTER_OUT_OF_MEMORY[run_id] = micro_batch // 2
            logger.warning("attempt %d: out of memory at micro-batch %d; a retry runs %d", attempt, micro_batch,
                           micro_batch // 2)
        raise failure
    _AFTER_OUT_OF_MEMORY.pop(run_id, None)
    return {"micro_batch": ran["micro_batch"], "micro_batch_configured": configured} | outcome.result | {
        "attempt": attempt, "worker_pid": outcome.pid}


def _worker_with_retries(pre: PrecomputeConfig) -> Any:
    """The teacher-worker task, retried `precompute.max_attempts - 1` times with backoff."""
    retries = pre.max_attempts - 1
    return run_teacher_worker.with_options(
        retries=retries, retry_delay_seconds=exponential_backoff(pre.retry_delay_s)(retries) if retries else 0,
        retry_jitter_factor=0.5,
    )


def _fan_out(run_root: RunRoot, settings: TeacherPassSettings, shard_ids: list[int] | None,
             parameters: dict[str, Any]) -> dict[str, Any]:
    """Shard ranges as flow runs of the per-range deployment (`parameters`: the run's config, as the deployment takes
    it); waits for all of them; -> the store's tag."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from kdflow.tasks.teacher.precompute import complete_if_done

    logger = get_run_logger()
    tokens_done = read_complete(run_root, stage_dir(run_root, "tokens"))
    if tokens_done is None:
        raise StoreError(f"token store in {run_root.url} is not complete; run tokenise first")
    ids = sorted(shard_ids) if shard_ids else list(range(tokens_done.shards))
    pre = settings.precompute
    ranges = [ids[i:i + pre.shards_per_flow_run] for i in range(0, len(ids), pre.shards_per_flow_run)]
    runs = [run_deployment(pre.fanout_deployment, parameters={"config": parameters, "shard_ids": part},
                           flow_run_name=f"precompute-shards-{format_shard_ids(part)}", timeout=0) for part in ranges]
    logger.info("fanned %d shards out as %d flow runs of %s", len(ids), len(runs), pre.fanout_deployment)
    board, states, waiting_since = FanOutBoard(run_root, settings, ranges, runs), {}, time.perf_counter()
    with get_client(sync_client=True) as client:
        pending = {run.id for run in runs}
        failed = []
        board.refresh(client, states, 0.0)
        while pending:
            time.sleep(5)
            for run_id in list(pending):
                state = states[run_id] = client.read_flow_run(run_id).state
                if state is not None and state.is_final():
                    pending.discard(run_id)
                    if not state.is_completed():
                        failed.append(f"{run_id} ({state.type.value})")
            board.refresh(client, states, time.perf_counter() - waiting_since)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(runs)} shard-range flow runs did not complete: "
                           f"{', '.join(failed[:5])}")
    tags = find_topk_stores(run_root, settings.teacher, pre)
    if len(tags) != 1:
        raise StoreError(f"expected one top-K store for this config after the fan-out, found {len(tags)} "
                         f"({', '.join(tags) or 'none'}); with teacher.dtype auto, hosts with and without a GPU make "
                         "different stores: set teacher.dtype")
    complete_if_done(run_root, stage_dir(run_root, "topk", tags[0]), tags[0], tokens_done)
    return {"tag": tags[0]}


def _verify(run_root: RunRoot, seq_len: int, tag: str, shard_ids: list[int] | None) -> dict[str, Any]:
    """Every asked-for shard committed and aligned with its token shard; the manifest validates."""
    store, tokens_store = stage_dir(run_root, "topk", tag), stage_dir(run_root, "tokens")
    tokens_done = read_complete(run_root, tokens_store)
    ids = sorted(shard_ids) if shard_ids else list(range(tokens_done.shards if tokens_done else 0))
    records = list_commits(run_root, store, "topk", tag)
    token_records = list_commits(run_root, tokens_store, "tokens", tokens_done.fingerprint if tokens_done else None)
    missing = [i for i in ids if i not in records]
    if missing:
        raise StoreError(f"top-K store {run_root.display(store)} lacks committed shards {format_shard_ids(missing)} "
                         "after the pass")
    unaligned = [i for i in ids if alignment_problem(token_records.get(i), records[i]) is not None]
    if unaligned:
        raise StoreError(f"top-K shards {format_shard_ids(unaligned)} do not match their token shards; "
                         "rerun precompute")
    frame = validate_manifest(manifest_frame(records), "topk", seq_len, name=run_root.display(store))
    if not shard_ids and read_complete(run_root, store) is None:
        raise StoreError(f"top-K store {run_root.display(store)} has every shard but no _complete.json")
    _manifest_artifact(frame, tag)
    return {"tag": tag, "store": run_root.display(store), "shards": len(ids),
            "tokens": int(sum(records[i].tokens for i in ids))}


def _manifest_artifact(frame: Any, tag: str) -> None:
    try:
        from prefect.artifacts import create_table_artifact

        rows = json.loads(frame.to_json(orient="records"))
        create_table_artifact(rows, key=f"topk-manifest-{tag}",
                              description=f"top-K store {tag}: {len(rows)} committed shards")
    except Exception as error:  # noqa: BLE001 - an artifact is a convenience, the manifest file is the truth
        get_run_logger().debug("manifest artifact not created: %s", error)


def _store_report_artifact(run_root: RunRoot, tag: str, fidelity: dict[str, Any] | None) -> dict[str, Any]:
    """The store report (kdflow.tasks.teacher.store_quality) as a Markdown artifact; the KL comes from the worker,
    which re-ran its teacher on a few rows (none in a fan-out coordinator: see the range runs' artifacts)."""
    try:
        from prefect.artifacts import create_markdown_artifact

        from kdflow.tasks.teacher.store_quality import report_markdown, store_summary

        summary = store_summary(run_root, tag, rows=64) | (fidelity or {})
        create_markdown_artifact(report_markdown(summary), key=f"topk-store-report-{tag}",
                                 description=f"top-K store {tag}: bytes/position, KL to the teacher, histograms")
        return {k: summary[k] for k in ("bytes_per_position", "kl_teacher_store_mean", "kl_teacher_store_max",
                                                  "kl_buckets_lower_bound_mean") if k in summary}
    except Exception as error:  # noqa: BLE001 - a report is a convenience, the store is the truth
        get_run_logger().warning("store report artifact not created: %s", error)
        return {}


def _summary(verified: dict[str, Any], worker: dict[str, Any], started: float) -> dict[str, Any]:
    seconds = time.perf_counter() - started
    return verified | {"written": worker.get("written"), "attempt": worker.get("attempt"),
                       "worker_pid": worker.get("worker_pid"), "micro_batch": worker.get("micro_batch"),
                       "micro_batch_configured": worker.get("micro_batch_configured"),
                       "seconds": round(seconds, 3),
                       "tokens_per_s": worker.get("tokens_per_s", round(verified["tokens"] / max(seconds, 1e-9), 1))}


def _same_teacher(teacher: TeacherConfig, info: TopkStoreInfo | None) -> bool:
    """The store was made from the teacher this config names now (same weights or hub revision, quantisation;
    the dtype too unless it is `auto`, which depends on the host), computed without loading it or touching CUDA."""
    if info is None:
        return False
    try:
        import torch

        from kdflow.tasks.common.models import teacher_identity

        now, stored = teacher_identity(teacher, device=torch.device("cpu")), dict(info.teacher_identity)
    except Exception:  # noqa: BLE001 - the worker reports a bad teacher with its own one-line error
        return False
    if teacher.dtype == "auto":
        now.pop("dtype", None)
        stored.pop("dtype", None)
    return now == stored


def _committed_already(run_root: RunRoot, settings: TeacherPassSettings,
                       shard_ids: list[int] | None) -> dict[str, Any] | None:
    """{'tag', 'written': 0} when this config's top-K store already holds every asked-for shard (read from the
    store's files: no worker started, no teacher loaded), else None."""
    tokens_done = read_complete(run_root, stage_dir(run_root, "tokens"))
    tags = find_topk_stores(run_root, settings.teacher, settings.precompute) if tokens_done is not None else []
    if len(tags) != 1:
        return None
    ids = sorted(shard_ids) if shard_ids else list(range(tokens_done.shards))
    store = stage_dir(run_root, "topk", tags[0])
    if not _same_teacher(settings.teacher, read_store_info(run_root, store)) or any(
            check_commit(run_root, store, "topk", i, tags[0])[0] is None for i in ids):
        return None
    get_run_logger().info("precompute: %d/%d shards already committed in %s, nothing to do", len(ids), len(ids),
                          run_root.display(store))
    from kdflow.tasks.teacher.precompute import complete_if_done

    # A pass killed between its last shard's commit and _complete.json: every later run came here, found nothing
    # to compute, and failed the check that the store is complete; the record is written now (idempotent).
    complete_if_done(run_root, store, tags[0], tokens_done)
    return {"tag": tags[0], "written": 0, "tokens_per_s": 0.0}


def _precompute(run_root: RunRoot, settings: TeacherPassSettings, shard_ids: list[int] | None,
                compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The pass over `shard_ids` (None: all): `compute` (a worker process, or the fan-out) unless the store holds
    them already, then the store verified and reported."""
    started = time.perf_counter()
    worker = _committed_already(run_root, settings, shard_ids)
    if worker is None:
        worker = compute()
    verified = _verify(run_root, settings.seq_len, worker["tag"], shard_ids)
    return _summary(verified, worker, started) | _store_report_artifact(run_root, worker["tag"],
                                                                        worker.get("fidelity"))


@flow(name="precompute", log_prints=True)
def precompute_flow(config: KDFlowConfig) -> dict[str, Any]:
    """The teacher's top-K log-probabilities for every token shard, then the store's manifest checked.

    Args:
        config: The run's settings, section by section; the teacher pass reads `teacher` and `precompute`.
            Run materialise and tokenise first. Needs a GPU worker unless `precompute.shards_per_flow_run`
            fans shard ranges out to the GPU pool.
    """
    config = as_config(config)
    preflight_when_deployed(config, ["precompute"])
    run_root, settings = open_run_root(config), teacher_pass_settings(config)  # the worker opens its own

    def compute() -> dict[str, Any]:
        if settings.precompute.shards_per_flow_run:
            return _fan_out(run_root, settings, None, config.model_dump(mode="json"))
        return _worker_with_retries(settings.precompute)(config, None)

    return _precompute(run_root, settings, None, compute)


@flow(name="precompute-shards", log_prints=True)
def precompute_shards_flow(config: KDFlowConfig, shard_ids: list[int] | str) -> dict[str, Any]:
    """One shard range (a list, or '0,3,5-9') in one worker process: what the fan-out's deployment runs.

    Args:
        config: The settings of the run the range belongs to (passed by the precompute fan-out).
        shard_ids: The range's shard ids, e.g. [0, 1, 2] or '0-15'.
    """
    config = as_config(config)
    try:
        ids = parse_shard_ids(shard_ids) if isinstance(shard_ids, str) else list(shard_ids)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not ids:
        raise ConfigError("precompute-shards needs at least one shard id")
    run_root, settings = open_run_root(config), teacher_pass_settings(config)  # the worker opens its own
    return _precompute(run_root, settings, ids, lambda: _worker_with_retries(settings.precompute)(config, ids))
