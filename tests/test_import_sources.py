"""Which files `kdflow store import` reads from a folder: a hub-style folder's train split, all of its numbered files
or none (`kdflow.tasks.teacher.logit_reader.source_files`); and where its messages say a bad row is."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.import_sources import capture_table, import_config, write_parts

from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.tasks.teacher.logit_import import import_store
from kdflow.tasks.teacher.logit_reader import source_files


def _write(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), folder / name)


def test_a_folder_of_several_splits_is_read_as_its_train_split_and_says_so(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    _write(tmp_path / "hub" / "data", "test-00000-of-00001.parquet", "train-00000-of-00002-4f1a9c.parquet",
           "train-00001-of-00002-77b0de.parquet", "validation-00000-of-00001.parquet")
    (tmp_path / "hub" / "README.md").write_text("# a dataset card\n")
    with caplog.at_level(logging.INFO, logger="kdflow.import"):
        files = source_files(str(tmp_path / "hub")).files
    assert [Path(f).name for f in files] == ["train-00000-of-00002-4f1a9c.parquet",
                                            "train-00001-of-00002-77b0de.parquet"]
    assert "holds the splits test, train, validation: reading train" in caplog.text

    _write(tmp_path / "eval", "test-00000-of-00001.parquet", "validation-00000-of-00001.parquet")
    with pytest.raises(ConfigError, match="holds the splits test, validation and no train: import one split's"):
        source_files(str(tmp_path / "eval"))
    _write(tmp_path / "one", "test-00000-of-00001.parquet")  # a single split, whatever its name: all of it
    assert len(source_files(str(tmp_path / "one")).files) == 1


def test_numbered_files_must_all_be_there_hashed_names_too(tmp_path: Path) -> None:
    _write(tmp_path / "partial", "train-00000-of-00003-4f1a9c.parquet", "train-00002-of-00003-9e0b11.parquet")
    with pytest.raises(ConfigError, match="holds 2 of the 3 files named train-NNNNN-of-00003 in .*: a copy or export"):
        source_files(str(tmp_path / "partial"))
    _write(tmp_path / "plain", "part-0.parquet", "part-7.parquet")  # not numbered that way: read as they are
    assert len(source_files(str(tmp_path / "plain")).files) == 2


def test_a_glob_reads_its_matches_in_order_and_one_that_matches_nothing_is_one_line(tmp_path: Path) -> None:
    from kdflow.tasks.teacher.logit_reader import source_fingerprint

    _write(tmp_path / "caps", "b-1.parquet", "a-2.parquet", "a-1.parquet", "notes.parquet")
    _write(tmp_path / "caps" / "more", "a-3.parquet")
    source = source_files(str(tmp_path / "caps" / "a-*.parquet"))
    assert (source.kind, [Path(f).name for f in source.files]) == ("parquet", ["a-1.parquet", "a-2.parquet"])
    assert [Path(f).name for f in source_files(str(tmp_path / "caps" / "**" / "a-*.parquet")).files] == [
        "a-1.parquet", "a-2.parquet", "a-3.parquet"]
    assert source_fingerprint(source) == source_fingerprint(source_files(str(tmp_path / "caps" / "a-[12].parquet")))
    with pytest.raises(ConfigError, match=r"^import source '.*/caps/c-\*\.parquet' matches no file$"):
        source_files(str(tmp_path / "caps" / "c-*.parquet"))


def _import(config, source: Path) -> dict:
    return import_store(open_run_root(config), teacher_pass_settings(config), str(source), "kdflow", "t")


def test_a_bad_row_or_line_of_json_lines_or_a_saved_dataset_is_found_where_a_person_looks(make_config,
                                                                                         tmp_path: Path) -> None:
    """JSON lines: the line of its file (from 1, as editors count); a saved dataset: its index (`dataset[N]`); a
    line that is no JSON: the file and how far it was read."""
    import datasets

    table = capture_table(40, 20)
    rows = table.column("topk_ids").to_pylist()
    rows[37][3][2] = 10**6
    bad = table.set_column(1, "topk_ids", pa.array(rows))
    lines = [json.dumps(row) + "\n" for row in bad.to_pylist()]
    (tmp_path / "js").mkdir()
    (tmp_path / "js" / "a.jsonl").write_text("".join(lines[:13]))
    (tmp_path / "js" / "b.jsonl").write_text("".join(lines[13:]))
    datasets.Dataset.from_list(bad.to_pylist()).save_to_disk(str(tmp_path / "saved"), num_shards=3)
    found = {}
    for name in ("js", "saved"):
        with pytest.raises(StoreError) as error:
            _import(import_config(make_config, tmp_path / f"run-{name}"), tmp_path / name)
        found[name] = str(error.value).split(" field ")[0]
    assert found == {"js": "row 37 (counting from 0; line 25 of b.jsonl)",
                     "saved": "row 37 (counting from 0; the dataset's index)"}

    (tmp_path / "js" / "b.jsonl").write_text("".join(lines[13:20]) + lines[20][:-40] + "\n")  # a line cut short
    with pytest.raises(StoreError) as error:
        _import(import_config(make_config, tmp_path / "run-cut"), tmp_path / "js")
    assert str(error.value).startswith(f"cannot read import source file {str(tmp_path / 'js' / 'b.jsonl')!r}: line "
                                       "8 is not valid JSON: JSON parse error: "), str(error.value)
    # Deep in a file that is parsed block by block: the line counts every block before the one that failed.
    from kdflow.tasks.teacher.logit_reader import iter_source, source_files

    (tmp_path / "deep.jsonl").write_text("".join(lines[:30]) + lines[30][:-40] + "\n" + "".join(lines[31:]))
    with pytest.raises(StoreError, match=r": line 31 is not valid JSON: JSON parse error: "):
        list(iter_source(source_files(str(tmp_path / "deep.jsonl")), json_block_bytes=len(lines[0]) * 3))


def test_a_glob_of_a_folders_files_imports_what_the_folder_imports(make_config, tmp_path: Path) -> None:
    folder = write_parts(tmp_path / "src", capture_table(30, 20), [13])
    by_folder = _import(import_config(make_config, tmp_path / "folder"), folder)
    by_glob = _import(import_config(make_config, tmp_path / "glob"), folder / "part-*.parquet")
    assert by_glob["tag"] == by_folder["tag"] and by_glob["shards"] == by_folder["shards"] > 0
    for store in ("tokens", f"topk/{by_folder['tag']}"):
        shards = sorted(p for p in (tmp_path / "folder" / store).glob("shard-*") if p.suffix != ".json")  # data
        assert shards and [p.read_bytes() for p in shards] == [
            (tmp_path / "glob" / store / p.name).read_bytes() for p in shards]
