"""Paths spelt two ways. `data/a.jsonl`, `./data/a.jsonl`, `~/proj/data/a.jsonl` and `/home/me/proj/data/a.jsonl` can
name one file, but the corpus fingerprint hashes `dataset.path` (and `dataset.data_files`) as written, and every
later store's fingerprint folds the corpus's in; a checkpoint's fingerprint likewise holds `student.init_from` as
written. Hashing normalised paths instead would change the fingerprint of every store and checkpoint already made,
so the spelling is matched here instead:

- a run whose dataset names, in the same order, the very files a finished corpus store of its run root was made
  from, with every other dataset setting equal, takes that store's spelling, and so its corpus, token and top-K
  stores and its students' checkpoints;
- a student whose `init_from` names the local folder its saved config names, spelt otherwise, takes the saved
  spelling, and so resumes.

Paths are compared by where they are (resolved, symbolic links followed, from the working folder), so the stored
spelling must still find them from here: a copy elsewhere is another dataset or model, as before. (The teacher's
folder needs no such match: a top-K store is found by its teacher's settings with the folder resolved,
`kdflow.schemas.store_info.same_teacher_settings`.)
"""

from __future__ import annotations

import os

from kdflow.schemas.commits import read_complete
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import same_local_folder, saved_config
from kdflow.schemas.fingerprints import corpus_fingerprint
from kdflow.schemas.layout import CORPUS_DIR, STUDENTS_DIR
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.corpus.dataset_changes import listed_files

SPELLING_KEYS = ("path", "data_files")  # what may differ; every other dataset setting must be equal


def with_stored_spellings(config: KDFlowConfig) -> tuple[KDFlowConfig, list[str]]:
    """`config` with the run root's spellings of its dataset and its student's `init_from` where they name the same
    local files, and a line for each one taken. Anything that stands in the way (no such store or checkpoint, no
    saved config beside it, a hub dataset, paths that do not resolve) leaves that setting as it is: the stages then
    meet the stores as they always did."""
    notes = []
    for match in (_dataset_spelling, _init_from_spelling):
        config, note = match(config)
        notes += [note] if note is not None else []
    return config, notes


def _init_from_spelling(config: KDFlowConfig) -> tuple[KDFlowConfig, str | None]:
    given = config.student.init_from
    if given is None or "://" in given or "://" in config.run_root:
        return config, None
    try:
        run_root = RunRoot(config.run_root)
        folder = run_root.path(STUDENTS_DIR, config.student.name)
        saved = saved_config(run_root, folder).student.init_from
        if saved is None or saved == given or not same_local_folder(saved, given):
            return config, None
    except Exception:  # noqa: BLE001 - no student yet or an unreadable config: training says what it finds
        return config, None
    spelt = config.model_copy(update={"student": config.student.model_copy(update={"init_from": saved})})
    return spelt, (f"student.init_from {given!r} names the folder that {folder} was started from as {saved!r}: "
                   "the run takes that spelling, so the student resumes")


def _dataset_spelling(config: KDFlowConfig) -> tuple[KDFlowConfig, str | None]:
    if "://" in config.dataset.path or "://" in config.run_root:
        return config, None  # remote files have no one resolved path; a remote run root is left to the stages
    try:
        run_root = RunRoot(config.run_root)
        store = run_root.path(CORPUS_DIR)
        done = read_complete(run_root, store)
        if done is None or done.fingerprint == corpus_fingerprint(config):
            return config, None
        saved = saved_config(run_root, store).dataset
        spelt = config.model_copy(update={"dataset": config.dataset.model_copy(
            update={key: getattr(saved, key) for key in SPELLING_KEYS})})
        if corpus_fingerprint(spelt) != done.fingerprint or not _same_files(config, spelt):
            return config, None
    except Exception:  # noqa: BLE001 - unreadable or absent: no reuse, and the stage names the problem if it matters
        return config, None
    return spelt, (f"dataset {_shown(config)} names the files that {store} was made from as {_shown(spelt)}: "
                   "the run takes that spelling, so the stores made from them are reused")


def _same_files(config: KDFlowConfig, spelt: KDFlowConfig) -> bool:
    now, then = listed_files(config.dataset), listed_files(spelt.dataset)
    if not now or not then or any("://" in name for name in [*now, *then]):
        return False
    return [os.path.realpath(name) for name in now] == [os.path.realpath(name) for name in then]


def _shown(config: KDFlowConfig) -> str:
    dataset = config.dataset
    return repr(dataset.path) + ("" if dataset.data_files is None else f" (data_files {dataset.data_files!r})")
