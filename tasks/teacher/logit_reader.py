"""Streaming reads of an import source: a local saved Hugging Face dataset folder (its Arrow files), Parquet files or
JSON lines, as record batches of at most `batch_rows` rows, never the whole table.

Files are read in a stable order (the dataset folder's own list; otherwise the sorted paths under the source), so
row numbers are the same on every run and in every message. Memory stays flat in the source's size: Parquet is
read by row group (`iter_batches`), JSON lines in blocks (`pyarrow.json.open_json`), a dataset's Arrow stream files
batch by batch from a plain file handle (not memory-mapped, so what was read is not kept mapped in the process).

`source_fingerprint` names the files' names, sizes and modification times: what the importer keys its staged work
by, so a rerun on an unchanged source picks up where a killed import stopped and a changed source starts over.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import pyarrow as pa

from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.tasks.common.saved_datasets import is_saved_dataset

BATCH_ROWS = 256  # at most this many rows per batch handed on ...
BATCH_BYTES = 64 << 20  # ... and about this many bytes of Arrow data (long rows of a large K: fewer rows)
JSON_BLOCK_BYTES = 32 << 20  # bytes of JSON lines parsed at a time: must hold the longest line (row)
# `train-00003-of-00104.parquet`, as the hub (with or without a hash after it) and `kdflow store export` name files
_NUMBERED = re.compile(r"^(.+?)-\d{5}-of-(\d{5})(?:-[0-9a-f]+)?\.(?:parquet|jsonl|json)$")
logger = logging.getLogger("kdflow.import")


@dataclass(frozen=True)
class SourceFiles:
    """The files of one import source, in reading order, and how they are read."""

    path: str
    kind: str  # "arrow" (a saved dataset folder), "parquet" or "jsonl"
    files: tuple[str, ...]
    extra: tuple[str, ...] = ()  # the dataset folder's metadata files: part of the fingerprint, not read as rows


def _saved_dataset_files(path: str) -> SourceFiles:
    """A `save_to_disk` folder: a Dataset's `state.json` lists its Arrow files in order; a DatasetDict's split
    `train` (else its first) is read, as `datasets.load_from_disk` would."""
    folder = path
    if not os.path.isfile(os.path.join(folder, "state.json")):
        with open(os.path.join(folder, "dataset_dict.json"), encoding="utf-8") as handle:
            splits = json.load(handle).get("splits") or []
        if not splits:
            raise StoreError(f"import source {path!r}: its dataset_dict.json names no split")
        split = "train" if "train" in splits else splits[0]
        if len(splits) > 1:
            logger.info("import: %s holds the splits %s: reading %s", path, ", ".join(splits), split)
        folder = os.path.join(path, split)
    with open(os.path.join(folder, "state.json"), encoding="utf-8") as handle:
        state = json.load(handle)
    if state.get("_indices_data_files"):
        raise StoreError(f"import source {path!r} is a dataset with an indices mapping; save it again after "
                         "`flatten_indices()`")
    files = tuple(os.path.join(folder, entry["filename"]) for entry in state.get("_data_files", []))
    extra = tuple(os.path.join(folder, name) for name in ("state.json", "dataset_info.json")
                  if os.path.isfile(os.path.join(folder, name)))
    return SourceFiles(path, "arrow", files, extra)


def source_files(path: str) -> SourceFiles:
    """The source's files in reading order (a glob's matches sorted, as a folder's); a one-line error for a path
    that is none of the three formats."""
    if not os.path.exists(path) and any(c in path for c in "*?["):
        files = sorted(name for name in glob.glob(path, recursive=True) if os.path.isfile(name))
        if not files:
            raise ConfigError(f"import source {path!r} matches no file")
    elif not os.path.exists(path):
        raise ConfigError(f"import source {path!r} does not exist")
    elif is_saved_dataset(path):
        return _saved_dataset_files(path)
    else:
        files = ([os.path.join(root, name) for root, dirs, names in sorted(os.walk(path)) for name in sorted(names)]
                 if os.path.isdir(path) else [path])
    parquet = tuple(f for f in files if f.endswith(".parquet"))
    jsonl = tuple(f for f in files if f.endswith((".jsonl", ".json")))
    _check_numbered(path, parquet or jsonl)
    if parquet:
        return SourceFiles(path, "parquet", _one_split(path, parquet))
    if jsonl:
        return SourceFiles(path, "jsonl", _one_split(path, jsonl))
    raise ConfigError(f"import source {path!r} is no dataset folder, Parquet or JSON lines file")


def _check_numbered(path: str, files: tuple[str, ...]) -> None:
    """Files named as the hub and `kdflow store export` number them (`train-00003-of-00104.parquet`) must all be
    there: a copy or an export that did not finish is refused, not imported as the part it holds."""
    groups: dict[tuple[str, str, int], int] = {}
    for name in files:
        if match := _NUMBERED.match(os.path.basename(name)):
            key = (os.path.dirname(name), match.group(1), int(match.group(2)))
            groups[key] = groups.get(key, 0) + 1
    for (folder, prefix, total), count in sorted(groups.items()):
        if count != total:
            raise ConfigError(f"import source {path!r} holds {count} of the {total} files named "
                              f"{prefix}-NNNNN-of-{total:05d} in {folder}: a copy or export that did not finish")


def _one_split(path: str, files: tuple[str, ...]) -> tuple[str, ...]:
    """A folder of numbered files of several splits (`train-*`, `test-*`, as the hub lays them out) is read as its
    `train` split, as a DatasetDict folder is, and says so; without a train split it is refused."""
    splits = {match.group(1) for name in files if (match := _NUMBERED.match(os.path.basename(name)))}
    if len(splits) < 2:
        return files
    if "train" not in splits:
        raise ConfigError(f"import source {path!r} holds the splits {', '.join(sorted(splits))} and no train: "
                          "import one split's files (a file or a folder of its own)")
    logger.info("import: %s holds the splits %s: reading train", path, ", ".join(sorted(splits)))
    return tuple(name for name in files if (m := _NUMBERED.match(os.path.basename(name))) and m.group(1) == "train")


def source_rows_total(source: SourceFiles) -> int | None:
    """How many rows the source holds, where its files say so without being read (Parquet's footers); else None."""
    if source.kind != "parquet":
        return None
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(name).metadata.num_rows for name in source.files)


def source_fingerprint(source: SourceFiles) -> str:
    """sha256 over the files' paths relative to the source, sizes and modification times (not their bytes:
    hashing a 100 GB source twice would cost more than the import)."""
    sha = hashlib.sha256(source.kind.encode())
    base = source.path if os.path.isdir(source.path) else os.path.dirname(source.path)
    for name in (*source.files, *source.extra):
        stat = os.stat(name)
        sha.update(f"{os.path.relpath(name, base)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return sha.hexdigest()


def _file_batches(kind: str, name: str, columns: list[str] | None, json_block_bytes: int) -> Iterator[pa.RecordBatch]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        # pre_buffer off: with it, iter_batches keeps every row group it read ahead until the file ends (measured:
        # the whole 410 MB of a 3M-position source held in Arrow's pool); off, memory stays at a row group or so.
        with pq.ParquetFile(name, pre_buffer=False) as reader:
            present = None if columns is None else [c for c in columns if c in reader.schema_arrow.names]
            yield from reader.iter_batches(batch_size=BATCH_ROWS, columns=present)
    elif kind == "jsonl":
        import pyarrow.json as pj

        reader = pj.open_json(name, read_options=pj.ReadOptions(block_size=json_block_bytes))
        for batch in reader:
            yield batch if columns is None else batch.select([c for c in columns if c in batch.schema.names])
    else:
        with pa.OSFile(name, "rb") as handle:
            for batch in pa.ipc.open_stream(handle):
                yield batch if columns is None else batch.select([c for c in columns if c in batch.schema.names])


def source_columns(source: SourceFiles, json_block_bytes: int = JSON_BLOCK_BYTES) -> list[str]:
    """The columns of the source's first file, all of them (what a message about a missing one lists)."""
    name = source.files[0]
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(name).names
    if source.kind == "jsonl":
        import pyarrow.json as pj

        return pj.open_json(name, read_options=pj.ReadOptions(block_size=json_block_bytes)).schema.names
    with pa.OSFile(name, "rb") as handle:
        return pa.ipc.open_stream(handle).schema.names


class SourceBatch(NamedTuple):
    first_row: int  # of the whole source, counted from 0
    batch: pa.RecordBatch
    file: str  # the file it was read from
    file_first_row: int  # the source's row at which that file starts


def iter_source(source: SourceFiles, columns: list[str] | None = None, start_row: int = 0,
                batch_rows: int = BATCH_ROWS, json_block_bytes: int = JSON_BLOCK_BYTES) -> Iterator[SourceBatch]:
    """Every row from `start_row` on, in order, in batches of at most `batch_rows` rows and about BATCH_BYTES, each
    with the file it came from.

    `columns`: read only these (those a file lacks are left out; the caller checks which it needs). Rows before
    `start_row` are read past without being handed on (a resumed import). `json_block_bytes` must hold the longest
    line of a JSON lines source."""
    row = 0
    for name in source.files:
        file_first_row = row
        try:
            for batch in _file_batches(source.kind, name, columns, json_block_bytes):
                per_row = batch.nbytes / max(batch.num_rows, 1)
                step = max(1, min(batch_rows, int(BATCH_BYTES // max(per_row, 1))))
                for offset in range(0, batch.num_rows, step):
                    piece = batch.slice(offset, step)
                    if row + piece.num_rows > start_row:
                        skip = max(0, start_row - row)
                        yield SourceBatch(row + skip, piece.slice(skip), name, file_first_row)
                    row += piece.num_rows
        except (OSError, ValueError, pa.ArrowInvalid) as error:
            read, problem = row - file_first_row, str(error).splitlines()[0]
            # pyarrow counts the rows of the block it parses, which begins where the rows handed on end
            in_block = re.search(r" in row (\d+)$", problem) if source.kind == "jsonl" else None
            if in_block is not None:
                raise StoreError(f"cannot read import source file {name!r}: line {read + int(in_block.group(1)) + 1:,}"
                                 f" is not valid JSON: {problem[:in_block.start()]}") from None
            raise StoreError(f"cannot read import source file {name!r} past its first {read:,} "
                             f"{'line' if source.kind == 'jsonl' else 'row'}{'' if read == 1 else 's'}: "
                             f"{problem}") from None


_ROW = re.compile(r"^row (\d+)")


def located(error: StoreError, source: SourceFiles, batch: SourceBatch) -> StoreError:
    """A row check's message ('row N ...', N the source's row counted from 0) with where a person finds that row:
    the line of a JSON lines file, the file and its row among several Parquet files. A saved dataset's Arrow files
    are its own business: its row number is the dataset's index (`dataset[N]`)."""
    found = _ROW.match(str(error))
    if found is None:
        return error
    row = int(found.group(1))
    local, name = row - batch.file_first_row, os.path.basename(batch.file)
    if source.kind == "jsonl":
        where = f"line {local + 1:,} of {name}"
    elif source.kind == "parquet" and len(source.files) > 1:
        where = f"row {local:,} of {name}"
    elif source.kind == "parquet":
        where = f"in {name}"
    else:
        where = "the dataset's index"
    return StoreError(f"row {row:,} (counting from 0; {where}){str(error)[found.end():]}")
