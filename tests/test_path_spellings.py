"""One dataset spelt two ways (relative and absolute, `~`, `./`, a symbolic link, a folder and its files) is one
corpus to a run root that already holds it: the run takes the corpus store's spelling, so no store is made again.
Other files, other order, a copy elsewhere or another dataset setting stay another dataset, as before."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.corpus import DOCS, write_jsonl

from kdflow.schemas.config_io import write_stage_config
from kdflow.schemas.fingerprints import corpus_fingerprint
from kdflow.schemas.layout import CORPUS_DIR
from kdflow.schemas.stage_settings import materialise_settings, open_run_root
from kdflow.tasks.corpus.materialise import materialise
from kdflow.tasks.path_spellings import with_stored_spellings


@pytest.fixture
def made(make_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """A corpus store made from `src/a.jsonl` and `src/b.jsonl` spelt relative to the working folder (tmp_path);
    -> a config builder for the same run root with another dataset spelling."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "src" / "a.jsonl", DOCS[:5])
    write_jsonl(tmp_path / "src" / "b.jsonl", DOCS[5:])
    first = make_config(dataset__path="src")
    run_root = open_run_root(first)
    assert materialise(run_root, materialise_settings(first)).parts_written > 0
    write_stage_config(run_root, first, run_root.path(CORPUS_DIR))  # as the materialise flow does
    return make_config


@pytest.mark.parametrize("path, data_files", [
    ("{tmp}/src", None),  # absolute
    ("./src/", None),
    ("{tmp}/linked", None),  # a symbolic link to the folder
    ("json", ["src/a.jsonl", "src/b.jsonl"]),  # the files themselves, in the order the folder reads them
    ("{tmp}/src/*.jsonl", None),
    ("~/src", None),  # the home folder (here: tmp_path)
])
def test_the_same_files_spelt_otherwise_take_the_stores_spelling(made: Callable[..., Any], tmp_path: Path,
                                                                  path: str, data_files: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "linked").symlink_to(tmp_path / "src")
    config = made(dataset__path=path.format(tmp=tmp_path), dataset__data_files=data_files)
    stored = made(dataset__path="src")
    assert corpus_fingerprint(config) != corpus_fingerprint(stored)  # the fingerprint hashes the path as written
    taken, (note,) = with_stored_spellings(config)
    assert (taken.dataset.path, taken.dataset.data_files) == ("src", None)
    assert corpus_fingerprint(taken) == corpus_fingerprint(stored) and taken.run_root == config.run_root
    assert repr(config.dataset.path) in note and "'src'" in note and "reused" in note
    assert materialise(open_run_root(taken), materialise_settings(taken)).parts_written == 0
    assert with_stored_spellings(taken) == (taken, [])  # the store's own spelling: nothing to say


def test_other_files_order_setting_or_a_copy_stay_another_dataset(made: Callable[..., Any], tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (copy / name).write_bytes((tmp_path / "src" / name).read_bytes())  # the same bytes, other files
    others = [made(dataset__path=str(copy)),
              made(dataset__path="src/a.jsonl"),  # one of the two files
              made(dataset__path="json", dataset__data_files=["src/b.jsonl", "src/a.jsonl"]),  # another order
              made(dataset__path=str(tmp_path / "src"), dataset__max_documents=3),  # another setting too
              made(dataset__path="no/such/folder")]
    for config in others:
        assert with_stored_spellings(config) == (config, []), config.dataset


def test_nothing_to_compare_leaves_the_config(make_config: Callable[..., Any], tmp_path: Path) -> None:
    config = make_config()  # no corpus store yet
    assert with_stored_spellings(config) == (config, [])
    assert materialise(open_run_root(config), materialise_settings(config)).parts_written > 0
    assert not (Path(config.run_root) / CORPUS_DIR / "config.yaml").exists()  # no saved spelling: as before
    other = make_config(dataset__path=os.path.relpath(config.dataset.path))
    assert with_stored_spellings(other) == (other, [])


def test_a_students_init_from_and_the_teachers_folder_spelt_otherwise_are_the_same_folders(
        make_config: Callable[..., Any], tmp_path: Path, tiny_teacher_dir: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """`student.init_from` of a student with a saved config, and the teacher folder a top-K store records: any
    spelling of the same folder is that folder (a trailing slash, relative, a link); another folder is not."""
    from kdflow.schemas.store_info import same_teacher_settings, teacher_section

    monkeypatch.chdir(tiny_teacher_dir.parent)
    (tmp_path / "linked").symlink_to(tiny_teacher_dir)
    spellings = [f"{tiny_teacher_dir}/", f"./{tiny_teacher_dir.name}", str(tmp_path / "linked")]
    config = make_config(student__init_from=str(tiny_teacher_dir), student__name="s")
    run_root = open_run_root(config)
    folder = run_root.path("students", "s")
    write_stage_config(run_root, config, folder)  # as training writes it beside the checkpoints
    for spelling in spellings:
        given = make_config(student__init_from=spelling, student__name="s")
        taken, (note,) = with_stored_spellings(given)
        assert taken.student.init_from == str(tiny_teacher_dir) and "so the student resumes" in note, note
        assert same_teacher_settings(teacher_section(config.teacher),
                                     teacher_section(given.teacher.model_copy(update={"model": spelling})))
    other = tmp_path / "other-teacher"
    other.mkdir()
    elsewhere = make_config(student__init_from=str(other), student__name="s")
    assert with_stored_spellings(elsewhere) == (elsewhere, [])  # another folder: refused later, as before
    assert not same_teacher_settings(teacher_section(config.teacher),
                                     teacher_section(config.teacher.model_copy(update={"model": str(other)})))
    assert not same_teacher_settings(teacher_section(config.teacher), teacher_section(
        config.teacher.model_copy(update={"dtype": "bfloat16"})))  # the same folder, another setting
