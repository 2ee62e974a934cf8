"""Nothing left behind: what a killed writer leaves (temp files, staging folders, scratch folders of child
processes) is removed by the next run, and what a live writer is filling never is."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.children import started

from kdflow.schemas.layout import temp_name
from kdflow.schemas.owners import FOREIGN_STALE_AFTER_S, host_tag, is_stale, owner_tag
from kdflow.schemas.storage import RunRoot, remove_stale_temp_files
from kdflow.tasks.common.scratch import remove_stale_scratch, scratch_dir, scratch_owner, scratch_root


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.usefixtures("children")
def test_staleness_rule() -> None:
    now = time.time()
    here, dead = host_tag(), dead_pid()
    assert not is_stale(owner_tag(), now, now)  # this process: alive
    assert is_stale(f"{dead}-{here}-abc", now, now)  # its process is gone on this host: at once, whatever its age
    assert not is_stale(f"{dead}-{host_tag('elsewhere')}-abc", now, now)  # another host: only once untouched for long
    assert is_stale(f"{dead}-{host_tag('elsewhere')}-abc", now - FOREIGN_STALE_AFTER_S - 1, now)
    assert not is_stale("deadbeef0123", now, now) and is_stale("deadbeef0123", now - FOREIGN_STALE_AFTER_S - 1, now)


@pytest.mark.usefixtures("children")
def test_a_stage_folder_loses_only_its_dead_writers_temp_files(tmp_path: Path) -> None:
    run_root = RunRoot(str(tmp_path))
    folder = tmp_path / "corpus"
    folder.mkdir()
    with started([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        names = {
            "dead": temp_name("part-00001.parquet", f"{dead_pid()}-{host_tag()}", "aa"),
            "dead record": temp_name("part-00001.commit.json", f"{dead_pid()}-{host_tag()}", "bb"),
            "live": temp_name("part-00002.parquet", f"{live.pid}-{host_tag()}", "cc"),
            "mine": temp_name("config.yaml", owner_tag(), "dd"),
            "foreign, fresh": temp_name("part-00003.parquet", f"{dead_pid()}-{host_tag('other-host')}", "ee"),
            "old style, fresh": ".part-00004.parquet.tmp-0123456789ab",
        }
        for name in names.values():
            (folder / name).write_bytes(b"x")
        staging = folder / temp_name("checkpoint-4", f"{dead_pid()}-{host_tag()}", "ff")
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"x")
        (folder / "part-00000.parquet").write_bytes(b"data")
        removed = remove_stale_temp_files(run_root, str(folder))
        assert sorted(removed) == sorted([names["dead"], names["dead record"], staging.name])
        left = {p.name for p in folder.iterdir()}
        assert left == {names["live"], names["mine"], names["foreign, fresh"], names["old style, fresh"],
                        "part-00000.parquet"}


def test_atomic_writes_name_their_writer_and_leave_nothing_on_failure(tmp_path: Path) -> None:
    run_root = RunRoot(str(tmp_path))
    seen = []
    try:
        with run_root.atomic_writer(str(tmp_path / "shard-00000.arrow")) as writer:
            writer.write(b"half")
            seen = [p.name for p in tmp_path.iterdir()]
            raise RuntimeError("killed here")
    except RuntimeError:
        pass
    [temp] = seen
    assert temp.startswith(f".shard-00000.arrow.tmp-{owner_tag()}-")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("children")
def test_scratch_folders_of_dead_processes_go_with_the_next_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    root = scratch_root()
    assert root.startswith(str(tmp_path))
    os.makedirs(root)
    killed = Path(root) / f"kdflow-worker-{dead_pid()}-{host_tag()}-x1y2z3"
    killed.mkdir()
    (killed / "config.yaml").write_text("run_root: x\n")
    with started([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        running = Path(root) / f"kdflow-train-{live.pid}-{host_tag()}-a1b2c3"
        running.mkdir()
        with scratch_dir("kdflow-worker") as folder:
            assert Path(folder).name.startswith(f"kdflow-worker-{owner_tag()}-")
            assert not killed.exists() and running.exists()  # the flow that was SIGKILLed: gone; the live one: kept
        assert not Path(folder).exists()
        assert remove_stale_scratch(root) == [] and scratch_owner(running.name) == f"{live.pid}-{host_tag()}-a1b2c3"
    monkeypatch.setattr(tempfile, "tempdir", None)
