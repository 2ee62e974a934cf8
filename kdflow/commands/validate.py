"""`kdflow validate RUN_ROOT [--fix]`: check every store of a run root, deeper than a stage's own checks.

The checks are `kdflow.tasks.validate`'s (its docstring lists them); this prints what they found. It writes
nothing, unless `--fix`: then the commit records of the shards that fail are removed (with their data files and
the store's _complete.json), so that the next run of their stage recomputes exactly those shards; a validate
right after says so in notes, and exits 0.
Then each student's final model and checkpoints: every weights file as long as its header says
(kdflow.tasks.validate_students); `--fix` leaves students alone, each problem names what to delete.
Output: one line per store and student, one line per problem; exit code 0 when nothing is wrong, 1 otherwise.
"""

from __future__ import annotations

from kdflow.schemas.config_io import relative_run_root_hint
from kdflow.schemas.layout import CHECKPOINT_MARKER, FINAL_DIR, STUDENTS_DIR
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.progress import count_of
from kdflow.tasks.run_status import staged_import_lines
from kdflow.tasks.validate import StoreReport, remove_broken, remove_complete, store_reports
from kdflow.tasks.validate_students import StudentReport, student_reports


def _store_line(report: StoreReport) -> str:
    """`LABEL  valid/expected shards valid  rows  state`: expected is `?` while a corpus or token store is
    unfinished (how many shards it will have is known only at its end); an unfinished store is `unfinished`, not
    `ok`, though what it holds checked out."""
    expected = next((n for n in (report.expected, report.planned) if n is not None), "?")
    rows = sum(r.rows for r in report.records.values())
    state = (count_of(len(report.problems), "problem") if report.problems
             else "ok" if report.expected is not None else "unfinished")
    return f"{report.label:<20} {len(report.records):>6}/{expected:<6} shards valid  {rows:>10,} rows  {state}"


def _print_report(report: StoreReport, run_root: RunRoot, fix: bool) -> int:
    """Print the store's lines. With `fix`, remove the commit records (and data files) of its broken shards and
    the store's _complete.json, which no longer holds: the store reads as unfinished, and the next run of its
    stage computes the missing shards. -> records removed."""
    print(_store_line(report))
    for note in report.notes:
        print(f"  note: {note}")
    removed = 0
    for message, shard_id in report.problems:
        if shard_id is None or shard_id not in report.broken:
            print(f"  PROBLEM {message}")
        elif fix:
            commit_path = remove_broken(run_root, report, shard_id)
            removed += 1
            print(f"  PROBLEM {message}; removed {run_root.display(commit_path)} and its data file")
        else:
            print(f"  PROBLEM {message}; to recompute it, delete {run_root.display(report.broken[shard_id])}")
    if removed:
        remove_complete(run_root, report)
    return removed


def _print_student(report: StudentReport) -> None:
    held = ([FINAL_DIR] if report.final else []) + ([count_of(len(report.checkpoints), "checkpoint")]
                                                    if report.checkpoints else [])
    state = "ok" if not report.problems else count_of(len(report.problems), "problem")
    print(f"{STUDENTS_DIR + '/' + report.name:<20} {' + '.join(held) or 'no finished checkpoint':<28} {state}")
    if report.unfinished:
        print(f"  note: checkpoint-{', checkpoint-'.join(map(str, report.unfinished))} unfinished (no "
              f"{CHECKPOINT_MARKER}): being written, or left by a stopped run; a resume never reads it")
    for problem in report.problems:
        print(f"  PROBLEM {problem}")


def validate_run_root(url: str, fix: bool = False, given: str | None = None) -> int:
    """Check every store under the run root; print one line per store and per problem. -> exit code (0: all good).
    `given`: the config file naming the run root."""
    run_root = RunRoot(url)
    if not run_root.exists(run_root.root):
        print(f"run root {url} does not exist{relative_run_root_hint(url, given or url)}")
        return 1
    print(f"validating {run_root.display(run_root.root)}")
    reports: list[StoreReport] = []
    removed = 0
    for report in store_reports(run_root):
        reports.append(report)
        removed += _print_report(report, run_root, fix)
    students = student_reports(run_root)
    for student in students:
        _print_student(student)
    staged = list(staged_import_lines(run_root))  # not stores yet: said, not checked
    for line in staged:
        print(line)
    if not reports and not students:
        print("no stores found (corpus/, tokens/, topk/TAG/)" + (": only the staged work of an unfinished import"
                                                                  if staged else ": nothing to validate"))
        return 1
    student_problems = sum(len(s.problems) for s in students)
    problems = sum(len(r.problems) for r in reports)
    shards = sum(len(r.records) for r in reports)
    if not problems and not student_problems:
        weighted = [s for s in students if s.final or s.checkpoints]  # not those stopped before any checkpoint
        whole = f", {count_of(len(weighted), 'student')} with whole weights" if weighted else ""
        print(f"validate: OK, {count_of(len(reports), 'store')}, {count_of(shards, 'shard')} re-hashed and checked"
              f"{whole}")
        return 0
    if not problems:
        print(f"validate: {count_of(student_problems, 'problem')} in students/; the stores are OK")
        return 1
    action = (f"removed {count_of(removed, 'commit record')}: the next run of the stage(s) recomputes those shards"
              if fix else "delete the commit records named above (or run validate --fix), then rerun the stage(s)")
    stores = count_of(sum(bool(r.problems) for r in reports), "store")
    print(f"validate: {count_of(problems, 'problem')} in {stores}; {action}")
    return 1

