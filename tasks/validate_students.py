"""`kdflow validate`'s look at students/: every weights file of each student's final model and checkpoints whole.

Checkpoints carry no hashes of their weights (training rewrites them as it goes), so a store's re-hash has nothing
to compare them with. What a killed copy, a full disk or a cut download leaves is a safetensors file cut short:
training's resume passes over such a checkpoint for the one before it, and `kdflow chat` cannot load it. A
`final/config.json` edited since is named too (it must equal its checkpoint's). A safetensors file says
how long it must be: 8 bytes giving its header's length, the JSON header, then the tensors up to the largest end
offset the header names; two small reads tell a whole file from a cut one, on disk or on an object store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kdflow.schemas.layout import CHECKPOINT_MARKER, FINAL_DIR, STUDENTS_DIR, checkpoint_step, is_store_name
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.model_files import final_config_problem, weights_problems

@dataclass
class StudentReport:
    """What validate found in one student's folder: its final model and checkpoints, and their problems."""

    name: str
    final: bool = False
    checkpoints: list[int] = field(default_factory=list)  # finished ones (with checkpoint.json), by step
    unfinished: list[int] = field(default_factory=list)  # without checkpoint.json: never resumed from
    problems: list[str] = field(default_factory=list)


def student_reports(run_root: RunRoot) -> list[StudentReport]:
    """One report per folder under students/ (none when there is no students/)."""
    reports = []
    students = run_root.path(STUDENTS_DIR)
    for name in filter(is_store_name, run_root.listdir(students)):
        student = f"{students}/{name}"
        report = StudentReport(name)
        for entry in run_root.listdir(student):
            step = checkpoint_step(entry)
            if entry != FINAL_DIR and step is None:
                continue
            folder, shown = f"{student}/{entry}", f"{STUDENTS_DIR}/{name}/{entry}"
            if step is not None and not run_root.exists(f"{folder}/{CHECKPOINT_MARKER}"):
                report.unfinished.append(step)  # being written, or left by a kill: resume never reads it
                continue
            found = weights_problems(run_root, folder, shown)
            if step is None:
                report.final = True
                advice = f"delete {shown} and rerun train: it saves final/ again from the last checkpoint"
            else:
                report.checkpoints.append(step)
                advice = f"delete {shown}: a resume passes over it for the checkpoint before it"
            report.problems += [f"{problem}; {advice}" for problem in found]
        if report.final and report.checkpoints:  # final/ against the checkpoint it was written from
            edited = final_config_problem(run_root, student, max(report.checkpoints))
            report.problems += [f"{edited}; delete {STUDENTS_DIR}/{name}/{FINAL_DIR} and rerun train: it saves "
                                "final/ again from the last checkpoint"] if edited else []
        reports.append(report)  # one stopped before its first checkpoint too: "no finished checkpoint"
    return reports
