"""A quick look at the dataset before anything runs: do its files exist, and does the first record hold the
text field? For local (and fsspec) files only the first record is read; a hub dataset is opened in streaming
mode for its first record. Used by the pre-flight checks (kdflow.tasks.preflight); the full read is materialise's.
"""

from __future__ import annotations

import csv
import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from kdflow.schemas.config import DatasetConfig
from kdflow.schemas.errors import ConfigError, first_line
from kdflow.tasks.common.model_files import from_cwd
from kdflow.tasks.common.saved_datasets import load_saved_dataset
from kdflow.tasks.corpus.dataset_files import DELIMITERS, SAVED, csv_header, file_builder, open_file, uncompressed
from kdflow.tasks.corpus.fields import arrow_shape, features_shape, field_names, field_value, has_field, not_text

HUB_PROBE_TIMEOUT_S = 30.0
WHOLE_JSON_PROBE_BYTES = 64 << 20  # a local JSON file laid out over many lines is read whole up to this size


def _first_json_record(handle: Any, name: str) -> dict[str, Any] | None:
    """The first record of a JSON-lines file (or of a JSON array/object file, when small enough), else None."""
    for line_no, line in enumerate(handle, start=1):
        text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
        if line_no == 1:
            text = text.removeprefix("\ufeff")  # a byte-order mark (files saved on Windows): datasets skips it too
        if not text.strip():
            continue
        stripped = text.strip()
        try:
            record = json.loads(stripped)
        except ValueError as error:
            if stripped.startswith("[") or stripped in ("{",):  # one JSON document over many lines: not probed
                return None
            raise ConfigError(f"dataset file {name}: line {line_no} is not valid JSON "
                              f"({getattr(error, 'msg', error)})") from None
        if isinstance(record, list):
            record = record[0] if record else None
        if record is not None and not isinstance(record, dict):
            raise ConfigError(f"dataset file {name}: line {line_no} is a JSON {type(record).__name__}, "
                              "not an object with fields")
        return record
    raise ConfigError(f"dataset file {name} is empty: no documents to read")


def _first_record_under(handle: Any, name: str, key: str) -> dict[str, Any]:
    """The first record of the list under `key` in a JSON file holding one object (`dataset.json_field`)."""
    data = handle.read()
    text = (data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data).removeprefix("\ufeff")
    setting = f"dataset.json_field={key!r}"
    try:
        document = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"dataset file {name} is not valid JSON ({getattr(error, 'msg', error)}"
                          + (f" at line {error.lineno})" if isinstance(error, json.JSONDecodeError) else ")")) from None
    if not isinstance(document, dict):
        raise ConfigError(f"{setting}: {name} holds a JSON {type(document).__name__}, not an object with the "
                          "records under a key")
    if key not in document:
        raise ConfigError(f"{setting} is not a key of {name} (it has: {', '.join(map(str, document)) or 'none'})")
    records = document[key]
    if not isinstance(records, list) or (records and not isinstance(records[0], dict)):
        held = type(records).__name__ if not isinstance(records, list) else f"list of {type(records[0]).__name__}"
        raise ConfigError(f"{setting}: {key!r} in {name} holds a {held}, not a list of records with fields")
    if not records:
        raise ConfigError(f"dataset file {name}: {key!r} holds no records")
    return records[0]


def _first_of_whole(name: str) -> dict[str, Any] | None:
    """The object of a JSON file holding one (or the first object of an array), read whole; None when it is neither
    (materialise names what is wrong)."""
    with open_file(name) as handle:
        data = handle.read()
    try:
        document = json.loads((data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data)
                              .removeprefix("\ufeff"))
    except ValueError:
        return None
    if isinstance(document, list):
        document = document[0] if document else None
    return document if isinstance(document, dict) else None


def _records_under(record: dict[str, Any]) -> str | None:
    """The key of a JSON object whose value looks like the file's records (a list of objects), if any."""
    return next((str(k) for k, v in record.items() if isinstance(v, list) and v and isinstance(v[0], dict)), None)


def _check_encoding(name: str, sample: int = 1 << 16) -> None:
    """The file's start is UTF-8, as datasets' JSON and text readers take it (a UTF-8 byte-order mark is fine)."""
    with open_file(name) as handle:
        head = handle.read(sample)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"dataset file {name} is UTF-16 (it starts with a UTF-16 byte-order mark); kdflow reads "
                          "UTF-8: convert it first (iconv -f UTF-16 -t UTF-8)")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        if len(head) < sample or error.start < len(head) - 3:  # not a character cut by the sample's end
            line = head[:error.start].count(b"\n") + 1
            raise ConfigError(f"dataset file {name}: invalid UTF-8 at line {line}, byte {error.start}; kdflow reads "
                              "UTF-8: convert it first (iconv -f ENCODING -t UTF-8)") from None


def _check_fields(shape: dict[str, Any], dataset: DatasetConfig, name: str, *, record: bool = False) -> None:
    """`shape`: the first record (`record`), or the fields a schema declares (kdflow.tasks.corpus.fields)."""
    if not has_field(shape, dataset.text_field):
        raise ConfigError(f"dataset.text_field={dataset.text_field!r} is not a field of {name} "
                          f"(its first record has: {', '.join(field_names(shape)) or 'no fields'})")
    nested = field_value(shape, dataset.text_field)
    if isinstance(nested, Mapping):
        inside = ", ".join(f"{dataset.text_field}.{n}" for n in field_names(nested))
        raise ConfigError(f"dataset.text_field={dataset.text_field!r} is a nested record in {name}, not text "
                          f"(its fields: {inside or 'none'})")
    kind = not_text(nested)
    if kind is not None:
        fix = "name a text field, or fix that record" if record else "name a text field"
        raise ConfigError(f"dataset.text_field={dataset.text_field!r} holds {kind} in {name}"
                          f"{' (its first record)' if record else ''}, not text: {fix} (its fields: "
                          f"{', '.join(field_names(shape))})")


def probe_file(name: str, builder: str, dataset: DatasetConfig, *, fields_only: bool = False) -> None:
    """One file: readable, its first record has the text field (`fields_only`: that alone, for the files after
    the first: their header, schema or first record)."""
    try:
        if builder == SAVED:
            data = load_saved_dataset(name, dataset.split)
            _check_fields(features_shape(data.features), dataset, name)
            if not data.num_rows:
                raise ConfigError(f"dataset {name!r} (split {dataset.split!r}) holds no records")
        elif builder == "parquet":
            import pyarrow.parquet as pq

            with open_file(name) as handle:
                shape = arrow_shape(pq.read_schema(handle))
            _check_fields(shape, dataset, name)
        elif builder in ("json", "text", *DELIMITERS) and not fields_only:
            _check_encoding(name)
        if builder in DELIMITERS:
            header = csv_header(name, builder)
            if not header:
                raise ConfigError(f"dataset file {name} is empty: no header row naming its columns")
            if dataset.text_field not in header:
                raise ConfigError(f"dataset.text_field={dataset.text_field!r} is not a column of {name} "
                                  f"(its header row has: {', '.join(header)})")
        elif builder == "json" and dataset.json_field is not None:
            with open_file(name) as handle:
                _check_fields(_first_record_under(handle, name, dataset.json_field), dataset, name, record=True)
        elif builder == "json":
            with open_file(name) as handle:
                record = _first_json_record(handle, name)
            if record is None and "://" not in name and os.path.getsize(name) <= WHOLE_JSON_PROBE_BYTES:
                record = _first_of_whole(name)  # one JSON document over many lines
            under = _records_under(record) if record is not None else None
            if under is not None and not has_field(record, dataset.text_field):
                raise ConfigError(f"dataset.text_field={dataset.text_field!r} is not a field of {name}, whose records "
                                  f"sit under {under!r}: set dataset.json_field: {under}")
            if record is not None:
                _check_fields(record, dataset, name, record=True)
        elif builder == "text" and dataset.text_field != "text":
            raise ConfigError(f"dataset.text_field={dataset.text_field!r}: a .txt file {name} has one field, 'text'")
        elif builder == "text" and not fields_only:
            with open_file(name) as handle:
                if not handle.read(1):
                    raise ConfigError(f"dataset file {name} is empty: no documents to read")
    except ConfigError:
        raise
    except (OSError, ValueError, ImportError, csv.Error) as error:
        raise ConfigError(f"dataset file {name} cannot be read: {first_line(error)}") from None


def probe_hub(dataset: DatasetConfig, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """The first record of a hub dataset, streamed; -> a warning when the hub did not answer in time."""
    outcome: dict[str, Any] = {}

    def first_record() -> None:
        try:
            import datasets

            source = datasets.load_dataset(dataset.path, dataset.name, data_files=dataset.data_files,
                                           split=dataset.split, streaming=True, revision=dataset.revision)
            outcome["record"] = next(iter(source), None)
        except BaseException as error:  # noqa: BLE001 - reported below, in one line
            outcome["error"] = error

    thread = threading.Thread(target=first_record, name="dataset-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return (f"dataset.path={dataset.path!r}: no first record within {timeout_s:.0f} s (slow hub?); "
                "materialise will tell")
    if "error" in outcome:
        raise ConfigError(f"dataset.path={dataset.path!r} cannot be read: {type(outcome['error']).__name__}: "
                          f"{first_line(outcome['error'])}")
    record = outcome.get("record")
    if record is None:
        raise ConfigError(f"dataset.path={dataset.path!r} split {dataset.split!r} holds no records")
    _check_fields(record, dataset, f"dataset {dataset.path!r}", record=True)
    return None


def probe_dataset(dataset: DatasetConfig) -> str | None:
    """Fail with one line naming the setting when the source cannot give documents; -> a warning or None."""
    path = dataset.path
    if (path.startswith(("/", ".", "~")) and not any(c in path for c in "*?[")
            and not os.path.exists(os.path.expanduser(path))):
        raise ConfigError(f"dataset.path={path!r} does not exist{from_cwd(path)}")  # a local path, not a hub id
    files = file_builder(dataset)  # raises ConfigError for missing files or mixed formats
    if dataset.json_field is not None:
        other = (dataset.path if files is None else
                 next((n for n in files[1] if not uncompressed(n).endswith(".json")), None))
        if other is not None:
            raise ConfigError(f"dataset.json_field={dataset.json_field!r} applies to .json files holding one object "
                              f"with the records under a key; {other} is not one (remove json_field)")
    if files is None:
        from kdflow.tasks.common.hub_access import hub_dataset_problem

        problem = hub_dataset_problem(dataset.path)
        if problem:
            raise ConfigError(problem)
        return probe_hub(dataset)
    builder, names = files
    if not names:
        raise ConfigError(f"dataset.path={dataset.path!r}: no data files found")
    if dataset.sample_by != "line" and builder != "text":
        raise ConfigError(f"dataset.sample_by={dataset.sample_by!r} applies to .txt files; {names[0]} is "
                          f"{'a saved dataset' if builder == SAVED else builder}, whose records are the documents")
    probe_file(names[0], builder, dataset)  # the first file in full: format, encoding, fields
    missing = [name for name in names if "://" not in name and not os.path.exists(name)]
    if missing:
        raise ConfigError(f"dataset file not found: {missing[0]}")
    # Every other local file's fields too (a header, a schema, a first line each): a later file without the text
    # field failed inside materialise as "DatasetGenerationError: An error occurred while generating the dataset".
    for name in names[1:]:
        if "://" not in name:
            probe_file(name, builder, dataset, fields_only=True)
    return None
