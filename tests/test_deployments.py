"""prefect.yaml against a real Prefect server with real process workers, the way users run it.

One server (SQLite, its own PREFECT_HOME) and the workers infra/start-workers.sh starts (two on pool `gpu`,
one on `cpu`) run for the whole module, on loopback. `prefect --no-prompt deploy --all` deploys the
repository's prefect.yaml unchanged; then `prefect deployment run precompute/llmjp` runs it with a tiny
config (tiny teacher on CPU, shard ranges of half the shards), so the coordinator on `cpu` fans out two
`precompute-shards/gpu` runs, one per GPU worker. The test checks through the API and the run root that
the runs completed, both GPU workers took part, every shard was computed exactly once and committed, and
that the deployment trigger started `train-student/llmjp` with the same config. Everything started here
is stopped at the end (process groups).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.prefect_stack import PREFECT, REPO, PrefectStack, started_stack

from kdflow.schemas.protocol import format_shard_ids

FLOWS = {"materialise", "tokenise", "precompute", "precompute-shards", "train-student", "pipeline", "tune-precompute"}


@pytest.fixture(scope="module")
def prefect_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectStack]:
    with started_stack(tmp_path_factory.mktemp("prefect-stack")) as stack:
        yield stack


@pytest.fixture(scope="module")
def deployed(prefect_stack: PrefectStack) -> dict[str, Any]:
    """`prefect --no-prompt deploy --all` from the repository root; -> deployments by 'flow/name'."""
    started = time.perf_counter()
    prefect_stack.run(PREFECT, "--no-prompt", "deploy", "--all", timeout=300)
    prefect_stack.timings["deploy_s"] = time.perf_counter() - started

    async def read(client: Any) -> dict[str, Any]:
        flows = {flow.id: flow.name for flow in await client.read_flows()}
        return {f"{flows[d.flow_id]}/{d.name}": d for d in await client.read_deployments()}

    return prefect_stack.client_call(read)


def test_deploy_all_creates_every_deployment(prefect_stack: PrefectStack, deployed: dict[str, Any]) -> None:
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert {d.split("/")[0] for d in deployed} == FLOWS
    assert len(deployed) == len(spec["deployments"])
    assert deployed["precompute/llmjp"].work_pool_name == "cpu"
    assert deployed["precompute-shards/gpu"].work_pool_name == "gpu"
    assert deployed["train-student/llmjp"].work_pool_name == "gpu"
    assert deployed["tune-precompute/llmjp"].work_pool_name == "gpu"  # it measures the GPU that runs the teacher
    teacher = deployed["precompute/llmjp"].parameters["config"]["teacher"]
    assert teacher == {"model": "llm-jp/llm-jp-4-32b-a3b-base", "load_in_4bit": True, "dtype": "bfloat16",
                       "device": "cuda"}
    # Schedules are written down but off; the pull step runs flows from this repository.
    schedules = [s for d in deployed.values() for s in d.schedules]
    assert schedules and not any(s.active for s in schedules)
    for deployment in deployed.values():
        assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]

    async def automations(client: Any) -> list[Any]:
        return await client.read_automations()

    owned = [a for a in prefect_stack.client_call(automations)
             if any(getattr(action, "deployment_id", None) == deployed["train-student/llmjp"].id
                    for action in a.actions)]
    assert len(owned) == 1 and owned[0].trigger.expect == {"prefect.flow-run.Completed"}
    print(json.dumps({k: round(v, 1) for k, v in prefect_stack.timings.items()}))


def _tokenised_run(make_config: Callable[..., Any]) -> tuple[Any, int]:
    """Materialise and tokenise in this process (the pure functions); -> (config, token shards)."""
    from kdflow.schemas.stage_settings import materialise_settings, open_run_root, tokenise_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise

    config = make_config(dataset__max_documents=16)
    materialise(open_run_root(config), materialise_settings(config))
    shards = tokenise(open_run_root(config), tokenise_settings(config),
                      load_tokenizer(config.teacher, config.tokenizer)).shards
    assert shards >= 2
    # Two ranges, so the fan-out makes exactly two flow runs: one for each GPU worker.
    return make_config(dataset__max_documents=16, precompute__shards_per_flow_run=math.ceil(shards / 2)), shards


def _wait_final(stack: PrefectStack, flow_run_id: Any, timeout: float) -> Any:
    async def read(client: Any) -> Any:
        return await client.read_flow_run(flow_run_id)

    deadline = time.monotonic() + timeout
    while True:
        flow_run = stack.client_call(read)
        if flow_run.state is not None and flow_run.state.is_final():
            return flow_run
        if time.monotonic() > deadline:
            pytest.fail(f"flow run {flow_run.name} still {flow_run.state.type.value} after {timeout:.0f} s")
        time.sleep(2)


def _wait_workers_online(stack: PrefectStack, expected: dict[str, str], timeout: float = 90) -> None:
    """Wait until every worker (name -> pool) polls, so that both GPU workers are there for the fan-out."""
    from prefect.client.schemas.objects import WorkerStatus

    async def online(client: Any) -> set[str]:
        names = set()
        for pool in set(expected.values()):
            names |= {w.name for w in await client.read_workers_for_work_pool(pool) if w.status == WorkerStatus.ONLINE}
        return names

    deadline = time.monotonic() + timeout
    while not set(expected) <= (names := stack.client_call(online)):
        assert time.monotonic() < deadline, f"workers not online after {timeout:.0f} s: {sorted(set(expected) - names)}"
        time.sleep(1)


def _pause_queue(stack: PrefectStack, pool: str, queue: str) -> None:
    async def pause(client: Any) -> None:
        work_queue = await client.read_work_queue_by_name(queue, work_pool_name=pool)
        await client.update_work_queue(work_queue.id, is_paused=True)

    stack.client_call(pause)


def _runs_of(stack: PrefectStack, deployment_id: Any) -> list[Any]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    async def read(client: Any) -> list[Any]:
        return await client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))

    return stack.client_call(read)


def _workers_that_ran(stack: PrefectStack, flow_run_ids: set[str], timeout: float = 30) -> dict[str, str]:
    """flow run id -> name of the worker that took it, from the workers' `submitted-flow-run` events (the
    server stores events asynchronously, so wait until every run has one)."""
    query = {"filter": {"event": {"name": ["prefect.worker.submitted-flow-run"]},
                        "related": {"id": [f"prefect.flow-run.{run_id}" for run_id in flow_run_ids]}}, "limit": 50}
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(f"{stack.api_url}/events/filter", data=json.dumps(query).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        ran = {}
        for event in json.load(urllib.request.urlopen(request, timeout=10))["events"]:
            for related in event["related"]:
                run_id = related["prefect.resource.id"].removeprefix("prefect.flow-run.")
                if run_id in flow_run_ids:
                    ran[run_id] = event["resource"]["prefect.resource.name"]
        if set(ran) == flow_run_ids or time.monotonic() > deadline:
            return ran
        time.sleep(1)


def _assert_store_complete(config: Any, tag: str, shards: int) -> None:
    """Top-K shards 0..shards-1 committed, the store marked complete, its manifest valid with unique ids."""
    from kdflow.schemas.commits import list_commits, read_complete, stage_dir
    from kdflow.schemas.manifests import load_manifest
    from kdflow.schemas.storage import RunRoot

    run_root = RunRoot(config.run_root)
    store = stage_dir(run_root, "topk", tag)
    assert sorted(list_commits(run_root, store, "topk", tag)) == list(range(shards))
    assert read_complete(run_root, store).shards == shards
    manifest = load_manifest(run_root, store, "topk", tag, seq_len=config.seq_len)
    assert manifest["shard_id"].is_unique and len(manifest) == shards


def test_a_bad_custom_run_fails_in_pre_flight_before_any_stage_writes(
    prefect_stack: PrefectStack, deployed: dict[str, Any], make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """A custom run from the UI or `--params` gets `kdflow run`'s pre-flight: a top_k above the teacher's
    vocabulary fails the pipeline run in one line before materialise starts, not at the teacher pass."""
    config = make_config(run_root=str(tmp_path / "bad"), precompute__top_k=100_000)
    _wait_workers_online(prefect_stack, {"test-gpu-0": "gpu", "test-gpu-1": "gpu"})
    output = prefect_stack.run(PREFECT, "deployment", "run", "pipeline/example", "--params",
                               json.dumps({"config": config.model_dump(mode="json")})).stdout
    flow_run = _wait_final(prefect_stack, re.search(r"UUID: ([0-9a-f-]{36})", output).group(1), timeout=120)
    assert flow_run.state.is_failed(), flow_run.state.message
    assert "ConfigError: precompute.top_k=100000" in flow_run.state.message, flow_run.state.message
    assert not (tmp_path / "bad").exists()  # nothing written: no stage started


def test_precompute_deployment_fans_out_over_both_gpu_workers(
    prefect_stack: PrefectStack, deployed: dict[str, Any], make_config: Callable[..., Any]
) -> None:
    config, shards = _tokenised_run(make_config)
    parameters = {"config": config.model_dump(mode="json")}
    _pause_queue(prefect_stack, "gpu", "student")  # the triggered training run is checked, not run
    _wait_workers_online(prefect_stack, {"test-gpu-0": "gpu", "test-gpu-1": "gpu", "test-cpu": "cpu"})
    started = time.perf_counter()
    output = prefect_stack.run(PREFECT, "deployment", "run", "precompute/llmjp", "--params",
                               json.dumps(parameters)).stdout
    parent_id = re.search(r"UUID: ([0-9a-f-]{36})", output).group(1)
    parent = _wait_final(prefect_stack, parent_id, timeout=240)
    timings = prefect_stack.timings | {"precompute_run_s": time.perf_counter() - started}
    assert parent.state.is_completed(), f"precompute ended {parent.state.type.value}: {parent.state.message}"

    # The coordinator made two range runs; both completed, on two different GPU workers.
    children = _runs_of(prefect_stack, deployed["precompute-shards/gpu"].id)
    assert len(children) == 2 and all(run.state.is_completed() for run in children)
    ranges = [sorted(run.parameters["shard_ids"]) for run in children]
    assert sorted(i for shard_ids in ranges for i in shard_ids) == list(range(shards))  # disjoint, and every shard
    workers = _workers_that_ran(prefect_stack, {str(run.id) for run in children})
    assert sorted(workers.values()) == ["test-gpu-0", "test-gpu-1"]
    assert _workers_that_ran(prefect_stack, {parent_id}) == {parent_id: "test-cpu"}

    # Exactly once: each range run computed all of its shards itself (nothing overlapped or was skipped).
    results = [run.state.result() for run in children]
    assert sorted(result["written"] for result in results) == sorted(len(r) for r in ranges)
    _assert_store_complete(config, parent.state.result()["tag"], shards)

    # The coordinator's overall progress and its table of ranges, kept under the store's keys.
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from kdflow.flows.precompute_progress import precompute_key
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings

    key = precompute_key(open_run_root(config), teacher_pass_settings(config))

    async def artifacts(client: Any) -> dict[str, Any]:
        found = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key, f"{key}-ranges"])))
        return {artifact.key: artifact for artifact in found}

    board = prefect_stack.client_call(artifacts)
    assert board[key].data == 100.0 and board[key].description.startswith("2/2 shard ranges done")
    table = json.loads(board[f"{key}-ranges"].data)
    assert [row["state"] for row in table] == ["Completed", "Completed"]
    assert sorted(row["shards"] for row in table) == sorted(format_shard_ids(r) for r in ranges)

    # The trigger on train-student/llmjp started training with the precompute run's config.
    deadline = time.monotonic() + 60
    while not (trained := _runs_of(prefect_stack, deployed["train-student/llmjp"].id)):
        assert time.monotonic() < deadline, "no train-student run after the precompute run completed"
        time.sleep(2)
    assert len(trained) == 1 and trained[0].parameters["config"] == parameters["config"]
    assert trained[0].work_queue_name == "student"
    print(json.dumps({k: round(v, 1) for k, v in timings.items()}))


def test_stop_all_cancels_the_runs_this_machines_workers_started(
    prefect_stack: PrefectStack, deployed: dict[str, Any], make_config: Callable[..., Any], tmp_path: Path
) -> None:
    """A process worker starts each flow run in a session of its own, so a run outlived a worker stopped with TERM
    and went on holding its GPU. infra/stop-all.sh now cancels the runs in progress first. Two runs paused mid-stage:
    one on `cpu`, whose worker stops it, and one on `gpu`, whose workers are frozen (SIGSTOP: a hung worker), so the
    script ends that run's process itself after the grace period. Both end Cancelled, their processes gone, one
    line each. The workers are started again for the module's other tests."""
    from kdflow.schemas.owners import process_alive

    _wait_workers_online(prefect_stack, {"test-gpu-0": "gpu", "test-gpu-1": "gpu", "test-cpu": "cpu"})
    runs = {}  # deployment -> (flow run id, run root)
    for deployment in ("materialise/llmjp", "pipeline/example"):
        run_root = tmp_path / deployment.split("/")[0]
        config = make_config(run_root=str(run_root))
        output = prefect_stack.run(PREFECT, "deployment", "run", deployment, "--params",
                                   json.dumps({"config": config.model_dump(mode="json")}), "--job-variable",
                                   'env={"KDFLOW_FAULT": "pause@at=commit,stage=materialise"}').stdout
        runs[deployment] = re.search(r"UUID: ([0-9a-f-]{36})", output).group(1), run_root
    pids, deadline = {}, time.monotonic() + 120
    for deployment, (_, run_root) in runs.items():
        while not (fired := sorted((run_root / "_faults").glob("*.fired"))):
            assert time.monotonic() < deadline, f"the {deployment} run never reached its pause"
            time.sleep(0.5)
        pids[deployment] = json.loads(fired[0].read_text())["pid"]
    gpu_workers = [int(p.read_text()) for p in (prefect_stack.root / "state").glob("worker-gpu-*.pid")]
    try:
        for pid in gpu_workers:
            os.kill(pid, signal.SIGSTOP)
        stopped = subprocess.run(["bash", str(REPO / "infra" / "stop-all.sh"), "workers"], cwd=REPO, text=True,
                                 env=prefect_stack.env | {"KDFLOW_STOP_GRACE_S": "10"}, capture_output=True,
                                 timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        lines = {d: [line for line in stopped.stderr.splitlines() if run_id in line] for d, (run_id, _) in runs.items()}
        assert "its worker stopped it" in "".join(lines["materialise/llmjp"]), stopped.stderr
        assert "was ended here" in "".join(lines["pipeline/example"]), stopped.stderr
        deadline = time.monotonic() + 10
        for deployment, pid in pids.items():  # gone, not a zombie waiting for its parent
            while process_alive(pid) and Path(f"/proc/{pid}").exists():
                assert time.monotonic() < deadline, f"the {deployment} run's process outlived infra/stop-all.sh"
                time.sleep(0.2)
        for run_id, _ in runs.values():
            flow_run = _wait_final(prefect_stack, run_id, timeout=30)
            assert flow_run.state.is_cancelled(), flow_run.state
    finally:
        for pid in gpu_workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        prefect_stack.run("bash", str(REPO / "infra" / "start-workers.sh"), "2")
