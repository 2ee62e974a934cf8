"""Which files a dataset config names, and in which format: resolved without reading them (no `datasets`, no
pyarrow), so that the pre-flight checks and materialise agree on what the source is.

JSON, CSV and text files may be compressed (`docs.jsonl.gz`, `part-0001.jsonl.zst`, `notes.txt.bz2`, `.xz`), as
many corpora are shipped: `datasets` decompresses them as it reads, and so does `open_file` for the checks here.
CSV (`.csv`) and tab-separated (`.tsv`) files have a header row naming their columns; every column reads as text.
"""

from __future__ import annotations

import csv
import glob
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kdflow.schemas.config import DatasetConfig
from kdflow.schemas.errors import ConfigError
from kdflow.tasks.common.model_files import from_cwd
from kdflow.tasks.common.saved_datasets import is_saved_dataset

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv", ".txt": "text"}
DELIMITERS = {"csv": ",", "tsv": "\t"}  # `datasets`' csv builder reads both, given the delimiter
COMPRESSIONS = {".gz": None, ".bz2": None, ".xz": None, ".zst": "zstandard"}  # suffix -> the module it needs
FORMATS = ".jsonl, .json, .parquet, .csv, .tsv or .txt; all but Parquet also compressed: .gz, .bz2, .xz, .zst"


def compression_of(name: str) -> str:
    """The file name's compression suffix (`.gz`, ...), or '' for an uncompressed file."""
    lowered = name.lower()
    return next((suffix for suffix in COMPRESSIONS if lowered.endswith(suffix)), "")


def uncompressed(name: str) -> str:
    """The file name in lower case without its compression suffix: `Docs.JSONL.gz` -> `docs.jsonl`."""
    lowered = name.lower()
    return lowered[:len(lowered) - len(compression_of(name))]


def format_of(name: str) -> str | None:
    """The builder for a file name (json, parquet, csv, tsv, text), compressed ones included; else None. `tsv` is
    `datasets`' csv builder with a tab delimiter."""
    plain = uncompressed(name)
    builder = next((b for ext, b in FILE_BUILDERS.items() if plain.endswith(ext)), None)
    if compression_of(name) and builder == "parquet":
        return None  # Parquet compresses inside the file
    return builder


def open_file(name: str, mode: str = "rb", **kwargs: Any) -> Any:
    """A source file (local or fsspec URL) opened through its compression, if any (a context manager)."""
    import fsspec

    return fsspec.open(name, mode, compression="infer", **kwargs)


def csv_header(name: str, builder: str) -> list[str]:
    """The column names in a CSV/TSV file's header row ([] for an empty file); a byte-order mark is not a name."""
    with open_file(name, "rt", encoding="utf-8-sig", errors="replace", newline="") as handle:
        return next(csv.reader(handle, delimiter=DELIMITERS[builder]), [])


def pandas_column_names(header: list[str]) -> list[str]:
    """The names pandas gives a header's columns (what `datasets`' csv builder reads): an empty one is 'Unnamed: I'
    (the index column of pandas' own `to_csv`), a repeated one 'NAME.1', 'NAME.2', ..."""
    names: list[str] = []
    for index, name in enumerate(header):
        name = name or f"Unnamed: {index}"
        repeat, unique = 0, name
        while unique in names:
            repeat += 1
            unique = f"{name}.{repeat}"
        names.append(unique)
    return names


def first_malformed_row(files: list[str]) -> str | None:
    """'FILE: line N has 3 fields, its header 2' (or an unclosed quote) for the first CSV/TSV file that pandas
    would refuse, read with the csv module; None when none is found."""
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))  # a document may be longer than its 128 KiB default
    for name in files:
        builder = format_of(name)
        if builder not in DELIMITERS:
            continue
        with open_file(name, "rt", encoding="utf-8-sig", errors="replace", newline="") as handle:
            reader = csv.reader(handle, delimiter=DELIMITERS[builder], strict=True)
            try:
                header = next(reader, [])
                for row in reader:
                    if row and len(row) != len(header):
                        return f"{name}: line {reader.line_num} has {len(row)} fields, its header {len(header)}"
            except csv.Error as error:
                opened = " (a quoted field never closed?)" if "end of data" in str(error) else ""
                return f"{name}: line {reader.line_num}: {error}{opened}"
    return None


def _check_compression(name: str) -> None:
    module = COMPRESSIONS.get(compression_of(name))
    if module is not None and importlib.util.find_spec(module) is None:
        raise ConfigError(f"dataset file {name} is {module}-compressed: install it (pip install {module})")


def _local_looking(name: str) -> bool:
    """A path no hub id looks like: a glob pattern, or one that starts at a folder or ends in one."""
    return any(c in name for c in "*?[") or name.startswith(("/", "./", "../")) or name.endswith(os.sep)


PACKAGED = ("json", "parquet", "text", "csv")  # `path` names a builder: `data_files` are the files themselves
SAVED = "saved"  # file_builder's name for a `save_to_disk` folder (read with `datasets.load_from_disk`)


def file_builder(dataset: DatasetConfig) -> tuple[str, list[str]] | None:
    """(builder, data_files) when the dataset is given as files, else None (a hub id, with or without `data_files`
    inside it: `datasets` resolves those on the hub). `data_files` inside a local folder `path` are relative to it,
    as `datasets.load_dataset(folder, data_files=...)` takes them. A `save_to_disk` folder is (SAVED, [folder])."""
    path = dataset.path if "://" in dataset.path else os.path.expanduser(dataset.path)  # `~`: the home folder
    if is_saved_dataset(path):
        if dataset.data_files is not None:
            raise ConfigError(f"dataset.data_files: {dataset.path!r} is a saved dataset (save_to_disk): it has no "
                              "files to pick; remove data_files")
        return SAVED, [path]
    if dataset.data_files is None:
        files, key, base = [path], "dataset.path", ""
    else:
        local_dir = "://" not in path and os.path.isdir(path)
        if dataset.path not in PACKAGED and not local_dir:
            return None
        names = [dataset.data_files] if isinstance(dataset.data_files, str) else list(dataset.data_files)
        base = path if local_dir else ""
        files = [n if "://" in n else os.path.join(base, os.path.expanduser(n)) for n in names]
        key = "dataset.data_files"
    builders = set()
    expanded: list[str] = []
    for name in files:
        builder = format_of(name)
        is_local_dir = "://" not in name and os.path.isdir(name)
        if builder is None and not is_local_dir:
            if dataset.data_files is not None or ("://" not in name and os.path.isfile(name)):
                raise ConfigError(f"{key}: cannot tell the format of {name!r} (use {FORMATS})")
            if "://" in name or not _local_looking(name):
                return None  # a hub dataset id
            matches = sorted(f for f in glob.glob(name, recursive=True) if os.path.isfile(f))  # `docs/*`, `./docs/`
            if not matches:
                raise ConfigError(f"{key}: no file matches {name!r}{from_cwd(name)}")
            unknown = next((f for f in matches if format_of(f) is None), None)
            if unknown is not None:
                raise ConfigError(f"{key}: cannot tell the format of {unknown!r}, which {name!r} matches (use "
                                  f"{FORMATS})")
            builders.update(format_of(f) for f in matches)
            expanded.extend(matches)
            continue
        if is_local_dir:  # by type, then by name: plain files in the order they were always read, compressed after
            for suffix in [*FILE_BUILDERS, *(ext + c for ext in FILE_BUILDERS for c in COMPRESSIONS)]:
                found = [f for f in sorted(glob.glob(os.path.join(name, f"**/*{suffix}"), recursive=True))
                         if os.path.isfile(f) and format_of(f)]
                builders.update(format_of(f) for f in found)
                expanded.extend(found)
            continue
        builders.add(builder)
        if "://" in name:
            expanded.append(name)
            continue
        matches = sorted(glob.glob(name, recursive=True))
        if not matches:
            pattern = os.path.relpath(name, base) if base else name
            raise ConfigError(f"{key}: no file matches {pattern!r}" + (f" in {base}" if base else from_cwd(name)))
        expanded.extend(matches)
    for name in expanded:
        _check_compression(name)
    if not builders:
        raise ConfigError(f"{key}: {dataset.path!r} holds no file kdflow reads ({FORMATS})")
    if len(builders) != 1:
        examples = {}  # a file of each format, to point at
        for name in expanded:
            examples.setdefault(format_of(name), name)
        found = ", ".join(f"{kind} ({examples[kind]})" if kind in examples else kind for kind in sorted(builders))
        raise ConfigError(f"{key}: files must share one format, found {found}: keep one kind in the folder, or pick "
                          "one with a glob (FOLDER/*.jsonl)")
    return builders.pop(), expanded


# datasets' file builders log a file they cannot parse at ERROR before raising, in their own words (a JSON line cut
# short reads as "Invalid encoding in string"); materialise names the file, line and problem itself.
_BUILDER_LOGGERS = tuple(f"datasets.packaged_modules.{name}.{name}" for name in ("json", "csv", "parquet"))


@contextmanager
def builders_quiet() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _BUILDER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
