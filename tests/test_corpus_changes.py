"""A dataset's files changed after materialise read them (`corpus/_sources.json`): the next run names the change in
pre-flight and in materialise itself, instead of resuming or skipping with stores made from the old text. A copy or
a `touch` with the same bytes is no change; a store made before the record existed is not checked."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.corpus import DOCS, write_jsonl

from kdflow.schemas.dataset_record import DatasetRecord
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.layout import CONFIG_FILE, CORPUS_DIR, SOURCES_FILE
from kdflow.schemas.stage_settings import materialise_settings, open_run_root
from kdflow.tasks.corpus.materialise import materialise
from kdflow.tasks.corpus.records import DataError
from kdflow.tasks.preflight import run_preflight


def _refused(config: Any) -> str:
    """The line pre-flight and materialise both give (the same one)."""
    with pytest.raises(ConfigError) as by_preflight:
        run_preflight(config, "materialise")
    with pytest.raises(ConfigError) as by_stage:
        materialise(open_run_root(config), materialise_settings(config))
    assert str(by_preflight.value) == str(by_stage.value)
    return str(by_stage.value)


def _status_line(config: Any, capsys: pytest.CaptureFixture[str]) -> str:
    from kdflow.commands.status import print_status

    capsys.readouterr()
    assert print_status(config.run_root) == 0
    label = f"{CORPUS_DIR}/{SOURCES_FILE}"
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(label))
    return " ".join(line.split(None, 1))  # the label's padding out


def test_an_edited_added_or_removed_file_is_named_and_the_same_bytes_are_no_change(
        make_config: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "src"
    first = write_jsonl(folder / "a.jsonl", DOCS[:6])
    write_jsonl(folder / "b.jsonl", DOCS[6:])
    config = make_config(dataset__path=str(folder), dataset__documents_per_part=4)
    assert materialise(open_run_root(config), materialise_settings(config)).documents == len(DOCS)
    store = os.path.join(config.run_root, CORPUS_DIR)
    assert os.path.exists(os.path.join(store, SOURCES_FILE))
    assert run_preflight(config, "materialise") == []
    assert materialise(open_run_root(config), materialise_settings(config)).parts_written == 0

    original = first.read_bytes()
    os.utime(first, ns=(1, 1))  # the same bytes, another modification time (a copy, a touch): hashed, no change
    assert run_preflight(config, "materialise") == []
    assert materialise(open_run_root(config), materialise_settings(config)).parts_written == 0
    recorded = DatasetRecord.model_validate_json(Path(store, SOURCES_FILE).read_bytes())
    assert [f.mtime_ns for f in recorded.files if f.name == str(first)] == [1]  # hashed once, not every run

    first.write_bytes(original + b'{"text": "one more"}\n')
    size = len(original)
    assert _refused(config) == (
        f"the dataset's files changed since materialise read them into {store} ({first}: {size:,} -> "
        f"{size + 21:,} bytes): this run root's stores hold the old text and a rerun would not read the change; put "
        "the files back as they were, or give the changed corpus a new run_root")
    first.write_bytes(original.replace(b"word", b"ward", 1))  # same size, other bytes
    assert f"({first}: other bytes, same size)" in _refused(config)
    assert (f"the dataset's files changed since materialise read them into {store} ({first}: other bytes, same "
            "size); this run's stages use the corpus store as it was made, and a run with materialise will refuse the "
            "change") in run_preflight(config, "tokenise")  # a stage that reads the store: warned, not refused
    assert _status_line(config, capsys) == (  # kdflow status says it too, from the record alone
        f"corpus/_sources.json 2 files, CHANGED since materialise read them: {first}: other bytes, same size; "
        "the next run with materialise refuses (put the files back, or give the changed corpus a new run_root)")
    from kdflow.commands.validate import validate_run_root

    assert validate_run_root(config.run_root) == 0  # the stores are whole; it says what status says, as a note
    assert f"  note: _sources.json: 2 files, CHANGED since materialise read them: {first}" in capsys.readouterr().out
    first.write_bytes(original)
    assert materialise(open_run_root(config), materialise_settings(config)).parts_written == 0  # put back as it was
    assert _status_line(config, capsys) == "corpus/_sources.json 2 files as materialise read them"

    extra = write_jsonl(folder / "c.jsonl", ["a new document"])
    assert f"({extra} added)" in _refused(config)
    extra.unlink()
    (folder / "b.jsonl").unlink()
    assert f"({folder / 'b.jsonl'} removed)" in _refused(config)
    assert f"CHANGED since materialise read them: {folder / 'b.jsonl'} removed;" in _status_line(config, capsys)
    first.unlink()  # nothing of the source is left: a complete store does not need it
    assert run_preflight(config, "materialise") == []
    assert materialise(open_run_root(config), materialise_settings(config)).parts_written == 0
    gone = " 2 files, none found here (a complete corpus store does not need them)"
    assert _status_line(config, capsys).endswith(gone)


def test_a_store_without_the_record_or_of_another_fingerprint_is_not_checked(
        make_config: Callable[..., Any], tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    config = make_config(dataset__path=str(source), dataset__documents_per_part=4)
    materialise(open_run_root(config), materialise_settings(config))
    record = Path(config.run_root) / CORPUS_DIR / SOURCES_FILE
    record.unlink()  # as a store made before the record existed
    write_jsonl(source, DOCS + ["added later"])
    assert run_preflight(config, "materialise") == []
    assert materialise(open_run_root(config), materialise_settings(config)).parts_written == 0
    assert not record.exists()  # parts made from unknown files: no record is made up for them

    other = make_config(dataset__path=str(source), dataset__documents_per_part=5)  # another fingerprint: a new store
    assert materialise(open_run_root(other), materialise_settings(other)).documents == len(DOCS) + 1
    assert run_preflight(other, "materialise") == []
    write_jsonl(source, DOCS)
    assert "-> " in _refused(other)


def test_a_saved_dataset_is_recorded_file_by_file(make_config: Callable[..., Any], tmp_path: Path) -> None:
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(folder))
    config = make_config(dataset__path=str(folder), dataset__documents_per_part=4)
    materialise(open_run_root(config), materialise_settings(config))
    datasets.Dataset.from_dict({"text": DOCS[:3]}).save_to_disk(str(tmp_path / "tmp"))
    for name in os.listdir(tmp_path / "tmp"):
        os.replace(tmp_path / "tmp" / name, folder / name)
    assert "data-00000-of-00001.arrow: " in _refused(config)


def test_a_first_run_that_failed_before_any_part_reads_the_fixed_file(
        make_config: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "a good line"}\n{"text": "broken\n{"text": "another good line"}\n')
    config = make_config(dataset__path=str(source))
    with pytest.raises(DataError, match=r"line 2 is not valid JSON \(Unterminated string starting at: column 10\)"):
        materialise(open_run_root(config), materialise_settings(config))
    assert (Path(config.run_root) / CORPUS_DIR / SOURCES_FILE).exists()  # taken before reading, no part made
    write_jsonl(source, DOCS)  # the user fixes the file: nothing was made from the old bytes, nothing to refuse
    assert run_preflight(config, "materialise") == []
    assert materialise(open_run_root(config), materialise_settings(config)).documents == len(DOCS)
    assert _status_line(config, capsys).endswith(" 1 file as materialise read them")
    write_jsonl(source, DOCS[:3])  # from the first part on, the record binds
    assert "docs.jsonl: " in _refused(config)


def test_the_fix_of_a_record_that_stopped_materialise_is_read_from_the_start(
        make_config: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A bad record stopped materialise after its first part; the fixed file was then refused ("a rerun would not
    read the change"), though nothing was made from an unfinished store: the run root had to be thrown away."""
    import json

    source = tmp_path / "docs.jsonl"
    records = [{"text": text} for text in DOCS[:12]]
    source.write_text("".join(json.dumps({"text": 12345} if i == 8 else r) + "\n" for i, r in enumerate(records)))
    config = make_config(dataset__path=str(source), dataset__documents_per_part=5)
    with pytest.raises(DataError, match="holds int, not text"):
        materialise(open_run_root(config), materialise_settings(config))
    store = Path(config.run_root, CORPUS_DIR)
    assert sorted(p.name for p in store.glob("*.commit.json")) == ["part-00000.commit.json"]

    source.write_text("".join(json.dumps(r) + "\n" for r in records))  # fixed
    assert run_preflight(config, "materialise") == []
    assert _status_line(config, capsys).endswith("it had not finished, so the next run reads them again from the start")
    with caplog.at_level("WARNING", logger="kdflow.tasks.corpus.dataset_changes"):
        summary = materialise(open_run_root(config), materialise_settings(config))
    assert (summary.documents, summary.parts_written) == (len(records), 3)
    assert any("and it had not finished: its 1 committed part is read again" in r.getMessage() for r in caplog.records)
    assert run_preflight(config, "materialise") == []  # finished now: the record holds the fixed file
    source.write_text(source.read_text() + json.dumps({"text": "one more"}) + "\n")
    assert "changed since materialise read them" in _refused(config)  # a finished store's change is still refused


def test_status_notes_a_student_trained_on_a_corpus_since_replaced(make_config: Callable[..., Any],
                                                                   tmp_path: Path) -> None:
    from kdflow.schemas.config_io import dump_config
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.run_status import status_lines

    first = make_config(dataset__path=str(write_jsonl(tmp_path / "one.jsonl", DOCS)))
    materialise(open_run_root(first), materialise_settings(first))
    student = Path(first.run_root) / "students" / first.student.name
    student.mkdir(parents=True)
    (student / CONFIG_FILE).write_text(dump_config(first))  # what training writes beside the student
    note = "  trained on another corpus than corpus/ holds now: a rerun of it is refused (another student.name)"
    assert note not in list(status_lines(RunRoot(first.run_root)))
    other = make_config(dataset__path=str(write_jsonl(tmp_path / "two.jsonl", DOCS[:4])))
    materialise(open_run_root(other), materialise_settings(other))  # the same run root, another dataset
    lines = list(status_lines(RunRoot(first.run_root)))
    assert lines[lines.index(note) - 1].startswith(f"students/{first.student.name}"), lines
