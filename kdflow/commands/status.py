"""`kdflow status RUN_ROOT`: per stage, committed/expected shards, tokens and fingerprints.

The lines are `kdflow.tasks.run_status`'s; this prints them, or says that the run root is not there.
"""

from __future__ import annotations

import posixpath

from kdflow.schemas.config_io import relative_run_root_hint
from kdflow.schemas.layout import (CORPUS_DIR, FINAL_DIR, IMPORTS_DIR, STUDENTS_DIR, TOKENS_DIR, TOPK_DIR,
                                   checkpoint_step)
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.run_status import status_lines


def print_status(url: str, given: str | None = None) -> int:
    """Print the run root's status; -> exit code (1: no run root there). `given`: the config file naming it."""
    run_root = RunRoot(url)
    if not run_root.exists(run_root.root):
        print(f"run root {url} does not exist (nothing run yet){relative_run_root_hint(url, given or url)}")
        return 1
    for line in status_lines(run_root):
        print(line)
    names = set(run_root.listdir(run_root.root))
    if not names & {CORPUS_DIR, TOKENS_DIR, TOPK_DIR, STUDENTS_DIR, IMPORTS_DIR}:
        student = FINAL_DIR in names or any(checkpoint_step(name) is not None for name in names)
        where = run_root.display(posixpath.dirname(posixpath.dirname(run_root.root.rstrip("/"))))
        print("no stores here (corpus/, tokens/, topk/, students/): " + (
            f"a student's folder (final/, checkpoint-N/), whose run root is {where}" if student
            else "nothing has run in this run root yet"))
    return 0
