"""Fault tolerance end to end, continued from test_faults.py: full disks and bad input. A rerun after the
fault ends with the bytes of a run that never failed; bad input is one line and commits nothing.
"""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.children import finish, run
from support.corpus import sample_documents
from support.faults import (REPO, SECRET, STORE_FILES, assert_clean_and_identical, fault_config, lines_with,
                            shard_files, start_worker, topk_store, worker_env, write_config)

from kdflow.schemas.commits import list_commits
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import data_file_name
from kdflow.schemas.protocol import ERROR_PREFIX, EXIT_NO_SPACE, EXIT_USER_ERROR
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.teacher.leases import ShardLeases
from kdflow.tasks.teacher.precompute import precompute_shards
from kdflow.tasks.teacher.precompute_worker import run as run_worker_here


# --- full disks -------------------------------------------------------------------------------------------


class SmallDisk:
    """A tmpfs at `path` (needs root), sized in pages, its unit of allocation; `resize` works in place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], check=True, capture_output=True,
                       text=True)
        self.page = os.statvfs(path).f_frsize

    def pages(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.page)

    def resize(self, pages: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={pages * self.page // 1024}k", str(self.path)], check=True,
                       capture_output=True)

    def used_pages(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_blocks - stats.f_bfree

    def fill(self) -> None:
        """Leave no free page: the state another process filling the disk leaves."""
        free = os.statvfs(self.path).f_bavail
        (self.path / "ballast").write_bytes(bytes(free * self.page))
        assert os.statvfs(self.path).f_bavail == 0


@pytest.fixture
def small_disk(tmp_path: Path, children: Any) -> Iterator[tuple[SmallDisk | None, str]]:
    """-> (disk, "") or (None, why no tmpfs could be mounted here)."""
    try:
        disk = SmallDisk(tmp_path / "disk")
    except (OSError, subprocess.CalledProcessError) as error:
        why = (getattr(error, 'stderr', None) or str(error)).strip().splitlines()[0]
        yield None, f"cannot mount a tmpfs here: {why}"
        return
    try:
        yield disk, ""
    finally:
        subprocess.run(["umount", "-l", str(disk.path)], check=False)


@pytest.mark.usefixtures("children")
def test_disk_full_mid_pass_fails_with_exit_code_3_and_a_rerun_after_freeing_space_completes(
        small_disk, run_copy, prepared, tmp_path) -> None:
    disk, why = small_disk
    if disk is not None:  # a real full filesystem: the top-K writes fail where the kernel says so
        config = run_copy(run_root=disk.path / "run")
        reference_shard = prepared.base / "reference" / "topk" / prepared.tag / "shard-00000.arrow"
        shard_pages = disk.pages(reference_shard.stat().st_size)
        # Room for config.yaml, _store.json, _renumbering.bin, shard 0 (data, lease, then its commit record) and all
        # but one page of shard 1.
        disk.resize(disk.used_pages() + 3 + shard_pages + 2 + shard_pages - 1)
        env: dict[str, str] = {}
    else:  # no tmpfs: the same error injected where a write would fail
        config = run_copy()
        env = {"KDFLOW_FAULT": "enospc@shard=1,micro_batch=1"}
    worker = start_worker(write_config(config, tmp_path / "config.yaml"), **env)
    stdout, stderr = finish(worker, what="the teacher worker on a full disk", timeout=300)

    assert worker.returncode == EXIT_NO_SPACE, why + stderr[-3000:]
    [error] = lines_with(ERROR_PREFIX, stdout)
    assert error["exit_code"] == EXIT_NO_SPACE
    last_line = stderr.strip().splitlines()[-1]
    assert last_line == f"kdflow worker: no space left on device: {error['message']}"
    # Where, about how much the shard needs, and what to do, in one line.
    shard = topk_store(config, prepared) / data_file_name("topk", 1)
    assert error["message"].startswith(f"disk full at {shard} (needs about ") and " MB free)" in error["message"]
    assert error["message"].endswith("; free space there and rerun to resume: committed work is kept")
    store = topk_store(config, prepared)
    committed = set(list_commits(RunRoot(config.run_root), str(store), "topk", prepared.tag))
    assert 0 in committed and 1 not in committed  # shard 0 is kept, shard 1 was under way
    # Nothing half-written: no uncommitted data file, temp file or lease.
    assert {p.name for p in store.iterdir()} <= shard_files(committed) | STORE_FILES

    if disk is not None:
        disk.resize(disk.pages(16 << 20))  # someone frees space
    summary = precompute_shards(open_run_root(config), teacher_pass_settings(config))
    assert summary["complete"] and summary["written"] == prepared.shards - len(committed)
    assert_clean_and_identical(config, prepared)


@pytest.fixture
def full_disk_run(small_disk: tuple[SmallDisk | None, str], run_copy: Callable[..., KDFlowConfig]) -> KDFlowConfig:
    """A tokenised run root on a tmpfs without a free page (skipped where no tmpfs can be mounted)."""
    disk, why = small_disk
    if disk is None:
        pytest.skip(why)
    config = run_copy(run_root=disk.path / "run")
    disk.fill()
    return config


def test_disk_already_full_is_exit_code_3_and_a_lease_leaves_no_temp_file(full_disk_run, tmp_path, capsys) -> None:
    config = full_disk_run
    # The worker's own code path, in this process (its exit code is returned, not exited with).
    assert run_worker_here(["--config", str(write_config(config, tmp_path / "config.yaml"))]) == EXIT_NO_SPACE
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line == (f"kdflow worker: no space left on device: disk full at {config.run_root} (0 MB free); "
                         "free space there and rerun to resume: committed work is kept")
    assert not (Path(config.run_root) / "topk").exists()

    store = Path(config.run_root, "lease-store")
    store.mkdir()
    with pytest.raises(OSError) as caught:
        ShardLeases(RunRoot(config.run_root), str(store), ttl_s=60).acquire(1)
    assert caught.value.errno == errno.ENOSPC and list(store.iterdir()) == []


def test_a_failed_write_probe_leaves_nothing_behind(full_disk_run) -> None:
    with pytest.raises(StoreError, match="disk full at "):
        RunRoot(full_disk_run.run_root).ensure_writable()
    assert not list(Path(full_disk_run.run_root).glob("*write-probe*"))


@pytest.mark.usefixtures("children")
def test_disk_full_while_saving_a_checkpoint_names_it_and_leaves_no_half_checkpoint(small_disk, run_copy,
                                                                                    tmp_path) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    disk, why = small_disk
    if disk is None:
        pytest.skip(why)
    config = run_copy("reference", run_root=disk.path / "run")
    disk.resize(disk.used_pages() + 24)  # room for the logs, not for a checkpoint (weights and optimizer: ~300 KB)
    with pytest.raises(StoreError) as caught:
        train(open_run_root(config), training_settings(config))
    student = Path(config.run_root) / "students" / config.student.name
    message = str(caught.value)
    assert message.startswith(f"disk full at {student / 'checkpoint-2'} (needs about ") and "\n" not in message
    assert "student.keep_checkpoints=2 needs room for 3 checkpoints while the next one is written" in message
    assert [p.name for p in student.iterdir() if "checkpoint" in p.name] == []  # no half checkpoint, no staging folder
    steps = [json.loads(line)["step"] for line in (student / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    disk.resize(disk.pages(16 << 20))  # someone frees space: the rerun trains from the start (nothing was saved)
    assert train(open_run_root(config), training_settings(config))["steps"] == config.student.steps


# --- bad input --------------------------------------------------------------------------------------------


def cli(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m kdflow ARGS` with a private Prefect home and no server: a temporary one is started if needed."""
    clean = {k: v for k, v in worker_env().items() if not k.startswith("PREFECT_")}
    clean |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    return run([sys.executable, "-m", "kdflow", *args], what=f"kdflow {args[0]}", timeout=420, cwd=REPO,
               env=clean | env)


def files_containing(folder: Path, needle: bytes) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.mark.usefixtures("children")
def test_cli_error_inside_a_stage_is_one_line_without_traceback_and_leaks_no_secret(prepared, tmp_path) -> None:
    """A malformed line deep in the source passes the pre-flight look at the first record; materialise finds it
    under Prefect: the run ends Failed with that line as its message, and the terminal shows no traceback."""
    lines = [json.dumps({"text": text}) for text in sample_documents(12)]
    lines[6] = '{"text": "an unterminated string'
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    config = fault_config(tmp_path / "run", prepared.teacher, corpus)
    config_path = write_config(config, tmp_path / "config.yaml")
    done = cli(["run", str(config_path)], tmp_path, AWS_SECRET_ACCESS_KEY=SECRET)
    assert done.returncode == EXIT_USER_ERROR, done.stderr[-3000:]
    message = f"dataset file {corpus}: line 7 is not valid JSON"
    # Prefect's own one-line log lines (the failed runs, the temporary server stopping) surround it; ours is one line.
    [error] = [line for line in done.stderr.splitlines() if line.startswith("kdflow: error:")]
    assert error.startswith(f"kdflow: error: {message}") and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not list(Path(config.run_root).glob("corpus/*.commit.json"))
    home = tmp_path / "prefect-home"  # Prefect's database: the run's state message and logs, as the UI shows them
    assert files_containing(home, message.encode())
    for folder in (Path(config.run_root), home):
        assert files_containing(folder, SECRET.encode()) == []
    assert SECRET not in done.stdout + done.stderr


@pytest.mark.usefixtures("children")
def test_cli_student_name_that_escapes_the_run_root_is_a_config_error(prepared, tmp_path) -> None:
    config_path = write_config(fault_config(tmp_path / "run", prepared.teacher, prepared.corpus),
                               tmp_path / "config.yaml")
    done = cli(["run", str(config_path), "--set", "student.name=../x"], tmp_path)
    assert done.returncode == EXIT_USER_ERROR
    assert done.stderr.strip().splitlines() == [
        "kdflow: error: --set student.name=../x: invalid value for 'student.name': student name must be a plain "
        "folder name (letters, digits, . _ -), got '../x'"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize(("teacher", "args", "message"), [
    (None, ["--shards", "../3"], "--shards: expected ids like 0,3,5 or 3-9, got '../3'"),
    (None, ["--shards", "2,99"], "shard 99 does not exist: the token store has shards 0-"),
    ("tiny_tokenizer_dir", [], "not a model folder (no config.json)"),  # a tokenizer folder given as the teacher
])
def test_worker_bad_input_is_exit_code_2_one_line_and_commits_nothing(run_copy, tmp_path, capsys, request, teacher,
                                                                      args, message) -> None:
    config = run_copy(**({"teacher__model": str(request.getfixturevalue(teacher))} if teacher else {}))
    assert run_worker_here(["--config", str(write_config(config, tmp_path / "config.yaml")), *args]) == EXIT_USER_ERROR
    captured = capsys.readouterr()
    [error] = lines_with(ERROR_PREFIX, captured.out)
    assert message in error["message"] and "\n" not in error["message"]
    assert captured.err.strip().splitlines()[-1] == f"kdflow worker: user error: {error['message']}"
    assert not list(Path(config.run_root).glob("topk/*/*.commit.json"))
