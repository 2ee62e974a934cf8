"""A folder (or glob) of files whose columns differ, as real corpora gathered from several places are: one read casts
every file to the first file's columns and fails (`datasets`' CastError, a 269-line traceback), so the files are read
one at a time, each with its own columns, the records numbered across them as one read numbers them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.corpus import committed_documents, sample_documents, write_jsonl

from kdflow.schemas.stage_settings import materialise_settings, open_run_root
from kdflow.tasks.corpus.materialise import materialise
from kdflow.tasks.corpus.records import DataError, iter_records

DOCS = sample_documents(23)


def _mixed_jsonl(folder: Path) -> list[str]:
    """Three files: text + id, text + url + meta (a struct), text alone; the documents in file order."""
    write_jsonl(folder / "a.jsonl", [{"text": text, "id": i} for i, text in enumerate(DOCS[:7])])
    write_jsonl(folder / "b.jsonl", [{"url": f"u{i}", "text": text, "meta": {"lang": "en"}}
                                     for i, text in enumerate(DOCS[7:16])])
    write_jsonl(folder / "c.jsonl", DOCS[16:])
    return DOCS


def _mixed_parquet(folder: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    pq.write_table(pa.table({"text": DOCS[:10]}), folder / "a.parquet")
    pq.write_table(pa.table({"id": list(range(13)), "text": DOCS[10:]}), folder / "b.parquet")
    return DOCS


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("make", [_mixed_jsonl, _mixed_parquet])
def test_files_with_other_columns_are_read_one_at_a_time_in_order(make_config: Callable[..., Any], tmp_path: Path,
                                                                  make: Callable[[Path], list[str]],
                                                                  streaming: bool) -> None:
    expected = make(tmp_path / "mixed")
    config = make_config(dataset__path=str(tmp_path / "mixed"), dataset__streaming=streaming,
                         dataset__documents_per_part=5)
    summary = materialise(open_run_root(config), materialise_settings(config))
    assert summary.documents == len(expected) and summary.parts == 5
    assert [text for _, text in committed_documents(config)] == expected
    # A resume starts at any record, inside a file or at its first, as one read of the files numbers them.
    for start in (0, 3, 7, 10, 16, 22, len(expected)):
        assert list(iter_records(config.dataset, start)) == list(enumerate(expected))[start:], start


def test_a_record_that_is_no_text_names_its_file_and_its_record_there(make_config: Callable[..., Any],
                                                                       tmp_path: Path) -> None:
    write_jsonl(tmp_path / "mixed" / "a.jsonl", [{"text": text, "id": 1} for text in DOCS[:4]])
    write_jsonl(tmp_path / "mixed" / "b.jsonl", [{"text": "fine", "url": "u"}, {"text": 42, "url": "u"}])
    config = make_config(dataset__path=str(tmp_path / "mixed"))
    with pytest.raises(DataError) as caught:
        materialise(open_run_root(config), materialise_settings(config))
    assert str(caught.value) == (f"dataset field 'text' holds int, not text (record 2 of {tmp_path}/mixed/b.jsonl, "
                                 "counting from 1)")


def test_a_folder_of_two_formats_names_a_file_of_each(tmp_path: Path) -> None:
    from kdflow.schemas.config import DatasetConfig
    from kdflow.schemas.errors import ConfigError
    from kdflow.tasks.corpus.dataset_files import file_builder

    write_jsonl(tmp_path / "mixed" / "a.jsonl", DOCS[:2])
    (tmp_path / "mixed" / "b.txt").write_text("a line\n")
    with pytest.raises(ConfigError) as caught:
        file_builder(DatasetConfig(path=str(tmp_path / "mixed")))
    assert str(caught.value) == (f"dataset.path: files must share one format, found json ({tmp_path}/mixed/a.jsonl), "
                                 f"text ({tmp_path}/mixed/b.txt): keep one kind in the folder, or pick one with a glob "
                                 "(FOLDER/*.jsonl)")
