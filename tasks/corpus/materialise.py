"""Materialise: documents from a hub dataset or local/remote files into committed Parquet parts.

The dataset's records come in source order from kdflow.tasks.corpus.records (hub ids and files alike, through
`datasets.load_dataset`, streamed when asked). Each part's commit record remembers how many source records were
consumed, so a rerun resumes after the last committed part, also in the middle of a stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kdflow.schemas.commits import (CommitRecord, CorpusCompleteInfo, CorpusPartInfo, StageComplete, commit_or_remove,
                                    committed_prefix, list_commits, read_complete, remove_shards_from, stage_dir,
                                    write_complete)
from kdflow.schemas.dataset_record import read_dataset_record, write_dataset_record
from kdflow.schemas.errors import ConfigError
from kdflow.schemas.layout import data_file_name
from kdflow.schemas.shards import corpus_table, write_corpus_part
from kdflow.schemas.stage_settings import MaterialiseSettings
from kdflow.schemas.storage import RunRoot, remove_stale_temp_files
from kdflow.tasks.common import faults
from kdflow.tasks.common.progress import count_of
from kdflow.tasks.corpus.dataset_changes import check_unchanged, snapshot, starts_again, with_current_times
from kdflow.tasks.corpus.records import DataError, describe_source, iter_records, local_files

CountTokens = Callable[[list[str]], list[int]]
SKIPPED_NAMED = 5  # the records without text a run names in its summary (it counts them all)


@dataclass
class MaterialiseSummary:
    parts: int
    documents: int
    tokens: int
    skipped_empty: int
    parts_written: int
    fingerprint: str
    extra: dict[str, Any] = field(default_factory=dict)
    skipped_first: list[int] = field(default_factory=list)  # this run's first skipped records (source index, from 0)


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
    skipped_first: list[int] = []

    def skip(index: int) -> None:
        part.skipped_empty += 1
        if len(skipped_first) < SKIPPED_NAMED:
            skipped_first.append(index)

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
                skip(index)
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
            skip(index)
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
        raise DataError(f"{describe_source(dataset, local_files(dataset))} holds no documents: "
                        f"{count_of(totals['skipped'], 'record')}, all with an empty {dataset.text_field!r}")
    remove_shards_from(run_root, store, "corpus", prefix)  # an earlier store's parts beyond this one's end
    write_complete(run_root, store, StageComplete(
        stage="corpus", shards=prefix, rows=totals["documents"], tokens=totals["tokens"], fingerprint=fingerprint,
        extra=CorpusCompleteInfo(skipped_empty=totals["skipped"], source_exhausted=exhausted),
    ))
    return MaterialiseSummary(prefix, totals["documents"], totals["tokens"], totals["skipped"], written, fingerprint,
                              skipped_first=skipped_first)
