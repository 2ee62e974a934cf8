"""Where the text sits in a record: `dataset.text_field` as a dotted path into nested records (`meta.body`: JSON
objects, Parquet structs, saved datasets' nested features; a field whose own name holds the dots is taken first),
and `dataset.json_field` for a .json file whose records sit under a key. Through the pre-flight look
(`probe_dataset`) and materialise."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.corpus import DOCS, committed_documents

from kdflow.schemas.errors import ConfigError
from kdflow.schemas.stage_settings import materialise_settings, open_run_root
from kdflow.tasks.corpus.fields import field_names, field_value
from kdflow.tasks.corpus.materialise import materialise
from kdflow.tasks.corpus.probe import probe_dataset
from kdflow.tasks.corpus.records import DataError

NESTED = [{"id": i, "meta": {"body": doc, "source": {"site": "example.org"}}} for i, doc in enumerate(DOCS)]


def test_the_named_field_comes_first_then_the_dotted_path() -> None:
    record = {"meta.body": "literal", "meta": {"body": "nested", "n": 1}, "list": [{"a": 1}]}
    assert field_value(record, "meta.body") == "literal"
    assert field_value({"meta": record["meta"]}, "meta.body") == "nested"
    assert field_value(record, "meta") == {"body": "nested", "n": 1}
    for absent in ("meta.title", "meta.body.x", "list.a", "meta..body", "", "body"):
        with pytest.raises(KeyError):
            field_value({"meta": record["meta"], "list": record["list"]}, absent)
    assert field_names(record) == ["list", "meta.body", "meta.body", "meta.n"]
    assert field_names({f"f{i:02d}": None for i in range(50)}, limit=5) == ["f00", "f01", "f02", "f03", "46 more"]


def _write(folder: Path, kind: str) -> str:
    folder.mkdir()
    if kind == "jsonl":
        path = folder / "docs.jsonl"
        path.write_text("".join(json.dumps(record) + "\n" for record in NESTED))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "docs.parquet"
        pq.write_table(pa.Table.from_pylist(NESTED), path)
    else:
        import datasets

        path = folder / "saved"
        datasets.Dataset.from_list(NESTED).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_nested_text_field_gives_the_same_documents(make_config: Callable[..., Any], tmp_path: Path, kind: str,
                                                     streaming: bool) -> None:
    path = _write(tmp_path / "src", kind)
    config = make_config(dataset__path=path, dataset__text_field="meta.body", dataset__documents_per_part=4,
                         dataset__streaming=streaming)
    assert probe_dataset(config.dataset) is None
    assert materialise(open_run_root(config), materialise_settings(config)).documents == len(DOCS)
    assert committed_documents(config) == list(enumerate(DOCS))
    with pytest.raises(ConfigError) as caught:  # the fields listed are the ones a text_field can name
        probe_dataset(make_config(dataset__path=path, dataset__text_field="meta.title").dataset)
    assert str(caught.value).endswith("(its first record has: id, meta.body, meta.source.site)")


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_a_nested_record_named_as_the_text_is_refused_in_one_line(make_config: Callable[..., Any],
                                                                  tmp_path: Path, kind: str) -> None:
    config = make_config(dataset__path=_write(tmp_path / "src", kind), dataset__text_field="meta.source")
    with pytest.raises(ConfigError) as caught:
        probe_dataset(config.dataset)
    assert str(caught.value).endswith("is a nested record in " + config.dataset.path
                                      + ", not text (its fields: meta.source.site)")
    with pytest.raises(DataError) as caught:  # and materialise, run without the pre-flight look
        materialise(open_run_root(config), materialise_settings(config))
    assert str(caught.value) == ("dataset field 'meta.source' holds dict, not text (record 1 of the dataset, "
                                 "counting from 1)")


@pytest.mark.parametrize("indent", [None, 2])  # one line, or one document over many lines
@pytest.mark.parametrize("streaming", [False, True])
def test_records_under_a_key_of_a_json_file_are_read_with_json_field(make_config: Callable[..., Any], tmp_path: Path,
                                                                     indent: int | None, streaming: bool) -> None:
    path = tmp_path / "squad-like.json"
    path.write_text(json.dumps({"version": "1.1", "data": [{"text": doc, "n": i} for i, doc in enumerate(DOCS)]},
                               indent=indent))
    without = make_config(dataset__path=str(path))
    with pytest.raises(ConfigError) as caught:  # the error says which setting reads it
        probe_dataset(without.dataset)
    assert str(caught.value) == (f"dataset.text_field='text' is not a field of {path}, whose records sit under "
                                 "'data': set dataset.json_field: data")
    config = make_config(dataset__path=str(path), dataset__json_field="data", dataset__streaming=streaming,
                         dataset__documents_per_part=4)
    assert probe_dataset(config.dataset) is None
    assert materialise(open_run_root(config), materialise_settings(config)).documents == len(DOCS)
    assert committed_documents(config) == list(enumerate(DOCS))
    with pytest.raises(ConfigError, match=r"dataset.json_field='dat' is not a key of .*squad-like.json \(it has: "
                                          r"version, data\)$"):
        probe_dataset(make_config(dataset__path=str(path), dataset__json_field="dat").dataset)
    with pytest.raises(ConfigError, match=r"dataset.json_field='version': 'version' in .* holds a str, not a list"):
        probe_dataset(make_config(dataset__path=str(path), dataset__json_field="version").dataset)


def test_json_field_on_files_that_are_not_one_json_object_is_refused(make_config: Callable[..., Any],
                                                                     tmp_path: Path) -> None:
    lines = _write(tmp_path / "src", "jsonl")
    with pytest.raises(ConfigError) as caught:
        probe_dataset(make_config(dataset__path=lines, dataset__json_field="data").dataset)
    assert str(caught.value) == (f"dataset.json_field='data' applies to .json files holding one object with the "
                                 f"records under a key; {lines} is not one (remove json_field)")
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": "a"}]))
    with pytest.raises(ConfigError, match=r"holds a JSON list, not an object with the records under a key$"):
        probe_dataset(make_config(dataset__path=str(array), dataset__json_field="data").dataset)


@pytest.mark.parametrize(("kind", "holds"), [("jsonl", "int"), ("parquet", "int64"), ("saved", "int64")])
def test_a_text_field_that_holds_numbers_is_refused_before_the_run(make_config: Callable[..., Any], tmp_path: Path,
                                                                    kind: str, holds: str) -> None:
    """The first record's value, or the column's declared type where the file has a schema (Parquet, a saved
    dataset): an int column used to pass the pre-flight look and fail in materialise."""
    path = _write(tmp_path / "src", kind)
    with pytest.raises(ConfigError) as caught:
        probe_dataset(make_config(dataset__path=path, dataset__text_field="id").dataset)
    fix = " (its first record), not text: name a text field, or fix that record" if kind == "jsonl" else (
        ", not text: name a text field")
    assert str(caught.value) == (f"dataset.text_field='id' holds {holds} in {path}{fix} "
                                 "(its fields: id, meta.body, meta.source.site)")
    assert probe_dataset(make_config(dataset__path=path, dataset__text_field="meta.source.site").dataset) is None


def test_a_categorical_parquet_text_column_is_text(make_config: Callable[..., Any], tmp_path: Path) -> None:
    """A dictionary-encoded string column (pandas' category, written to Parquet) is read as text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "categorical.parquet"
    pq.write_table(pa.table({"text": pa.array(DOCS).dictionary_encode()}), path)
    config = make_config(dataset__path=str(path), dataset__documents_per_part=4)
    assert probe_dataset(config.dataset) is None
    assert materialise(open_run_root(config), materialise_settings(config)).documents == len(DOCS)
