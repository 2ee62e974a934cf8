"""Materialise: documents from a hub dataset or local/remote files into committed Parquet parts.

Hub ids and files go through the same path (`datasets.load_dataset`, streamed when asked), read in
source order. Each part's commit record remembers how many source records were consumed, so a rerun
resumes after the last committed part, also in the middle of a stream.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kdflow.schemas.commits import (CommitRecord, CorpusCompleteInfo, CorpusPartInfo, StageComplete, committed_prefix,
                                    list_commits, read_complete, stage_dir, write_commit, write_complete)
from kdflow.schemas.config import DatasetConfig, KDFlowConfig
from kdflow.schemas.errors import ConfigError, KDFlowError
from kdflow.schemas.fingerprints import corpus_fingerprint
from kdflow.schemas.layout import data_file_name
from kdflow.schemas.shards import corpus_table, write_corpus_part
from kdflow.schemas.storage import RunRoot

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
CountTokens = Callable[[list[str]], list[int]]


class DataError(KDFlowError):
    """The source data cannot be read as documents."""


@dataclass
class MaterialiseSummary:
    parts: int
    documents: int
    tokens: int
    skipped_empty: int
    parts_written: int
    fingerprint: str
    extra: dict[str, Any] = field(default_factory=dict)


def _file_builder(dataset: DatasetConfig) -> tuple[str, list[str]] | None:
    """(builder, data_files) when the dataset is given as files, else None (a hub id)."""
    candidates = dataset.data_files if dataset.data_files is not None else dataset.path
    files = [candidates] if isinstance(candidates, str) else list(candidates)
    builders = set()
    expanded: list[str] = []
    for name in files:
        lowered = name.lower()
        builder = next((b for ext, b in FILE_BUILDERS.items() if lowered.endswith(ext)), None)
        is_local_dir = "://" not in name and os.path.isdir(name)
        if builder is None and not is_local_dir:
            if dataset.data_files is not None:
                raise ConfigError(f"dataset.data_files: cannot tell the format of {name!r} (use .jsonl, .json, .parquet or .txt)")
            return None
        if is_local_dir:
            for ext, b in FILE_BUILDERS.items():
                found = sorted(glob.glob(os.path.join(name, f"**/*{ext}"), recursive=True))
                if found:
                    builders.add(b)
                    expanded.extend(found)
            continue
        builders.add(builder)
        if "://" in name:
            expanded.append(name)
            continue
        matches = sorted(glob.glob(name, recursive=True))
        if not matches:
            raise ConfigError(f"dataset: no file matches {name!r}")
        expanded.extend(matches)
    if len(builders) != 1:
        raise ConfigError(f"dataset: files must share one format, found {sorted(builders) or 'none'}")
    if dataset.data_files is not None and dataset.path not in ("json", "parquet", "text", "csv"):
        # `path` names a hub dataset with explicit data files: keep the hub path.
        return None
    return builders.pop(), expanded


def open_source(dataset: DatasetConfig) -> tuple[Any, list[str]]:
    """-> (datasets iterable in source order, the local files it reads or [])."""
    import datasets

    files = _file_builder(dataset)
    if files is not None:
        builder, data_files = files
        source = datasets.load_dataset(builder, data_files=data_files, split=dataset.split, streaming=dataset.streaming)
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
        if name.lower().endswith(".parquet"):
            continue
        with open(name, "rb") as handle:
            offset = 0
            for line_no, line in enumerate(handle, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as error:
                    return f"{name}: invalid UTF-8 at line {line_no}, byte {offset + error.start}"
                offset += len(line)
    return None


def _caused_by_invalid_utf8(error: BaseException | None) -> bool:
    """`datasets` wraps decoding errors of file builders (e.g. DatasetGenerationError): look down the chain."""
    while error is not None:
        if isinstance(error, UnicodeDecodeError):
            return True
        error = error.__cause__ or error.__context__
    return False


def iter_records(dataset: DatasetConfig, start: int) -> Iterator[tuple[int, str]]:
    """(source index, text) from record `start` on, in source order; errors name the problem in one line."""
    files = _file_builder(dataset)
    local_files = [f for f in files[1] if "://" not in f] if files is not None else []
    index = start
    try:
        # Inside the try: a non-streaming load decodes the files here, not while iterating.
        source, _ = open_source(dataset)
        if start:
            source = source.skip(start)
        for record in source:
            if dataset.text_field not in record:
                raise DataError(f"dataset has no text field {dataset.text_field!r} (fields: {', '.join(sorted(record))})")
            text = record[dataset.text_field]
            if text is not None and not isinstance(text, str):
                raise DataError(f"dataset field {dataset.text_field!r} holds {type(text).__name__}, not text (record {index})")
            yield index, text or ""
            index += 1
    except Exception as error:
        if not _caused_by_invalid_utf8(error):
            raise
        raise DataError(_first_invalid_utf8(local_files) or "dataset: invalid UTF-8 in the source") from None


@dataclass
class _Part:
    doc_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    source_start: int = 0
    skipped_empty: int = 0


def materialise(
    config: KDFlowConfig,
    count_tokens: CountTokens | None = None,
    on_part: Callable[[CommitRecord], None] | None = None,
) -> MaterialiseSummary:
    """Write (or resume) the corpus store. `count_tokens` is needed for the `max_tokens` budget."""
    dataset = config.dataset
    if dataset.max_tokens is not None and count_tokens is None:
        raise ConfigError("dataset.max_tokens needs a tokenizer to count tokens")
    run_root = RunRoot(config.run_root)
    run_root.ensure_writable()
    store = stage_dir(run_root, "corpus")
    fingerprint = corpus_fingerprint(config)
    committed = list_commits(run_root, store, "corpus", fingerprint)
    done = read_complete(run_root, store)
    prefix = committed_prefix(committed)
    totals = dict(documents=sum(committed[i].rows for i in range(prefix)), tokens=sum(committed[i].tokens for i in range(prefix)),
                  skipped=sum(committed[i].extra.skipped_empty or 0 for i in range(prefix)))
    if done is not None and done.fingerprint == fingerprint and done.shards == prefix:
        return MaterialiseSummary(prefix, totals["documents"], totals["tokens"], totals["skipped"], 0, fingerprint)

    source_index = committed[prefix - 1].extra.source_end if prefix else 0
    part, written = _Part(source_start=source_index), 0
    budget_docs = dataset.max_documents
    budget_tokens = dataset.max_tokens

    def flush(source_end: int) -> None:
        nonlocal prefix, written, part
        if not part.texts:
            return
        path = f"{store}/{data_file_name('corpus', prefix)}"
        writer = write_corpus_part(run_root, path, corpus_table(part.doc_ids, part.texts))
        record = CommitRecord(
            stage="corpus", shard_id=prefix, data_file=data_file_name("corpus", prefix), rows=len(part.texts),
            tokens=part.tokens, bytes=writer.nbytes, sha256=writer.sha256, fingerprint=fingerprint,
            extra=CorpusPartInfo(source_start=part.source_start, source_end=source_end, skipped_empty=part.skipped_empty,
                                 chars=sum(map(len, part.texts))),
        )
        write_commit(run_root, store, record)
        if on_part:
            on_part(record)
        totals["documents"] += record.rows
        totals["tokens"] += record.tokens
        totals["skipped"] += part.skipped_empty
        prefix, written = prefix + 1, written + 1
        part = _Part(source_start=source_end)

    def budget_left() -> bool:
        docs = totals["documents"] + len(part.texts)
        tokens = totals["tokens"] + part.tokens
        return (budget_docs is None or docs < budget_docs) and (budget_tokens is None or tokens < budget_tokens)

    pending: list[tuple[int, str]] = []  # texts waiting for a token count (only with a token budget)

    def take(items: list[tuple[int, str]]) -> int:
        """Add documents to the part until a budget is hit; -> the source index after the last one taken.

        Empty documents among `items` are counted in source order, so each lands in the part whose source
        range holds it (a resume re-reads exactly the source after the last committed part).
        """
        texts = [t for _, t in items if t.strip()]
        counts = iter(count_tokens(texts) if budget_tokens is not None and texts else [0] * len(texts))
        end = items[0][0]
        for index, text in items:
            if not budget_left():
                break
            if not text.strip():
                part.skipped_empty += 1
                end = index + 1
                continue
            n_tokens = next(counts)
            part.doc_ids.append(totals["documents"] + len(part.texts))
            part.texts.append(text)
            part.tokens += n_tokens
            end = index + 1
            if len(part.texts) == dataset.documents_per_part:
                flush(end)
        return end

    exhausted = True
    next_index = source_index
    for index, text in iter_records(dataset, source_index):
        if not budget_left():
            exhausted = False
            break
        if not text.strip() and not pending:
            part.skipped_empty += 1
            next_index = index + 1
            continue
        pending.append((index, text))  # empty ones too while others wait: take() counts them in order
        if len(pending) >= (256 if budget_tokens is not None else 1):
            next_index = take(pending)
            pending = []
    if pending:
        next_index = take(pending)
    if not part.texts:
        totals["skipped"] += part.skipped_empty  # trailing empty documents belong to no part
    flush(next_index)
    write_complete(run_root, store, StageComplete(
        stage="corpus", shards=prefix, rows=totals["documents"], tokens=totals["tokens"], fingerprint=fingerprint,
        extra=CorpusCompleteInfo(skipped_empty=totals["skipped"], source_exhausted=exhausted),
    ))
    return MaterialiseSummary(prefix, totals["documents"], totals["tokens"], totals["skipped"], written, fingerprint)
