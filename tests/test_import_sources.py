"""Which files `kdflow store import` reads from a folder: a hub-style folder's train split, all of its numbered files
or none (`kdflow.tasks.teacher.logit_reader.source_files`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kdflow.schemas.errors import ConfigError
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
