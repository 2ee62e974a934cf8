"""`kdflow store import` stopped by Ctrl-C: one line saying that a rerun resumes, as `kdflow run` says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.import_sources import capture_table, import_config, write_parts


@pytest.mark.usefixtures("children")
def test_ctrl_c_mid_import_says_a_rerun_resumes(make_config, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                ) -> None:
    """`kdflow run` said "interrupted; rerun the same command to resume"; an import, which resumes too, did not
    (tests/test_import_stream.py has the resume itself)."""
    import signal

    from support.children import started, wait_until
    from support.faults import write_config

    source = write_parts(tmp_path / "src", capture_table(40, 20), [13, 27])
    config = write_config(import_config(make_config, tmp_path / "run"), tmp_path / "run.yaml")
    command = [sys.executable, "-m", "kdflow", "store", "import", str(source), "--config", str(config), "--layout",
               "kdflow", "--teacher", "t"]
    fired = tmp_path / "run" / "_faults" / "pause.at-commit.shard-1.stage-import.fired"
    with started(command, env=os.environ | {"KDFLOW_FAULT": "pause@at=commit,stage=import,shard=1"},
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as process:
        wait_until(fired.exists, what="the import pausing", timeout=300, process=process)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err.strip().endswith("kdflow: interrupted; rerun the same command to resume")
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.run_status import status_lines

    (staged,) = [line for line in status_lines(RunRoot(str(tmp_path / "run"))) if line.startswith("_imports/")]
    assert " 2 staged shards (" in staged and "of an import not finished: rerunning it resumes there" in staged
    from kdflow.commands.validate import validate_run_root

    capsys.readouterr()
    assert validate_run_root(str(tmp_path / "run")) == 1  # no store yet, and it says what is there
    assert capsys.readouterr().out.splitlines()[1:] == [
        staged, "no stores found (corpus/, tokens/, topk/TAG/): only the staged work of an unfinished import"]
