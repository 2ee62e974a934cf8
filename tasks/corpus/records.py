"""Reading a dataset's records in source order, as materialise takes them: one text a record, errors in one line.

Hub ids and files go through `datasets.load_dataset` (streamed when asked). The files of a folder or glob are read
as one dataset; where their columns differ (a second file with a field the first lacks, which `datasets` cannot
cast to the first file's columns), they are read file after file, each with its own columns, the records numbered
across them as before, so that a resume skips the same records either way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from kdflow.schemas.config import DatasetConfig
from kdflow.schemas.errors import ConfigError, KDFlowError
from kdflow.tasks.common.hub_access import object_store_reads
from kdflow.tasks.common.saved_datasets import load_saved_dataset
from kdflow.tasks.corpus.dataset_files import (DELIMITERS, SAVED, builders_quiet, csv_header, first_malformed_row,
                                              format_of, open_file, pandas_column_names, uncompressed)
from kdflow.tasks.corpus.dataset_files import file_builder as _file_builder
from kdflow.tasks.corpus.fields import field_names, field_value


class DataError(KDFlowError):
    """The source data cannot be read as documents."""


def open_source(dataset: DatasetConfig, only: list[str] | None = None) -> tuple[Any, list[str]]:
    """-> (datasets iterable in source order, the local files it reads or []); `only`: those of the dataset's
    files (one at a time, where their columns differ)."""
    import datasets

    files = _file_builder(dataset)
    if files is not None and files[0] == SAVED:
        return load_saved_dataset(files[1][0], dataset.split), []
    if files is not None:
        builder, data_files = files[0], only or files[1]
        # .txt: a document per line (the default), per paragraph or per file, as `dataset.sample_by` says
        options: dict[str, Any] = {"sample_by": dataset.sample_by} if builder == "text" else {}
        if dataset.json_field is not None:  # records under a key of one JSON object (checked in pre-flight)
            options = {"field": dataset.json_field}
        if builder in DELIMITERS:  # every column as text, as written: not a number, and 'NA' is not missing
            columns = pandas_column_names(csv_header(data_files[0], builder))
            options = dict(sep=DELIMITERS[builder], na_filter=False, encoding="utf-8-sig",
                           features=datasets.Features({name: datasets.Value("string") for name in columns}))
        with object_store_reads(data_files):  # s3://, gs://... while HF_HUB_OFFLINE keeps the hub away
            source = datasets.load_dataset("csv" if builder in DELIMITERS else builder, data_files=data_files,
                                           split=dataset.split, streaming=dataset.streaming, **options)
        local = [f for f in data_files if "://" not in f]
    else:
        source = datasets.load_dataset(
            dataset.path, dataset.name, data_files=dataset.data_files, split=dataset.split,
            streaming=dataset.streaming, revision=dataset.revision,
        )
        local = []
    return source, local


def _first_invalid_utf8(files: list[str]) -> str | None:
    for name in files:
        if format_of(name) == "parquet":
            continue
        with open_file(name) as handle:
            offset = 0
            for line_no, line in enumerate(handle, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as error:
                    return f"{name}: invalid UTF-8 at line {line_no}, byte {offset + error.start}"
                offset += len(line)
    return None


def _first_malformed_json(files: list[str]) -> str | None:
    """'FILE: line N is not valid JSON (why)' for the first JSON (lines) file with a line that does not parse."""
    for name in files:
        if format_of(name) != "json":
            continue
        with open_file(name, "rt", encoding="utf-8-sig", errors="replace") as handle:
            text = handle.read()
        if uncompressed(name).endswith(".json"):
            try:
                json.loads(text)
                continue  # one JSON document
            except ValueError as error:
                whole = error
            first = text.lstrip().split("\n", 1)[0]
            try:  # JSON lines in a .json file: report the line; else the document's own position
                json.loads(first)
            except ValueError:
                return (f"{name}: not valid JSON at line {getattr(whole, 'lineno', '?')}, "
                        f"column {getattr(whole, 'colno', '?')} ({whole.msg if hasattr(whole, 'msg') else whole})")
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError as error:
                return (f"{name}: line {line_no} is not valid JSON ({getattr(error, 'msg', error)}: "
                        f"column {getattr(error, 'colno', '?')})")  # as json says it: "Expecting ...: column 5"
    return None


def _cause(error: BaseException | None, matches: Callable[[BaseException], bool]) -> BaseException | None:
    """`datasets` wraps errors of file builders (e.g. DatasetGenerationError): the first in the chain that
    `matches`, or None."""
    seen = 0
    while error is not None and seen < 16:
        if matches(error):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def _caused_by(error: BaseException | None, matches: Callable[[BaseException], bool]) -> bool:
    return _cause(error, matches) is not None


def _caused_by_invalid_utf8(error: BaseException | None) -> bool:
    return _caused_by(error, lambda e: isinstance(e, UnicodeDecodeError))


def _caused_by_bad_json(error: BaseException | None) -> bool:
    return _caused_by(error, lambda e: "JSON parse error" in str(e) or isinstance(e, json.JSONDecodeError))


def _caused_by_no_data(error: BaseException | None) -> bool:
    """What `datasets` raises for files without a single record: StopIteration inside its generator, or
    'Instruction "train" corresponds to no data!'."""
    return _caused_by(error, lambda e: isinstance(e, StopIteration) or "corresponds to no data" in str(e))


def describe_source(dataset: DatasetConfig, files: list[str]) -> str:
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return f"dataset {dataset.path!r}" + (f" ({shown})" if files and shown != dataset.path else "")


def local_files(dataset: DatasetConfig) -> list[str]:
    try:
        files = _file_builder(dataset)
    except ConfigError:
        return []
    return [f for f in files[1] if "://" not in f] if files is not None else []


def iter_records(dataset: DatasetConfig, start: int) -> Iterator[tuple[int, str]]:
    """(source index, text) from record `start` on, in source order; errors name the problem in one line."""
    with builders_quiet():
        yield from _records(dataset, start)


def _records(dataset: DatasetConfig, start: int) -> Iterator[tuple[int, str]]:
    files = _file_builder(dataset)
    local_files = [f for f in files[1] if "://" not in f] if files is not None and files[0] != SAVED else []
    by_file = files is not None and files[0] != SAVED and len(files[1]) > 1
    position = [start]  # the index of the next record, across the files
    try:
        columns_differ = False
        try:
            # Inside the try: a non-streaming load decodes the files here, not while iterating.
            source, _ = open_source(dataset)
            for record in source.skip(start) if start else source:
                yield _taken(dataset, record, position, f"record {position[0] + 1} of the dataset")
        except Exception as error:
            if not (by_file and _caused_by(error, lambda e: type(e).__name__ == "CastError")):
                raise
            columns_differ = True
        if columns_differ:
            yield from _file_by_file(dataset, files[1], position)
    except KDFlowError:
        raise
    except Exception as error:
        if _caused_by_invalid_utf8(error):
            raise DataError(f"{_first_invalid_utf8(local_files) or 'dataset: invalid UTF-8 in the source'}; kdflow "
                            "reads UTF-8: convert it first (iconv -f ENCODING -t UTF-8)") from None
        if _caused_by_bad_json(error):
            where = _first_malformed_json(local_files)
            raise DataError(f"dataset file {where}" if where else
                            f"{describe_source(dataset, local_files)}: not valid JSON: {str(error).splitlines()[0]}"
                            ) from None
        if parser_error := _cause(error, lambda e: type(e).__name__ == "ParserError"):  # pandas', reading CSV/TSV
            where = first_malformed_row(local_files)
            raise DataError(f"dataset file {where}" if where else
                            f"{describe_source(dataset, local_files)}: not valid CSV: "
                            f"{str(parser_error).splitlines()[0]}") from None
        if _caused_by_no_data(error) and position[0] == start:
            after = f" after record {start}" if start else ""
            raise DataError(f"{describe_source(dataset, local_files)} holds no records{after} "
                            f"(split {dataset.split!r})") from None
        raise


def _taken(dataset: DatasetConfig, record: dict[str, Any], position: list[int], where: str) -> tuple[int, str]:
    """(index, text) of `record`, the next one (`position` moves on); `where`: the record, for the errors."""
    try:
        text = field_value(record, dataset.text_field)
    except KeyError:
        raise DataError(f"dataset has no text field {dataset.text_field!r} (the fields of {where}: "
                        f"{', '.join(field_names(record))})") from None
    if text is not None and not isinstance(text, str):
        raise DataError(f"dataset field {dataset.text_field!r} holds {type(text).__name__}, not text ({where}, "
                        "counting from 1)")
    position[0] += 1
    # A byte-order mark (a file saved on Windows) is not text. The text builder keeps it at the start of a .txt
    # file's first document, whatever encoding it is given for a compressed file; JSON readers drop it.
    return position[0] - 1, (text or "").removeprefix("\ufeff")


def _file_by_file(dataset: DatasetConfig, names: list[str], position: list[int]) -> Iterator[tuple[int, str]]:
    """The files one at a time, each with its own columns (one read casts every file to the first file's columns,
    and fails where they differ), from record `position[0]` on, numbered across the files as one read numbers
    them; an error names the file and its record."""
    first = 0  # the index of the file's first record
    for name in names:
        source, _ = open_source(dataset, [name])
        count = len(source) if hasattr(source, "__len__") else None  # None: streamed, counted while read
        if count is not None and first + count <= position[0]:
            first += count
            continue
        seen = 0
        for seen, record in enumerate(source, start=1):
            if first + seen > position[0]:
                yield _taken(dataset, record, position, f"record {seen} of {name}")
        first += seen
