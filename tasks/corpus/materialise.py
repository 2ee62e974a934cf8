"""Materialise: documents from a hub dataset or local/remote files into committed Parquet parts.

Hub ids and files go through the same path (`datasets.load_dataset`, streamed when asked), read in
source order. Each part's commit record remembers how many source records were consumed, so a rerun
resumes after the last committed part, also in the middle of a stream.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kdflow.schemas.commits import (CommitRecord, CorpusCompleteInfo, CorpusPartInfo, StageComplete, commit_or_remove,
                                    committed_prefix, list_commits, read_complete, remove_shards_from, stage_dir,
                                    write_complete)
from kdflow.schemas.config import DatasetConfig
from kdflow.schemas.dataset_record import read_dataset_record, write_dataset_record
from kdflow.schemas.errors import ConfigError, KDFlowError
from kdflow.schemas.layout import data_file_name
from kdflow.schemas.shards import corpus_table, write_corpus_part
from kdflow.schemas.stage_settings import MaterialiseSettings
from kdflow.schemas.storage import RunRoot, remove_stale_temp_files
from kdflow.tasks.common import faults
from kdflow.tasks.common.hub_access import object_store_reads
from kdflow.tasks.common.progress import count_of
from kdflow.tasks.common.saved_datasets import load_saved_dataset
from kdflow.tasks.corpus.dataset_changes import check_unchanged, snapshot, starts_again, with_current_times
from kdflow.tasks.corpus.dataset_files import (DELIMITERS, SAVED, builders_quiet, csv_header, first_malformed_row,
                                              format_of, open_file, pandas_column_names, uncompressed)
from kdflow.tasks.corpus.dataset_files import file_builder as _file_builder
from kdflow.tasks.corpus.fields import field_names, field_value

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


def open_source(dataset: DatasetConfig) -> tuple[Any, list[str]]:
    """-> (datasets iterable in source order, the local files it reads or [])."""
    import datasets

    files = _file_builder(dataset)
    if files is not None and files[0] == SAVED:
        return load_saved_dataset(files[1][0], dataset.split), []
    if files is not None:
        builder, data_files = files
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


def _describe(dataset: DatasetConfig, files: list[str]) -> str:
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return f"dataset {dataset.path!r}" + (f" ({shown})" if files and shown != dataset.path else "")


def _local_files(dataset: DatasetConfig) -> list[str]:
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
    index = start
    try:
        # Inside the try: a non-streaming load decodes the files here, not while iterating.
        source, _ = open_source(dataset)
        if start:
            source = source.skip(start)
        for record in source:
            try:
                text = field_value(record, dataset.text_field)
            except KeyError:
                raise DataError(f"dataset has no text field {dataset.text_field!r} "
                                f"(fields: {', '.join(field_names(record))})") from None
            if text is not None and not isinstance(text, str):
                raise DataError(f"dataset field {dataset.text_field!r} holds {type(text).__name__}, not text "
                                f"(record {index + 1} of the dataset, counting from 1)")
            # A byte-order mark (a file saved on Windows) is not text. The text builder keeps it at the start of a
            # .txt file's first document, whatever encoding it is given for a compressed file; JSON readers drop it.
            yield index, (text or "").removeprefix("\ufeff")
            index += 1
    except KDFlowError:
        raise
    except Exception as error:
        if _caused_by_invalid_utf8(error):
            raise DataError(_first_invalid_utf8(local_files) or "dataset: invalid UTF-8 in the source") from None
        if _caused_by_bad_json(error):
            where = _first_malformed_json(local_files)
            raise DataError(f"dataset file {where}" if where else f"{_describe(dataset, local_files)}: not valid JSON: "
                            f"{str(error).splitlines()[0]}") from None
        if parser_error := _cause(error, lambda e: type(e).__name__ == "ParserError"):  # pandas', reading CSV/TSV
            where = first_malformed_row(local_files)
            raise DataError(f"dataset file {where}" if where else f"{_describe(dataset, local_files)}: not valid CSV: "
                            f"{str(parser_error).splitlines()[0]}") from None
        if _caused_by_no_data(error) and index == start:
            after = f" after record {start}" if start else ""
            raise DataError(f"{_describe(dataset, local_files)} holds no records{after} "
                            f"(split {dataset.split!r})") from None
        raise


@dataclass
class _Part:
    doc_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    source_start: int = 0
    skipped_empty: int = 0


def materialise(
    run_root: RunRoot,
    settings: MaterialiseSettings,
    count_tokens: CountTokens | None = None,
    on_part: Callable[[CommitRecord], None] | None = None,
) -> MaterialiseSummary:
    """Write (or resume) the corpus store. `count_tokens` is needed for the `max_tokens` budget."""
    dataset = settings.dataset
    if dataset.max_tokens is not None and count_tokens is None:
        raise ConfigError("dataset.max_tokens needs a tokenizer to count tokens")
    run_root.ensure_writable()
    store = stage_dir(run_root, "corpus")
    remove_stale_temp_files(run_root, store)  # what a killed run of this stage left
    fingerprint = settings.corpus_fingerprint
    committed = list_commits(run_root, store, "corpus", fingerprint)
    done = read_complete(run_root, store)
    prefix = committed_prefix(committed)
    totals = dict(documents=sum(committed[i].rows for i in range(prefix)),
                  tokens=sum(committed[i].tokens for i in range(prefix)),
                  skipped=sum(committed[i].extra.skipped_empty or 0 for i in range(prefix)))
    unfinished = done is None or done.fingerprint != fingerprint
    if prefix and (recorded := read_dataset_record(run_root, store, fingerprint)) is not None:
        if unfinished and starts_again(recorded, dataset, run_root.display(store), prefix):
            remove_shards_from(run_root, store, "corpus", 0)  # nothing read them: tokenise reads finished stores only
            prefix, totals = 0, dict.fromkeys(totals, 0)
        else:
            check_unchanged(recorded, dataset, run_root.display(store))  # parts made from the files as they were
            if (current := with_current_times(recorded)) != recorded:
                write_dataset_record(run_root, store, current)
    if not prefix and (sources := snapshot(dataset, fingerprint)) is not None:
        write_dataset_record(run_root, store, sources)
    if done is not None and done.fingerprint == fingerprint and done.shards == prefix:
        remove_shards_from(run_root, store, "corpus", prefix)  # as a finished run of an older kdflow left them
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
        faults.maybe_fire("commit", run_root, stage="materialise", shard=prefix)
        record = CommitRecord(
            stage="corpus", shard_id=prefix, data_file=data_file_name("corpus", prefix), rows=len(part.texts),
            tokens=part.tokens, bytes=writer.nbytes, sha256=writer.sha256, fingerprint=fingerprint,
            extra=CorpusPartInfo(source_start=part.source_start, source_end=source_end,
                                 skipped_empty=part.skipped_empty, chars=sum(map(len, part.texts))),
        )
        commit_or_remove(run_root, store, record)
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
    if not totals["documents"]:
        raise DataError(f"{_describe(dataset, _local_files(dataset))} holds no documents: "
                        f"{count_of(totals['skipped'], 'record')}, all with an empty {dataset.text_field!r}")
    remove_shards_from(run_root, store, "corpus", prefix)  # an earlier store's parts beyond this one's end
    write_complete(run_root, store, StageComplete(
        stage="corpus", shards=prefix, rows=totals["documents"], tokens=totals["tokens"], fingerprint=fingerprint,
        extra=CorpusCompleteInfo(skipped_empty=totals["skipped"], source_exhausted=exhausted),
    ))
    return MaterialiseSummary(prefix, totals["documents"], totals["tokens"], totals["skipped"], written, fingerprint)
