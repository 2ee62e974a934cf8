"""Checking every store of a run root, deeper than a stage's own checks (what `kdflow validate` reports).

A stage trusts a commit record when its data file exists with the recorded size (cheap, done on every
run). This goes further: each store's manifest through pandera, every committed data file re-hashed
against its record, and the contents checked (token ids within the vocabulary; top-K ids unique per
position, log-probs finite, <= 0, sorted descending, tail mass in [0, 1]; v2 shards decoded row by row
(crc32, zstd frames, ranges), written with the store's codec, their mass (ids + stored tail) 1 within the
codec's precision; top-K shards aligned 1:1 with the token shards they were made from). Each store's findings
are a `StoreReport`; `remove_broken` takes away the commit records of the shards that fail (with their data
files and the store's _complete.json), so that the next run of their stage recomputes exactly those shards.
`kdflow validate` (kdflow.commands.validate) prints the reports; `kdflow bench scale` times them at scale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kdflow.schemas.codec_sampled import sampled_problems
from kdflow.schemas.commits import CommitRecord, StageComplete, check_commits, read_complete
from kdflow.schemas.errors import KDFlowError, StoreError
from kdflow.schemas.layout import (COMPLETE_FILE, CORPUS_DIR, TOKENS_DIR, TOPK_DIR, Stage,
                                   commit_file_name, data_file_name)
from kdflow.schemas.manifests import load_manifest
from kdflow.schemas.protocol import format_shard_ids
from kdflow.schemas.shards import DOC_ID, read_corpus_part, read_token_shard
from kdflow.schemas.storage import RunRoot, sha256_of
from kdflow.schemas.store_info import alignment_problem, read_store_info, tokens_made_from, topk_tags
from kdflow.schemas.topk_rows import iter_topk_rows
from kdflow.tasks.validate_checks import token_id_problems, topk_problems, topk_v2_problems

STAGE_COMMAND = {"corpus": "materialise", "tokens": "tokenise", "topk": "precompute"}
ROWS_PER_CHECK = 16  # bounds the temporaries of the content checks on large shards


@dataclass
class StoreReport:
    """What validate found in one store; `broken` maps shard ids to the commit record `--fix` removes."""

    label: str
    stage: Stage
    store: str
    problems: list[tuple[str, int | None]] = field(default_factory=list)  # (message, shard id or None)
    notes: list[str] = field(default_factory=list)
    broken: dict[int, str] = field(default_factory=dict)
    records: dict[int, CommitRecord] = field(default_factory=dict)
    expected: int | None = None  # shards of the finished store (_complete.json), None while unfinished
    planned: int | None = None  # an unfinished top-K store's shards once complete: its token store's
    fingerprint: str | None = None
    pending: list[int] = field(default_factory=list)  # top-K shards whose token shard is to be recomputed

    def store_problem(self, message: str) -> None:
        self.problems.append((f"{self.label}: {message}", None))

    def shard_problem(self, shard_id: int, message: str) -> None:
        """A shard whose commit record must go (the next run of the stage recomputes the shard)."""
        self.problems.append((f"{self.label} shard {shard_id}: {message}", shard_id))
        self.broken[shard_id] = f"{self.store}/{commit_file_name(self.stage, shard_id)}"
        self.records.pop(shard_id, None)


# --- one store --------------------------------------------------------------------------------------------


def _read_done(run_root: RunRoot, report: StoreReport) -> StageComplete | None:
    """The store's _complete.json; an unreadable one is a problem of the store, not a crash of validate."""
    try:
        return read_complete(run_root, report.store)
    except StoreError as error:
        report.store_problem(str(error))
        return None


def _filled_by(run_root: RunRoot, report: StoreReport, done: StageComplete | None) -> str:
    """What writes this store's missing shards: its stage, or `kdflow store import` for what an import wrote."""
    if report.stage == "tokens" and done is not None and getattr(done.extra, "imported_from", None):
        return "kdflow store import"
    info = read_store_info(run_root, report.store) if report.stage == "topk" else None
    return info.filled_by if info is not None else STAGE_COMMAND[report.stage]


def _check_records(run_root: RunRoot, report: StoreReport, done: StageComplete | None, fingerprint: str | None) -> None:
    """Every commit record through `check_commit` (size, fingerprint, names), then the expected count."""
    for shard_id, (record, reason) in check_commits(run_root, report.store, report.stage, fingerprint).items():
        if record is None:
            report.shard_problem(shard_id, f"invalid commit record: {reason}")
        else:
            report.records[shard_id] = record
    if done is not None:
        report.expected = done.shards
        present = set(report.records) | set(report.broken)
        absent = [shard_id for shard_id in range(done.shards) if shard_id not in present]
        filled_by = _filled_by(run_root, report, done) if absent else ""  # one read of _store.json, not one a shard
        for shard_id in absent:
            report.problems.append((f"{report.label} shard {shard_id}: no commit record (the next run of "
                                    f"{filled_by} recomputes it)", None))
        for shard_id in sorted(set(report.records) - set(range(done.shards))):
            report.shard_problem(shard_id, f"beyond the {done.shards} shards of the finished store")
    else:
        top = max(report.records, default=-1)
        gaps = [i for i in range(top + 1) if i not in report.records and i not in report.broken]
        missing = f"; shard(s) {format_shard_ids(gaps)} have no commit record" if gaps else ""
        report.notes.append(f"not complete (no _complete.json){missing}: the next run of "
                            f"{_filled_by(run_root, report, done)} computes what is missing")


def _check_manifest(run_root: RunRoot, report: StoreReport, fingerprint: str | None, seq_len: int | None) -> None:
    try:
        load_manifest(run_root, report.store, report.stage, fingerprint, seq_len)
    except StoreError as error:
        report.store_problem(str(error))


def _check_hashes(run_root: RunRoot, report: StoreReport) -> None:
    for shard_id, record in sorted(report.records.items()):
        actual = sha256_of(run_root, f"{report.store}/{record.data_file}")
        if actual != record.sha256:
            report.shard_problem(shard_id, f"{record.data_file} has sha256 {actual[:12]}..., its record says "
                                 f"{record.sha256[:12]}... (changed after it was committed)")


def _check_contents(run_root: RunRoot, report: StoreReport,
                    check_shard: Callable[[int, CommitRecord], list[str]]) -> None:
    for shard_id, record in sorted(report.records.items()):
        try:
            problems = check_shard(shard_id, record)
        except KDFlowError as error:
            problems = [str(error)]
        except Exception as error:  # noqa: BLE001 - a file that passed its hash but does not parse is a finding
            problems = [f"unreadable: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"]
        if problems:
            report.shard_problem(shard_id, "; ".join(problems))


def validate_corpus(run_root: RunRoot) -> StoreReport:
    report = StoreReport("corpus", "corpus", run_root.path(CORPUS_DIR))
    done = _read_done(run_root, report)
    fingerprint = done.fingerprint if done else None
    _check_records(run_root, report, done, fingerprint)
    _check_manifest(run_root, report, fingerprint, None)
    _check_hashes(run_root, report)
    first_doc: dict[int, int] = {}  # part id -> its first doc_id, over the gap-free prefix of valid parts
    while len(first_doc) in report.records:
        previous = len(first_doc) - 1
        first_doc[len(first_doc)] = first_doc[previous] + report.records[previous].rows if previous >= 0 else 0

    def check_part(shard_id: int, record: CommitRecord) -> list[str]:
        doc_ids = read_corpus_part(run_root, f"{report.store}/{record.data_file}").column(DOC_ID).to_numpy()
        if len(doc_ids) != record.rows:
            return [f"{len(doc_ids)} documents, its record says {record.rows}"]
        start = first_doc.get(shard_id, int(doc_ids[0]) if len(doc_ids) else 0)
        if len(doc_ids) and not np.array_equal(doc_ids, np.arange(start, start + len(doc_ids))):
            return [f"doc_id does not run {start}..{start + len(doc_ids) - 1}"]
        return []

    _check_contents(run_root, report, check_part)
    from kdflow.tasks.corpus.dataset_changes import sources_state  # as `kdflow status` says it

    if (state := sources_state(run_root)) is not None and "CHANGED" in state:
        report.notes.append(f"_sources.json: {state}")
    return report


def _token_vocab(run_root: RunRoot, store: str, done: StageComplete | None,
                 records: dict[int, CommitRecord]) -> tuple[int | None, str]:
    """-> (vocabulary size of the token store's tokenizer, where it came from) or (None, why not)."""
    for extra in ([done.extra] if done else []) + [r.extra for r in records.values()]:
        if extra.vocab_size:
            return int(extra.vocab_size), "recorded by tokenise"
    try:  # older stores: load the tokenizer named by the config written beside the store
        from kdflow.schemas.config_io import saved_config
        from kdflow.schemas.fingerprints import tokenizer_fingerprint
        from kdflow.tasks.common.tokenizer import load_tokenizer

        config = saved_config(run_root, store)
        tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    except Exception as error:  # noqa: BLE001 - any failure only means the upper bound is not checked
        return None, f"the tokenizer could not be loaded ({type(error).__name__})"
    wanted = done.extra.tokenizer_fingerprint if done else None
    if wanted and tokenizer_fingerprint(tokenizer) != wanted:
        return None, "the tokenizer in its config.yaml is not the one that made the store"
    return len(tokenizer), f"from the tokenizer {config.tokenizer or config.teacher.model}"


def validate_tokens(run_root: RunRoot) -> tuple[StoreReport, int | None, int | None]:
    """-> (report, seq_len, vocabulary size) of the token store."""
    report = StoreReport("tokens", "tokens", run_root.path(TOKENS_DIR))
    done = _read_done(run_root, report)
    fingerprint = report.fingerprint = done.fingerprint if done else None
    _check_records(run_root, report, done, fingerprint)
    recorded = {r.fingerprint for r in report.records.values()}
    if report.fingerprint is None and len(recorded) == 1:  # an unfinished store (e.g. after --fix): its shards say it
        report.fingerprint = recorded.pop()
    seq_len = next((int(e.seq_len) for e in ([done.extra] if done else []) + [r.extra for r in report.records.values()]
                    if e.seq_len), None)
    _check_manifest(run_root, report, fingerprint, seq_len)
    _check_hashes(run_root, report)
    vocab, source = _token_vocab(run_root, report.store, done, report.records) if report.records else (None, "")
    if report.records and vocab is None:
        report.notes.append(f"vocabulary size unknown ({source}): token ids checked for >= 0 only")

    def check_shard(shard_id: int, record: CommitRecord) -> list[str]:
        input_ids = read_token_shard(run_root, f"{report.store}/{record.data_file}", seq_len)  # (rows, T)
        if len(input_ids) != record.rows:
            return [f"{len(input_ids)} rows, its record says {record.rows}"]
        return token_id_problems(input_ids, vocab)

    _check_contents(run_root, report, check_shard)
    return report, seq_len, vocab


def validate_topk(run_root: RunRoot, tag: str, tokens: StoreReport, seq_len: int | None,
                  token_vocab: int | None) -> StoreReport:
    report = StoreReport(f"topk/{tag}", "topk", run_root.path(TOPK_DIR, tag))
    done = _read_done(run_root, report)
    fingerprint = done.fingerprint if done else tag  # a top-K store's fingerprint is its tag
    if done is not None and done.fingerprint != tag:
        report.store_problem(f"_complete.json has fingerprint {done.fingerprint}, not the store's tag")
    _check_records(run_root, report, done, fingerprint)
    _check_manifest(run_root, report, fingerprint, seq_len)
    _check_hashes(run_root, report)
    made_from = tokens_made_from(report.records.values())
    aligned = not made_from or tokens.fingerprint in made_from
    if not aligned:
        report.notes.append(f"made from another token store ({', '.join(sorted(made_from))}, "
                            f"not {tokens.fingerprint}): alignment not checked")
    if done is not None and aligned and tokens.expected is not None and done.shards != tokens.expected:
        report.store_problem(f"{done.shards} shards, the token store has {tokens.expected}")
    if done is None and aligned:
        report.planned = tokens.expected
    info = read_store_info(run_root, report.store)
    store_codec = info.codec if info is not None else None
    recorded = [r.extra.vocab_size for r in report.records.values()]
    vocab = next((int(v) for v in recorded if v), None)
    if vocab is None and report.records:
        vocab = token_vocab
        report.notes.append("no teacher vocabulary size recorded: top-K ids checked against the token store's "
                            "vocabulary" if vocab is not None
                            else "vocabulary size unknown: top-K ids checked for >= 0 only")

    def check_shard(shard_id: int, record: CommitRecord) -> list[str]:
        problems = []
        if aligned and shard_id not in tokens.broken:  # a broken token shard is recomputed identically: no blame here
            token_record = tokens.records.get(shard_id)
            problem = alignment_problem(token_record, record)
            if token_record is None and tokens.expected is None:  # tokenise has yet to (re)compute it
                report.pending.append(shard_id)
            elif token_record is None:
                problems.append(f"no valid token shard {shard_id} to align with")
            elif problem is not None:
                problems.append(f"not aligned with token shard {shard_id}: the top-K shard {problem}")
        targets = info.targets if info is not None else "topk"  # hybrid / sampled: kdflow.schemas.codec_sampled
        rows = 0  # streamed record batch by record batch: memory stays one batch, whatever the shard's size
        for codec, first, decoded in iter_topk_rows(run_root, f"{report.store}/{record.data_file}", seq_len, targets,
                                                    ROWS_PER_CHECK):
            settings = None if codec is None else codec.settings()
            coded = targets != "topk" or (info is not None and info.format == "v2")
            if first == 0 and coded and settings != store_codec:
                return problems + [f"written as {'v1' if settings is None else settings}, "
                                   f"the store's codec is {store_codec}"]
            if targets != "topk":
                problems += sampled_problems(decoded, vocab, row_offset=first)
            elif codec is None:
                problems += topk_problems(decoded.ids, decoded.logprobs, vocab, row_offset=first)
            else:  # decoding checked every row's crc32, frames and ranges (a StoreError names the row)
                problems += topk_v2_problems(decoded, codec, vocab, row_offset=first)
            if problems:
                return problems  # the first failing rows name the problem well enough
            rows += len(decoded.ids)
        if rows != record.rows:
            return problems + [f"{rows} rows, its record says {record.rows}"]
        return problems

    _check_contents(run_root, report, check_shard)
    if report.pending:
        report.notes.append(f"shard(s) {format_shard_ids(report.pending)}: their token shards are not committed yet; "
                            "alignment is checked once tokenise has recomputed them")
    return report


# --- the whole run root -----------------------------------------------------------------------------------


def store_reports(run_root: RunRoot) -> Iterator[StoreReport]:
    """Each store of the run root checked, in order (corpus, tokens, each top-K store), a report as each is done;
    none where the run root holds no store."""
    if run_root.listdir(run_root.path(CORPUS_DIR)):
        yield validate_corpus(run_root)
    tokens, seq_len, vocab = validate_tokens(run_root)
    if run_root.listdir(tokens.store):
        yield tokens
    for tag in topk_tags(run_root):
        yield validate_topk(run_root, tag, tokens, seq_len, vocab)


def remove_broken(run_root: RunRoot, report: StoreReport, shard_id: int) -> str:
    """Remove a broken shard's commit record and data file (the next run of its stage recomputes the shard);
    -> the commit record's path. The store's _complete.json no longer holds after this: `remove_complete`."""
    commit_path = report.broken[shard_id]
    run_root.remove(commit_path)
    run_root.remove(f"{report.store}/{data_file_name(report.stage, shard_id)}")
    return commit_path


def remove_complete(run_root: RunRoot, report: StoreReport) -> None:
    """The store reads as unfinished: the next run of its stage computes the shards it misses."""
    run_root.remove(f"{report.store}/{COMPLETE_FILE}")
