"""Fault tolerance end to end: a long teacher pass meets killed workers, corrupted files, a second worker and
a killed student, and a rerun ends with the bytes of a run that never failed (full disks and bad input:
test_faults_disk.py).

One token store (corpus + tokens, 6 shards) and one uninterrupted top-K store are built once for the session
(the `prepared` fixture); each test works on its own copy. What test_precompute*.py and test_validate.py already
assert (the CUDA-error retry, the in-process kill/resume, the content checks of validate) is not repeated here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.children import finish, kill_group
from support.corpus import flip_byte
from support.faults import (REPO, assert_clean_and_identical, fault_config, lines_with, shard_files, start_worker,
                            topk_store, worker_env, write_config)

from kdflow.commands.validate import validate_run_root
from kdflow.schemas.commits import list_commits
from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import commit_file_name, data_file_name
from kdflow.schemas.manifests import load_manifest
from kdflow.schemas.protocol import PROGRESS_PREFIX, RESULT_PREFIX
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.teacher.precompute import precompute_shards


# --- the teacher pass -------------------------------------------------------------------------------------


def test_worker_killed_mid_shard_is_retried_by_the_flow_with_identical_output(prefect_harness, run_copy, prepared,
                                                                               monkeypatch) -> None:
    from kdflow.flows.precompute import precompute_flow

    config = run_copy()
    monkeypatch.setenv("KDFLOW_FAULT", "kill@shard=1,micro_batch=1")  # SIGKILL: no Python cleanup at all
    result = precompute_flow(config)

    fired = json.loads((Path(config.run_root) / "_faults" / "kill.micro_batch-1.shard-1.fired").read_text())
    assert result["attempt"] == 2 and result["worker_pid"] != fired["pid"]  # a second, fresh process finished
    assert result["written"] == prepared.shards - 1 and result["tag"] == prepared.tag
    # Committed exactly once each: shard 0 by the killed worker, before the kill, and never again; the rest by the
    # retry, which took over the killed worker's lease and temp file of shard 1.
    records = list_commits(RunRoot(config.run_root), str(topk_store(config, prepared)), "topk", prepared.tag)
    assert records[0].created_at < fired["time"] < min(r.created_at for i, r in records.items() if i > 0)
    assert_clean_and_identical(config, prepared)


def test_validate_fix_makes_the_next_run_recompute_exactly_the_damaged_shards(run_copy, prepared, capsys) -> None:
    config = run_copy("reference")
    store = topk_store(config, prepared)
    flip_byte(str(store / data_file_name("topk", 1)))  # same size: only re-hashing can tell
    truncated = store / data_file_name("topk", 3)
    size = truncated.stat().st_size
    os.truncate(truncated, size - 100)
    damaged = shard_files([1, 3])
    untouched = {p.name: p.stat().st_mtime_ns for p in store.glob("shard-*") if p.name not in damaged}

    assert validate_run_root(config.run_root) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if "PROBLEM" in line]
    assert len(problems) == 2, problems
    assert any(f"topk/{prepared.tag} shard 1: shard-00001.arrow has sha256" in line for line in problems)
    assert any(f"topk/{prepared.tag} shard 3: invalid commit record: data file has {size - 100} bytes, its record "
               f"says {size}" in line for line in problems)

    assert validate_run_root(config.run_root, fix=True) == 1
    assert "removed 2 commit records" in capsys.readouterr().out
    commits = sorted(p.name for p in store.glob("*.commit.json"))
    assert commits == [commit_file_name("topk", i) for i in range(prepared.shards) if i not in (1, 3)]

    capsys.readouterr()
    assert validate_run_root(config.run_root) == 0  # right after --fix: what the next run recomputes, as a note
    assert ("shard(s) 1,3 have no commit record: the next run of precompute computes what is missing"
            in capsys.readouterr().out)

    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert (summary["written"], summary["skipped"]) == (2, prepared.shards - 2)
    assert {p.name: p.stat().st_mtime_ns for p in store.glob("shard-*") if p.name not in damaged} == untouched
    assert_clean_and_identical(config, prepared)
    assert validate_run_root(config.run_root) == 0, capsys.readouterr().out


def test_a_data_file_without_its_commit_record_is_never_read_and_is_recomputed(run_copy, prepared, capsys) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_stores

    config = run_copy("reference")
    store = topk_store(config, prepared)
    run_root = RunRoot(config.run_root)
    # What a writer stopped between its data file and its commit record leaves, here with wrong contents of the
    # right size: nothing may trust it.
    orphan = store / data_file_name("topk", 2)
    (store / commit_file_name("topk", 2)).unlink()
    orphan.write_bytes(bytes(orphan.stat().st_size))

    assert 2 not in list_commits(run_root, str(store), "topk", prepared.tag)
    assert 2 not in set(load_manifest(run_root, str(store), "topk", prepared.tag, config.seq_len)["shard_id"])
    with pytest.raises(StoreError) as caught:  # the student's reader refuses it, in one line
        open_stores(open_run_root(config), training_settings(config), load_tokenizer(config.teacher, config.tokenizer))
    assert "shard-00002" in str(caught.value) and "is not committed; run precompute first" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert validate_run_root(config.run_root) == 1
    assert f"topk/{prepared.tag} shard 2: no commit record" in capsys.readouterr().out
    # The other way round (a data file deleted by hand, its commit record left): said so, not "not committed"
    other = run_copy("reference", run_root=config.run_root + "-other")
    (topk_store(other, prepared) / data_file_name("topk", 3)).unlink()
    with pytest.raises(StoreError) as caught:
        open_stores(open_run_root(other), training_settings(other), load_tokenizer(other.teacher, other.tokenizer))
    assert "shard-00003.arrow is missing though its commit record is there (deleted or lost); run precompute " \
           "again" in str(caught.value), str(caught.value)

    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert (summary["written"], summary["skipped"]) == (1, prepared.shards - 1)
    assert_clean_and_identical(config, prepared)
    # The pass computes the deleted file again (the same bytes, so its old record turns valid again) and says it
    # wrote it (it said 0 shards and 0 tokens written), its own record replacing the old one.
    summary = precompute_shards(open_run_root(other), teacher_pass_settings(other))
    assert (summary["written"], summary["skipped"], summary["tokens_per_s"] > 0) == (1, prepared.shards - 1, True)
    assert_clean_and_identical(other, prepared)


# --- two workers on one run root --------------------------------------------------------------------------


@pytest.mark.usefixtures("children")
def test_two_workers_racing_on_one_run_root_compute_each_shard_once(run_copy, prepared, tmp_path, capsys) -> None:
    config = run_copy(precompute__lease_ttl_s=10)  # a worker waiting on the other's lease polls every ttl/10 s
    config_path = write_config(config, tmp_path / "config.yaml")
    workers = [start_worker(config_path) for _ in range(2)]  # started together, no lease seeded: a real race
    try:
        outputs = [finish(worker, what="two racing teacher workers", timeout=300) for worker in workers]
    finally:
        for worker in workers:  # the other one too, if the first did not finish
            kill_group(worker)
    assert [w.returncode for w in workers] == [0, 0], [err[-2000:] for _, err in outputs]

    results = [lines_with(RESULT_PREFIX, out)[0] for out, _ in outputs]
    computed = []  # per worker: progress lines whose token count grew (a shard computed, not found committed)
    for out, _ in outputs:
        progress = lines_with(PROGRESS_PREFIX, out)
        computed.append(sum(b["tokens"] > a["tokens"] for a, b in zip([{"tokens": 0}, *progress], progress)))
    assert [r["written"] for r in results] == computed
    assert sum(computed) == prepared.shards  # no shard computed twice, none left out
    assert all(r["complete"] and r["committed"] == prepared.shards for r in results), results

    run_root = RunRoot(config.run_root)
    store = topk_store(config, prepared)
    assert len(load_manifest(run_root, str(store), "topk", prepared.tag, config.seq_len)) == prepared.shards
    assert_clean_and_identical(config, prepared)
    assert validate_run_root(config.run_root) == 0, capsys.readouterr().out


# --- the student ------------------------------------------------------------------------------------------

TRAIN_SLOWLY = ("import sys, time\n"
                "from kdflow.schemas.config_io import load_config\n"
                "from kdflow.schemas.stage_settings import open_run_root, training_settings\n"
                "from kdflow.tasks.student.train import train\n"
                "config = load_config(sys.argv[1])\n"
                "train(open_run_root(config), training_settings(config), on_step=lambda record: time.sleep(0.25))\n")


@pytest.mark.usefixtures("children")
def test_student_killed_mid_run_resumes_to_the_same_weights(run_copy, prepared, tmp_path) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    whole = run_copy("reference", student__name="whole")
    train(open_run_root(whole), training_settings(whole))
    killed = fault_config(Path(whole.run_root), prepared.teacher, prepared.corpus, student__name="killed")
    student = Path(killed.run_root) / "students" / "killed"

    log = tmp_path / "killed.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", TRAIN_SLOWLY,
                                    str(write_config(killed, tmp_path / "killed.yaml"))],
                                   cwd=REPO, env=worker_env(), stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 240
        while not (student / "checkpoint-2" / "checkpoint.json").exists():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL and not (student / "final").exists()
    complete = sorted(int(p.parent.name.split("-")[1]) for p in student.glob("checkpoint-*/checkpoint.json"))
    assert complete and complete[-1] < killed.student.steps

    # What a kill during a save leaves: a staging folder, and a newer checkpoint without its marker (an object-store
    # upload stops like that). Resuming from either would skip steps; both must be ignored and cleaned up.
    newest = student / f"checkpoint-{complete[-1]}"
    shutil.copytree(newest, student / f".checkpoint-{complete[-1] + 1}.tmp-deadbeef")
    half = shutil.copytree(newest, student / f"checkpoint-{complete[-1] + 2}")
    (half / "checkpoint.json").unlink()

    resumed = train(open_run_root(killed), training_settings(killed))
    assert resumed["start_step"] == complete[-1] and resumed["resumed_from"].endswith(newest.name)
    checkpoints = [p for p in student.iterdir() if "checkpoint-" in p.name]  # pruned: the newest two, both whole
    assert sorted(p.name for p in checkpoints) == ["checkpoint-4", "checkpoint-6"]
    assert all((p / "checkpoint.json").exists() for p in checkpoints)
    steps = [json.loads(line)["step"] for line in (student / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, killed.student.steps + 1))
    reference = load_file(Path(whole.run_root) / "students" / "whole" / "final" / "model.safetensors")
    weights = load_file(student / "final" / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.usefixtures("children")
def test_a_child_ignores_a_kdflow_folder_in_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    """A checkout's root holds `kdflow/` (the CLI's own folder): with kdflow installed from a wheel, `python -m`
    put it first on the worker's sys.path and the teacher worker failed 'No module named kdflow.tasks'."""
    from kdflow.tasks.common.launch import run_child

    (tmp_path / "kdflow").mkdir()
    (tmp_path / "kdflow" / "__init__.py").write_text("raise ImportError('the folder in the working directory')\n")
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    outcome = run_child("kdflow.schemas.protocol", [], on_log=lambda pid, line: lines.append(line))
    assert outcome.exit_code == 0, lines
