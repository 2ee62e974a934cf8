"""Faults from outside, end to end through `kdflow run`: the whole process group SIGKILLed at moments inside every
stage and inside the final save, then the same command again, until it completes; and two `kdflow run` at once
on one run root while every core is busy. Either way the result is the uninterrupted run's, byte for byte
(shards) and bit for bit (final weights), every step trained once, nothing left behind.

The moments are exact, not raced: `KDFLOW_FAULT=pause@at=SITE,...` stops the run where asked (and writes
`_faults/NAME.fired` first); the test sees the marker and kills the group from outside. Each fault fires once
per run root, so the next run passes that point and stops at the next one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.children import kill_group, processes_with_env, started, wait_until
from support.corpus import sample_documents, write_jsonl
from support.tiny import tiny_config

from kdflow.commands.validate import validate_run_root
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import dump_config
from kdflow.schemas.owners import parse_owner_tag
from kdflow.tasks.common.faults import parse_faults
from kdflow.tasks.common.scratch import scratch_owner, scratch_root

REPO = Path(__file__).resolve().parents[1]
# Where a run is stopped and killed, in the order the stages reach them.
MOMENTS = ("pause@at=commit,stage=materialise,shard=1",  # part 1 written, its commit record not yet
           "pause@at=commit,stage=tokenise,shard=2",  # likewise for token shard 2
           "pause@at=micro_batch,stage=precompute,shard=1,micro_batch=1",  # in the teacher worker, mid-shard
           "pause@at=save,stage=train,step=4",  # mid-training: checkpoint-4 filled, not yet renamed into place
           "pause@at=final,stage=train")  # final/ filled, not yet renamed into place


def kill_config(run_root: Path, teacher: Path, corpus: Path) -> KDFlowConfig:
    return tiny_config(run_root, teacher, corpus, dataset__documents_per_part=4, precompute__max_attempts=1,
                       student__steps=6, student__save_every=2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> dict[str, Any]:
    """The uninterrupted run (the stages' own functions, in this process): its files' hashes and final weights."""
    from kdflow.schemas.stage_settings import (materialise_settings, open_run_root, teacher_pass_settings,
                                               tokenise_settings, training_settings)
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise
    from kdflow.tasks.student.train import train
    from kdflow.tasks.teacher.precompute import precompute_shards

    base = tmp_path_factory.mktemp("uninterrupted")
    corpus = write_jsonl(base / "docs.jsonl", sample_documents(16))
    config = kill_config(base / "run", tiny_teacher_dir, corpus)
    materialise(open_run_root(config), materialise_settings(config))
    tokenise(open_run_root(config), tokenise_settings(config), load_tokenizer(config.teacher, config.tokenizer))
    precompute_shards(open_run_root(config), teacher_pass_settings(config))
    train(open_run_root(config), training_settings(config))
    return {"corpus": corpus, "run_root": config.run_root, "files": data_hashes(Path(config.run_root)),
            "weights": final_weights(config)}


def data_hashes(run_root: Path) -> dict[str, str]:
    """sha256 of every data file of the stores (commit records hold times and hosts, so they differ)."""
    return {str(p.relative_to(run_root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for pattern in ("corpus/part-*.parquet", "tokens/shard-*.arrow",
                            "topk/*/shard-*.arrow") for p in sorted(run_root.glob(pattern))}


def final_weights(config: KDFlowConfig) -> dict[str, torch.Tensor]:
    return load_file(Path(config.run_root) / "students" / config.student.name / "final" / "model.safetensors")


def assert_like_the_reference(config: KDFlowConfig, reference: dict[str, Any],
                              capsys: pytest.CaptureFixture[str]) -> None:
    run_root = Path(config.run_root)
    assert validate_run_root(config.run_root) == 0, capsys.readouterr().out
    assert data_hashes(run_root) == reference["files"]
    weights = final_weights(config)
    assert weights.keys() == reference["weights"].keys()
    assert all(torch.equal(weights[name], tensor) for name, tensor in reference["weights"].items())
    student = run_root / "students" / config.student.name
    steps = [json.loads(line)["step"] for line in (student / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, config.student.steps + 1))  # every step trained once, logged once
    evals = [json.loads(line)["step"] for line in (student / "eval.jsonl").read_text().splitlines()]
    assert evals == sorted(set(evals)) == [0, config.student.steps]
    leftovers = [str(p.relative_to(run_root)) for p in run_root.rglob("*")
                 if ".tmp-" in p.name or ".old-" in p.name or p.name.endswith(".lease")]
    assert leftovers == []


def scratch_names() -> list[str]:
    return os.listdir(scratch_root()) if os.path.isdir(scratch_root()) else []


def scratch_pid(name: str) -> int | None:
    owner = parse_owner_tag(scratch_owner(name) or "")
    return owner[0] if owner else None


def run_env(tmp_path: Path, marker: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "KDFLOW_"))}
    return env | {"PREFECT_HOME": str(tmp_path / "prefect-home"), "KDFLOW_TEST_RUN": marker} | extra


def no_process_left(marker: str) -> None:
    wait_until(lambda: not processes_with_env(f"KDFLOW_TEST_RUN={marker}"),
               what="end of every process of the killed run",
               timeout=60)


def test_kill_9_of_the_run_at_every_stage_and_rerun_gives_the_uninterrupted_result(
        prefect_harness, reference, tiny_teacher_dir, tmp_path, capsys) -> None:
    from prefect.settings import PREFECT_API_URL

    config = kill_config(tmp_path / "run", tiny_teacher_dir, reference["corpus"])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(config))
    fired = Path(config.run_root) / "_faults"
    pids: list[int] = []
    killed_scratch: list[str] = []  # scratch folders (worker config files) that a killed run left behind
    # Against the session's Prefect server: what is tested is the run, not another temporary server per rerun.
    for attempt in range(len(MOMENTS) + 1):
        marker = uuid.uuid4().hex
        env = run_env(tmp_path, marker, PREFECT_API_URL=PREFECT_API_URL.value(), KDFLOW_FAULT=";".join(MOMENTS))
        before = set(fired.glob("*.fired"))
        log = tmp_path / f"run-{attempt}.log"
        with open(log, "w") as sink, started([sys.executable, "-m", "kdflow", "run", str(config_path)], cwd=REPO,
                                             env=env,
                                             stdout=sink, stderr=subprocess.STDOUT) as process:
            pids.append(process.pid)
            wait_until(lambda: process.poll() is not None or set(fired.glob("*.fired")) - before, process=None,
                       what=f"run {attempt} pausing at a fault or finishing", timeout=420, output=log.read_text)
            if process.poll() is None:  # paused at the next moment: kill -9 of the whole process group, from outside
                kill_group(process)
                process.wait()
                assert process.returncode == -signal.SIGKILL
        no_process_left(marker)  # the teacher worker (its own session) died with the flow
        killed_scratch += [name for name in scratch_names() if (scratch_pid(name) == process.pid)]
        if process.returncode == 0:
            break
        [new] = set(fired.glob("*.fired")) - before  # stopped exactly where the next fault is
        assert new.name == f"{parse_faults(MOMENTS[attempt])[0].name}.fired", log.read_text()[-3000:]
    assert attempt == len(MOMENTS), (f"the run completed after {attempt} kills, expected {len(MOMENTS)}:\n"
                                     f"{log.read_text()[-3000:]}")
    assert len(list(fired.glob("*.fired"))) == len(MOMENTS)
    assert_like_the_reference(config, reference, capsys)
    # the kill mid-pass left its worker's config
    assert any(name.startswith("kdflow-worker-") for name in killed_scratch)
    assert [name for name in scratch_names() if scratch_pid(name) in pids] == []


@pytest.mark.usefixtures("children")
def test_two_runs_at_once_on_one_run_root_while_every_core_is_busy(reference, tiny_teacher_dir, tmp_path,
                                                                   capsys) -> None:
    """No server given: each run starts Prefect's temporary server, both on one PREFECT_HOME, on busy cores."""
    config = kill_config(tmp_path / "run", tiny_teacher_dir, reference["corpus"])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(config))
    marker = uuid.uuid4().hex
    env = run_env(tmp_path, marker)
    logs = [tmp_path / f"run-{i}.log" for i in range(2)]
    command = [sys.executable, "-m", "kdflow", "run", str(config_path)]
    with contextlib.ExitStack() as stack:
        # Busy loops until both temporary servers have answered: one per core, less the cores that the suite's
        # other xdist workers keep busy already.
        busy = contextlib.ExitStack()
        stack.enter_context(busy)
        others = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) - 1
        loops = [busy.enter_context(started([sys.executable, "-c", "while True: pass"]))
                 for _ in range(max(1, (os.cpu_count() or 2) - others))]
        sinks = [stack.enter_context(open(log, "w")) for log in logs]
        runs = [stack.enter_context(started(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT))
                for sink in sinks]
        both = lambda: "".join(log.read_text()[-3000:] for log in logs)  # noqa: E731
        wait_until(lambda: all("Beginning flow run" in log.read_text() or run.poll() is not None
                               for log, run in zip(logs, runs)),
                   what="both runs beginning their flows (their temporary servers up)", timeout=600, output=both)
        busy.close()
        for run in runs:
            wait_until(lambda run=run: run.poll() is not None, what="the end of both runs", timeout=600, output=both)
        outcomes = [(run.returncode, log.read_text()) for run, log in zip(runs, logs)]
    assert loops and [code for code, _ in outcomes] == [0, 0], "\n\n".join(text[-3000:] for _, text in outcomes)
    assert not any("telemetry" in text.lower() for _, text in outcomes)  # no heartbeat to a server nobody can reach
    no_process_left(marker)
    assert_like_the_reference(config, reference, capsys)
    waited = [text for _, text in outcomes if "is being trained by pid" in text]
    assert len(waited) <= 1  # the one that found the student taken waited for it, then had nothing left to train


# A trainer that, with a gate file given, stops after step 2 until the file exists (the test opens the gate once the
# second trainer says it is waiting: the two overlap for sure, whatever the machine's speed).
TRAIN_GATED = ("import json, logging, os, sys, time\n"
               "logging.basicConfig(level=logging.INFO)\n"
               "from kdflow.schemas.config_io import load_config\n"
               "from kdflow.schemas.stage_settings import open_run_root, training_settings\n"
               "from kdflow.tasks.student.train import train\n"
               "gate = sys.argv[2] if len(sys.argv) > 2 else None\n"
               "def on_step(record):\n"
               "    while gate and record['step'] == 2 and not os.path.exists(gate):\n"
               "        time.sleep(0.05)\n"
               "config = load_config(sys.argv[1])\n"
               "summary = train(open_run_root(config), training_settings(config), on_step=on_step)\n"
               "print('SUMMARY', json.dumps({k: summary[k] for k in ('start_step', 'steps')}), flush=True)\n")


@pytest.mark.usefixtures("children")
def test_two_trainers_on_one_student_train_every_step_once(reference, tiny_teacher_dir, tmp_path, capsys) -> None:
    """The stages' output of the uninterrupted run, then two trainers of the same student at the same time: the
    second waits for the first one's lease, then resumes from its final checkpoint with nothing left to do."""
    import shutil

    run_root = tmp_path / "run"
    shutil.copytree(Path(reference["run_root"]), run_root, ignore=shutil.ignore_patterns("students"))
    config = kill_config(run_root, tiny_teacher_dir, reference["corpus"])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(config))
    marker = uuid.uuid4().hex
    env = run_env(tmp_path, marker)
    logs = [tmp_path / f"trainer-{i}.log" for i in range(2)]
    lease = run_root / "students" / config.student.name / "trainer.lease"
    gate = tmp_path / "gate"
    with open(logs[0], "w") as first, open(logs[1], "w") as second, \
            started([sys.executable, "-c", TRAIN_GATED, str(config_path), str(gate)], cwd=REPO, env=env, stdout=first,
                    stderr=subprocess.STDOUT) as one:
        wait_until(lambda: lease.exists(), what="the first trainer's lease", timeout=300, process=one,
                   output=logs[0].read_text)
        with started([sys.executable, "-c", TRAIN_GATED, str(config_path)], cwd=REPO, env=env, stdout=second,
                     stderr=subprocess.STDOUT) as two:
            wait_until(lambda: "is being trained by pid" in logs[1].read_text(), what="the second trainer waiting",
                       timeout=300, process=two, output=logs[1].read_text)
            gate.touch()  # the first one goes on
            for run, log in ((one, logs[0]), (two, logs[1])):
                wait_until(lambda run=run: run.poll() is not None, what="the end of both trainers", timeout=300,
                           output=log.read_text)
    assert (one.returncode, two.returncode) == (0, 0), logs[0].read_text()[-2000:] + logs[1].read_text()[-2000:]
    summaries = [json.loads(line.split(" ", 1)[1]) for log in logs for line in log.read_text().splitlines()
                 if line.startswith("SUMMARY ")]
    # The first trained all 6 steps; the second resumed at 6 from its final checkpoint: nothing trained twice.
    assert summaries == [{"start_step": 0, "steps": 6}, {"start_step": 6, "steps": 6}]
    no_process_left(marker)
    student = run_root / "students" / config.student.name
    steps = [json.loads(line)["step"] for line in (student / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, config.student.steps + 1)) and not lease.exists()
    weights = final_weights(config)
    assert all(torch.equal(weights[name], tensor) for name, tensor in reference["weights"].items())


@pytest.mark.usefixtures("children")
def test_ctrl_c_and_kill_with_no_server_given_stop_at_once_and_the_rerun_completes(
        reference, tiny_teacher_dir, tmp_path, capsys) -> None:
    """Ctrl-C reaches the whole foreground process group: Prefect's temporary server too, which stopped at once,
    and Prefect's report of the interrupted run retried against it for minutes before kdflow could exit. Then
    SIGTERM to the whole group, as `timeout` and systemd send it (it took 3 min 45 s and ended "Connection
    refused"): the temporary server must not outlive kdflow either. Each time one line, nothing left. The run
    root starts with the uninterrupted run's stores (the stops are in training: the stages before it find their
    work done, and no teacher worker starts)."""
    import shutil

    shutil.copytree(Path(reference["run_root"]), tmp_path / "run", ignore=shutil.ignore_patterns("students"))
    config = kill_config(tmp_path / "run", tiny_teacher_dir, reference["corpus"])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(config))
    moments = ("pause@at=save,stage=train,step=4", "pause@at=final,stage=train")
    fired = Path(config.run_root) / "_faults"
    stops = ((lambda process: os.killpg(process.pid, signal.SIGINT), 130, "kdflow: interrupted; rerun the same"),
             (lambda process: os.killpg(process.pid, signal.SIGTERM), 143, "kdflow: terminated; rerun the same"),
             (None, 0, "pipeline: train done"))
    for attempt, (stop, code, says) in enumerate(stops):
        marker = uuid.uuid4().hex
        log = tmp_path / f"run-{attempt}.log"
        with open(log, "w") as sink, started([sys.executable, "-m", "kdflow", "run", str(config_path)], cwd=REPO,
                                             env=run_env(tmp_path, marker, KDFLOW_FAULT=";".join(moments)),
                                             stdout=sink, stderr=subprocess.STDOUT,
                                             # a terminal's Ctrl-C: SIGINT not ignored (xdist's workers ignore it)
                                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                                             ) as process:
            if stop is not None:
                wait_until(lambda attempt=attempt: (fired / f"{parse_faults(moments[attempt])[0].name}.fired").exists(),
                           what=f"run {attempt} pausing in training", timeout=420, process=process,
                           output=log.read_text)
                stop(process)
            wait_until(lambda: process.poll() is not None, what=f"the end of run {attempt}",
                       timeout=90 if stop else 420, output=log.read_text)
        text = log.read_text()
        assert (process.returncode, says in text) == (code, True), text[-3000:]
        assert "Connection refused" not in text and "Error logging to API" not in text, text[-3000:]
        no_process_left(marker)  # the temporary server stopped with kdflow
        if stop is not None:
            assert "Finished in state Crashed" in text  # the server was up to record the interrupted run
    assert_like_the_reference(config, reference, capsys)
