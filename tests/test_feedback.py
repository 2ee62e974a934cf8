"""What users see while a run runs, read back through a Prefect API (the test harness) like the UI reads it:
training log lines every `student.log_every` steps, the keyed progress and curve artifacts updated during the
run, the training curve PNG, the teacher pass's keyed progress, a no-op rerun that says so, and the
parameter form's field order and titles in a deployment's schema."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from support.corpus import sample_documents, write_jsonl
from support.tiny import tiny_config

from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import config_from_dict


@pytest.fixture(scope="module")
def tokenised(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> KDFlowConfig:
    """Corpus and token shards of a tiny run (the pure stages), shared by this module's tests."""
    from kdflow.schemas.stage_settings import materialise_settings, open_run_root, tokenise_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise

    base = tmp_path_factory.mktemp("feedback")
    config = tiny_config(base / "run", tiny_teacher_dir, write_jsonl(base / "docs.jsonl", sample_documents(40)),
                         precompute__micro_batch=2, student__name="watched", student__steps=8, student__log_every=2,
                         student__eval_every=4, student__save_every=4)
    materialise(open_run_root(config), materialise_settings(config))
    tokenised = tokenise(open_run_root(config), tokenise_settings(config),
                         load_tokenizer(config.teacher, config.tokenizer))
    assert tokenised.shards >= 3
    return config


def flow_run_logs(flow_run_id: Any) -> list[str]:
    """Every log message of a flow run (and its tasks), after the log worker has sent what it holds."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
    return [log.message for log in logs]


def artifact_versions(key: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_precompute_reports_keyed_progress_and_a_rerun_does_nothing_quickly(prefect_harness, tokenised) -> None:
    from kdflow.flows.precompute import precompute_flow
    from kdflow.flows.precompute_progress import precompute_key
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings

    state = precompute_flow(tokenised, return_state=True)
    result = state.result()
    assert result["written"] == result["shards"] >= 3
    key = precompute_key(open_run_root(tokenised), teacher_pass_settings(tokenised))
    [progress] = artifact_versions(key)  # one bar per store, updated in place
    assert progress.type == "progress" and progress.data == 100.0 and progress.updated > progress.created
    assert re.search(rf"^{result['shards']}/{result['shards']} shards committed; .* ETA 0:00:00$", progress.description)

    started = time.perf_counter()
    again = precompute_flow(tokenised, return_state=True)
    seconds = time.perf_counter() - started
    assert again.result()["written"] == 0 and again.result()["worker_pid"] is None  # no teacher process at all
    message = f"precompute: {result['shards']}/{result['shards']} shards already committed in"
    assert any(line.startswith(message) and line.endswith("nothing to do")
               for line in flow_run_logs(again.state_details.flow_run_id))
    print(json.dumps({"noop_precompute_flow_s": round(seconds, 2)}))


def test_training_logs_every_n_steps_and_updates_its_artifacts_while_it_runs(prefect_harness, tokenised) -> None:
    from kdflow.flows.precompute import precompute_flow
    from kdflow.flows.train import train_student_flow

    precompute_flow(tokenised)  # a no-op when the test above ran first
    state = train_student_flow(tokenised.model_dump(mode="json"), return_state=True)
    summary = state.result()
    assert summary["steps"] == 8

    # The run log: one line every log_every=2 steps, with the loss and its parts, lr, grad norm, tok/s and ETA.
    lines = [line for line in flow_run_logs(state.state_details.flow_run_id) if line.startswith("train watched: step ")]
    assert [int(re.match(r"train watched: step (\d+)/8 ", line).group(1)) for line in lines] == [2, 4, 6, 8]
    pattern = (r"loss \d+\.\d{4} \(kd \d+\.\d{4}, ce \d+\.\d{4}\) lr [\d.e+-]+ grad norm \d+\.\d{3} "
               r"[\d,]+ tok/s ETA \d+:\d\d:\d\d$")
    assert all(re.search(pattern, line) for line in lines), lines

    # Progress: one artifact under its key, updated in place up to 100 %.
    [progress] = artifact_versions("train-watched-progress")
    assert progress.type == "progress" and progress.data == 100.0 and progress.updated > progress.created
    # The curve: a new version after each evaluation (steps 0, 4, 8) and the final report; each shows the PNG.
    curves = artifact_versions("train-watched")
    assert len(curves) >= 4 and all(curve.type == "markdown" for curve in curves)
    assert sum("(training)" in curve.data for curve in curves) == 3
    assert all("](data:image/png;base64," in curve.data for curve in curves)
    png = Path(tokenised.run_root, "students", "watched", "training_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5_000

    # A rerun of the finished training trains nothing and says so.
    again = train_student_flow(tokenised, return_state=True)
    assert again.result()["steps"] == 8
    assert ("train-student watched: 8/8 steps already done, nothing to do"
            in flow_run_logs(again.state_details.flow_run_id))


def test_the_pipeline_runs_log_says_where_it_stands_and_its_artifact_sums_up(prefect_harness, tokenised) -> None:
    """Each stage is a subflow run with its own log; the pipeline run's log gets two lines a stage (started, and
    what it holds and wrote), so a person opening that run in the UI sees more than its start and end."""
    from kdflow.flows.pipeline import pipeline_flow

    state = pipeline_flow(tokenised, stages=["tokenise", "materialise"], return_state=True)
    assert list(state.result()) == ["materialise", "tokenise"]  # in pipeline order, whatever order was given
    lines = [line for line in flow_run_logs(state.state_details.flow_run_id) if line.startswith("pipeline: ")]
    assert lines[0] == "pipeline: stage 1/2, materialise (its own log is in the subflow run of flow 'materialise')"
    assert lines[2] == "pipeline: stage 2/2, tokenise (its own log is in the subflow run of flow 'tokenise')"
    assert re.fullmatch(r"pipeline: materialise done in [\d.]+ s: \d+ corpus parts, 40 documents; written now: 0",
                        lines[1]), lines
    tokens = state.result()["tokenise"]["tokens"]
    assert re.fullmatch(rf"pipeline: tokenise done in [\d.]+ s: \d+ token shards, {tokens:,} tokens; written now: 0",
                        lines[3]), lines
    [report] = artifact_versions("pipeline-watched")[-1:]
    assert f"| tokenise | {state.result()['tokenise']['shards']} token shards, {tokens:,} tokens | 0 |" in report.data


def test_a_pipeline_whose_student_has_nothing_to_train_on_stops_before_the_teacher_pass(prefect_harness,
                                                                                         tokenised) -> None:
    from kdflow.flows.pipeline import pipeline_flow

    config = tokenised.model_copy(update={"student": tokenised.student.model_copy(update={"eval_shards": 99})})
    state = pipeline_flow(config, return_state=True)
    assert state.is_failed()
    assert state.message.startswith("Flow run encountered an exception: ConfigError: student.eval_shards=99 leaves no "
                                    "training shard: the token store has "), state.message
    assert "lower student.eval_shards (0: no held-out evaluation)" in state.message
    lines = [line for line in flow_run_logs(state.state_details.flow_run_id) if line.startswith("pipeline: stage")]
    assert [line.split(",")[1].split()[0] for line in lines] == ["materialise", "tokenise"]


def _as_jsonb(value: Any) -> Any:
    """What PostgreSQL's jsonb gives back: object keys ordered by length, then bytes."""
    if isinstance(value, dict):
        return {key: _as_jsonb(value[key]) for key in sorted(value, key=lambda k: (len(k.encode()), k.encode()))}
    return [_as_jsonb(item) for item in value] if isinstance(value, list) else value


def form_order(schema: dict[str, Any], definition: str | None = None) -> list[tuple[str, str]]:
    """(key, title) of a form's fields in the order Prefect's UI shows them: sorted by `position`."""
    section = schema["definitions"][definition] if definition else schema
    return [(key, entry["title"]) for key, entry in
            sorted(section["properties"].items(), key=lambda item: item[1].get("position", 0))]


def test_deployment_form_shows_sections_in_pipeline_order_with_titles(prefect_harness) -> None:
    from prefect.client.orchestration import get_client

    from kdflow.flows.precompute import precompute_flow

    deployment_id = precompute_flow.to_deployment(name="form-check").apply()
    with get_client(sync_client=True) as client:
        schema = _as_jsonb(client.read_deployment(deployment_id).parameter_openapi_schema)
    assert [key for key, _ in form_order(schema)] == ["config"]  # no internal shard_ids in the form
    assert "teacher" in schema["properties"]["config"].get("description", "").lower()
    assert form_order(schema, "KDFlowConfig") == [
        ("run_root", "Run root"), ("dataset", "Dataset"), ("tokenizer", "Tokenizer"), ("seq_len", "Sequence length"),
        ("teacher", "Teacher"), ("precompute", "Precompute"), ("student", "Student")]
    student = form_order(schema, "StudentConfig")
    assert student[:5] == [("name", "Name"), ("init_from", "Initialise from"), ("architecture", "Architecture"),
                           ("prune", "Prune the teacher"), ("steps", "Steps")]
    assert ("lr", "Learning rate") in student and student.index(("lr", "Learning rate")) < student.index(("kd", "KD"))
    assert ("rdzv_id", "Rendezvous ID") in form_order(schema, "DistributedConfig")
    assert form_order(schema, "PrecomputeConfig")[-1] == ("lease_ttl_s", "Lease TTL (s)")
    for name, section in schema["definitions"].items():
        for key, entry in section["properties"].items():
            assert entry.get("description") and "position" in entry, f"{name}.{key}"


def test_tensorboard_event_files_hold_the_same_numbers(tokenised) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings, training_settings
    from kdflow.tasks.student.jsonl_log import read_jsonl
    from kdflow.tasks.student.train import train
    from kdflow.tasks.teacher.precompute import precompute_shards

    # a no-op when the tests above ran first
    precompute_shards(open_run_root(tokenised), teacher_pass_settings(tokenised))
    config = tokenised.model_copy(update={"student": tokenised.student.model_copy(
        update={"name": "boarded", "steps": 3, "tensorboard": True, "eval_every": 0})})
    train(open_run_root(config), training_settings(config))
    folder = Path(config.run_root, "students", "boarded", "tensorboard")
    events = EventAccumulator(str(folder))
    events.Reload()
    losses = [(event.step, event.value) for event in events.Scalars("train/loss")]
    from kdflow.schemas.storage import RunRoot

    metrics = read_jsonl(RunRoot(config.run_root), str(folder.parent / "metrics.jsonl"))
    assert losses == [(record["step"], pytest.approx(record["loss"], rel=1e-6)) for record in metrics]
    assert [event.step for event in events.Scalars("eval/kl")] == [0, 3]


def test_a_store_counts_as_done_only_for_the_teacher_it_was_made_from(tokenised) -> None:
    import torch

    from kdflow.flows.precompute import _same_teacher
    from kdflow.schemas.store_info import TopkStoreInfo
    from kdflow.tasks.common.models import teacher_identity

    identity = teacher_identity(tokenised.teacher, device=torch.device("cpu"))
    info = TopkStoreInfo(tag="t", teacher_fingerprint="f", tokens_fingerprint="k", teacher={},
                         teacher_identity=identity,
                         top_k=8, logprobs_dtype="float16", seq_len=32)
    assert _same_teacher(tokenised.teacher, info)
    other_weights = info.model_copy(update={"teacher_identity": identity | {"weights": "other"}})
    assert not _same_teacher(tokenised.teacher, other_weights)
    assert not _same_teacher(tokenised.teacher, None)


def test_the_eta_leaves_out_the_evaluation_before_the_first_step(tokenised, tmp_path) -> None:
    """60 s of step-0 evaluation (a teacher loaded for the full KL) then 1 s a step: after 2 of 10 steps the ETA
    is the 8 s left, not (60 + 2) / 2 x 8. A later evaluation recurs, so it stays in."""
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.student.monitor import TrainingMonitor

    clock = [0.0]
    events: list[dict[str, Any]] = []
    data = tokenised.model_dump(mode="json") | {"run_root": str(tmp_path / "run")}
    data["student"] |= {"steps": 10, "log_every": 2}
    config = config_from_dict(data)
    monitor = TrainingMonitor(config.student, RunRoot(config.run_root), str(tmp_path / "run" / "student"), 0,
                              on_event=events.append, clock=lambda: clock[0])
    evaluation = {"kl": 1.0, "perplexity": 2.0, "top1_agreement": 0.5}
    clock[0] += 60.0
    monitor.evaluated([], [{"step": 0, **evaluation}])
    metrics = {"loss": 1.0, "kd": 1.0, "ce": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 32, "tokens_per_s": 32.0}
    for step in (1, 2):
        clock[0] += 1.0
        monitor.step({"step": step, **metrics})
    clock[0] += 4.0  # an evaluation at step 2, one every 2 steps: part of the run's pace
    monitor.evaluated([], [{"step": 0, **evaluation}, {"step": 2, **evaluation}])
    for step in (3, 4):
        clock[0] += 1.0
        monitor.step({"step": step, **metrics})
    steps = [event for event in events if event["event"] == "step"]
    assert [event["eta_s"] for event in steps] == [8.0, (2 + 4 + 2) / 4 * 6]
    assert steps[-1]["elapsed_s"] == 60.0 + 2 + 4 + 2


def test_the_pipeline_line_of_a_finished_student_names_no_loss() -> None:
    from kdflow.flows.pipeline import stage_summary

    ran = {"student": "s", "start_step": 3, "steps": 8, "final_loss": 2.316e-05}
    assert stage_summary("train", ran) == ("student s: step 3 -> 8, final loss 0.0000", "5 steps")
    again = {"student": "s", "start_step": 8, "steps": 8, "final_loss": None}  # a rerun: nothing trained now
    assert stage_summary("train", again) == ("student s: step 8 -> 8", "0 steps")  # it said "final loss 0"
    split = ran | {"micro_batch_parts": 2}  # the GPU ran out of memory at whole micro-batches
    assert stage_summary("train", split)[1] == "5 steps (micro-batches in 2 pieces: out of memory)"
