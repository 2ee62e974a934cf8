"""The `precompute` flow: the teacher in a fresh worker process per attempt, retried on CUDA driver errors only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.runs import prepare

from kdflow.schemas.commits import list_commits, stage_dir
from kdflow.schemas.protocol import EXIT_USER_ERROR
from kdflow.schemas.shards import read_topk_shard
from kdflow.schemas.storage import RunRoot


def shard_hashes(config: Any, tag: str) -> dict[int, str]:
    run_root = RunRoot(config.run_root)
    return {i: r.sha256 for i, r in list_commits(run_root, stage_dir(run_root, "topk", tag), "topk", tag).items()}


def test_a_cuda_driver_error_is_retried_in_a_new_process(prefect_harness, make_config, tmp_path, monkeypatch) -> None:
    from kdflow.flows.precompute import precompute_flow

    overrides = {"dataset__max_documents": 12, "precompute__max_attempts": 3, "precompute__retry_delay_s": 0}
    clean = prepare(make_config(run_root=str(tmp_path / "clean"), **overrides))
    faulty = prepare(make_config(run_root=str(tmp_path / "faulty"), **overrides))

    uninterrupted = precompute_flow(clean)
    assert uninterrupted["attempt"] == 1 and uninterrupted["shards"] >= 2

    monkeypatch.setenv("KDFLOW_FAULT", "cuda_error@shard=1,micro_batch=1")
    retried = precompute_flow(faulty.model_dump(mode="json"))  # deployment parameters arrive as plain dicts
    fired = json.loads((Path(faulty.run_root) / "_faults" / "cuda_error.micro_batch-1.shard-1.fired").read_text())
    assert retried["attempt"] == 2 and fired["pid"] != retried["worker_pid"]  # a second, fresh process finished
    assert retried["written"] == retried["shards"] - 1  # it resumed after shard 0, committed by the first process
    assert retried["tag"] == uninterrupted["tag"] and retried["tokens"] == uninterrupted["tokens"]
    assert shard_hashes(faulty, retried["tag"]) == shard_hashes(clean, uninterrupted["tag"])  # byte-identical output

def test_out_of_memory_is_retried_at_half_the_micro_batch_and_a_rerun_starts_there(prefect_harness, make_config,
                                                                                  tmp_path, monkeypatch) -> None:
    """A CUDA out-of-memory (exit 75) is retried in a fresh process at half the micro-batch, as often as it recurs;
    the shards hold the same rows whatever the micro-batch, and each commit record says which ran. A rerun of the
    store (after a GPU reset) starts at the micro-batch that fitted, and halves that if it runs out again."""
    from kdflow.flows.pipeline import stage_summary
    from kdflow.flows.precompute import precompute_flow, precompute_shards_flow

    overrides = {"dataset__max_documents": 12, "precompute__max_attempts": 4, "precompute__retry_delay_s": 0,
                 "precompute__micro_batch": 8}
    clean = prepare(make_config(run_root=str(tmp_path / "clean"), **overrides))
    faulty = prepare(make_config(run_root=str(tmp_path / "faulty"), **overrides))
    uninterrupted = precompute_flow(clean)
    assert uninterrupted["micro_batch"] == 8 and uninterrupted["shards"] >= 3

    monkeypatch.setenv("KDFLOW_FAULT", "cuda_oom@at=load;cuda_oom@shard=1,micro_batch_size=8")
    first = precompute_shards_flow(faulty, "0,1")
    # loading the teacher ran out of memory (no micro-batch had run: the same again), then 8 did on shard 1
    assert (first["attempt"], first["micro_batch"], first["micro_batch_configured"]) == (3, 4, 8)
    monkeypatch.setenv("KDFLOW_FAULT", "cuda_oom@micro_batch_size=4,stage=precompute")
    retried = precompute_flow(faulty)  # began at 4, as shard 1 had run; 4 ran out of memory too
    assert (retried["attempt"], retried["micro_batch"], retried["micro_batch_configured"]) == (2, 2, 8)
    assert stage_summary("precompute", retried)[1] == f"{retried['written']} at micro-batch 2 (the config's 8 ran " \
                                                      "out of memory)"
    run_root = RunRoot(faulty.run_root)
    records = list_commits(run_root, stage_dir(run_root, "topk", retried["tag"]), "topk", retried["tag"])
    assert {i: r.extra.micro_batch for i, r in records.items()} == {i: {0: 8, 1: 4}.get(i, 2) for i in records}
    assert {(r.extra.micro_batch_configured, r.extra.device) for r in records.values()} == {(8, "cpu")}
    clean_root = RunRoot(clean.run_root)  # the same values; a shard file holds a record batch per micro-batch
    for record in records.values():
        name = f"{stage_dir(run_root, 'topk', retried['tag'])}/{record.data_file}"
        for got, want in zip(read_topk_shard(run_root, name), read_topk_shard(clean_root, name.replace(
                faulty.run_root, clean.run_root))):
            np.testing.assert_array_equal(got, want)


def test_a_user_error_fails_at_once_with_the_workers_message(prefect_harness, make_config) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from kdflow.flows.precompute import precompute_flow
    from kdflow.schemas.errors import KDFlowError
    from kdflow.tasks.common.launch import WorkerUserError

    # The teacher's limits are checked before the token store is even read: no need to tokenise here.
    config = make_config(precompute__max_attempts=3, precompute__retry_delay_s=0, precompute__top_k=1000)
    state = precompute_flow(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(WorkerUserError) as caught:
        state.result()
    error = caught.value
    assert isinstance(error, KDFlowError) and error.exit_code == EXIT_USER_ERROR
    assert str(error) == "precompute.top_k=1000 must be between 1 and the teacher's vocabulary size 384"
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    [worker_run] = [r for r in runs if r.task_key.startswith("teacher-worker") or r.name.startswith("teacher-worker")]
    assert worker_run.run_count == 1  # not retried


def test_shard_range_flow_computes_only_its_shards_and_reports_artifacts(prefect_harness, make_config) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from kdflow.flows.precompute import precompute_shards_flow

    config = prepare(make_config(dataset__max_documents=12))
    state = precompute_shards_flow(config, "0,2", return_state=True)
    result = state.result()
    assert result["shards"] == 2 and sorted(shard_hashes(config, result["tag"])) == [0, 2]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    from kdflow.flows.precompute_progress import precompute_key
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings

    kinds = {(a.type, a.key) for a in artifacts}
    key = precompute_key(open_run_root(config), teacher_pass_settings(config), [0, 2])
    assert ("table", f"topk-manifest-{result['tag']}") in kinds and ("progress", key) in kinds
    [progress] = [a for a in artifacts if a.type == "progress"]
    assert progress.data == 100.0  # the last update of the worker's progress reached the artifact
    [report] = [a for a in artifacts if a.key == f"topk-store-report-{result['tag']}"]
    assert report.type == "markdown" and "bytes / position" in report.data and "KL(teacher \u2016 store)" in report.data
    assert 0 < result["bytes_per_position"] < 6 * config.precompute.top_k
    assert 0 <= result["kl_buckets_lower_bound_mean"] < 1e-3 and result["kl_teacher_store_mean"] > 0


def test_a_store_killed_before_its_complete_record_completes_on_the_rerun(prefect_harness, make_config) -> None:
    """Every shard committed, `_complete.json` not yet written (a kill between the two): each rerun found nothing
    to compute and failed 'has every shard but no _complete.json', for ever; now it writes the record."""
    from kdflow.flows.precompute import precompute_flow
    from kdflow.schemas.commits import read_complete

    config = prepare(make_config(dataset__max_documents=12))
    tag = precompute_flow(config)["tag"]
    run_root = RunRoot(config.run_root)
    store = stage_dir(run_root, "topk", tag)
    before = read_complete(run_root, store)
    Path(store, "_complete.json").unlink()
    assert precompute_flow(config)["tag"] == tag
    after = read_complete(run_root, store)
    assert after is not None and (after.shards, after.tokens, after.fingerprint) == (before.shards, before.tokens, tag)
