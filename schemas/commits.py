"""Commit records and manifests: the protocol that makes every stage resumable and idempotent.

A stage writes a shard's data under its final name, then its commit record, last. Readers trust committed
shards only; a stage recomputes a shard iff its record is missing or invalid (unparseable, another
fingerprint, data file missing or of another size). `kdflow validate` also re-hashes the data.
The manifest of a store, the table of its commit records, is in kdflow.schemas.manifests.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, model_validator

from kdflow.schemas.errors import StoreError
from kdflow.schemas.layout import (COMPLETE_FILE, CORPUS_DIR, TOKENS_DIR, TOPK_DIR, Stage, commit_file_name,
                                   commit_shard_id, data_file_name)
from kdflow.schemas.storage import RunRoot, sha256_of

SHA256_PATTERN = r"^[0-9a-f]{64}$"


# --- what a stage records about its shards for the stages after it ----------------------------------------


class _Info(BaseModel):
    """Typed facts a stage records beside a shard (JSON key `extra`, as in every store so far). Every field is
    optional, so records written before a field existed, or by other tools, still read; unknown keys are kept."""

    model_config = ConfigDict(extra="allow", frozen=True)


class CorpusPartInfo(_Info):
    source_start: int | None = None  # index of the part's first source record: materialise resumes after source_end
    source_end: int | None = None
    skipped_empty: int | None = None
    chars: int | None = None


class TokenShardInfo(_Info):
    end_doc: int | None = None  # where packing stopped (document, token offset): tokenise resumes from there
    end_offset: int | None = None
    seq_len: int | None = None
    tokenizer_fingerprint: str | None = None
    vocab_size: int | None = None  # every token id is below it: `kdflow validate` checks that


class TopkShardInfo(_Info):
    teacher_fingerprint: str | None = None
    tokens_fingerprint: str | None = None  # the token store the shard was made from
    top_k: int | None = None
    seq_len: int | None = None
    logprobs_dtype: str | None = None
    micro_batch: int | None = None  # the one the shard ran at
    micro_batch_configured: int | None = None  # precompute.micro_batch: more than micro_batch after an out-of-memory
    device: str | None = None  # what decides the micro-batch that fits: "NVIDIA H200, 139.8 GiB", "cpu"
    chunk_tokens: int | None = None
    # how the pass read the logits: "slab", "tiled", "tiled-triton" or "tiled-gemm" (None: before the choice)
    head: str | None = None
    experts: str | None = None  # how a MoE teacher's experts ran (precompute.experts); None: dense, or before it
    compiled_body: bool | None = None  # the body under torch.compile (precompute.compile_body)? None: before it
    vocab_size: int | None = None  # the teacher's output rows: every top-K id is below it
    format: str | None = None  # "v2"; None: a v1 shard
    codec: dict[str, Any] | None = None  # v2: the codec's settings (as in the shard's schema metadata)
    seconds: float | None = None
    tokens_per_s: float | None = None


class CorpusCompleteInfo(_Info):
    skipped_empty: int | None = None
    source_exhausted: bool | None = None


class TokensCompleteInfo(_Info):
    dropped_tokens: int | None = None  # tail tokens that did not fill a last sequence
    seq_len: int | None = None
    tokenizer_fingerprint: str | None = None
    corpus_fingerprint: str | None = None
    vocab_size: int | None = None


class TopkCompleteInfo(_Info):
    tokens_fingerprint: str | None = None
    teacher_fingerprint: str | None = None
    seq_len: int | None = None
    top_k: int | None = None


_SHARD_INFO: dict[str, type[_Info]] = {"corpus": CorpusPartInfo, "tokens": TokenShardInfo, "topk": TopkShardInfo}
_COMPLETE_INFO: dict[str, type[_Info]] = {"corpus": CorpusCompleteInfo, "tokens": TokensCompleteInfo,
                                          "topk": TopkCompleteInfo}


class _StageRecord(BaseModel):
    """A record whose `extra` is the typed info of its stage: a dict in JSON becomes that stage's info model."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    _infos: ClassVar[dict[str, type[_Info]]]

    @model_validator(mode="before")
    @classmethod
    def _typed_extra(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stage") in cls._infos:
            extra = data.get("extra")
            if extra is None or isinstance(extra, dict):
                data = {**data, "extra": cls._infos[data["stage"]].model_validate(extra or {})}
        return data

    @field_serializer("extra", check_fields=False)
    def _extra_json(self, info: _Info) -> dict[str, Any]:
        return info.model_dump(exclude_none=True)


class CommitRecord(_StageRecord):
    """Written last, after the shard's data file: its presence means the shard is done."""

    _infos = _SHARD_INFO

    stage: Stage
    shard_id: int = Field(ge=0)
    data_file: str
    rows: int = Field(ge=0)
    tokens: int = Field(ge=0)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256_PATTERN)
    input_sha256: str | None = Field(default=None, description="sha256 of the input shard this one was made from")
    fingerprint: str = Field(description="The store's fingerprint: same inputs and config parts, same value")
    created_at: float = Field(default_factory=time.time)
    host: str = Field(default_factory=socket.gethostname)
    extra: CorpusPartInfo | TokenShardInfo | TopkShardInfo = Field(default_factory=CorpusPartInfo)


class StageComplete(_StageRecord):
    """Written once a stage has committed every shard it will ever have: the expected count for readers."""

    _infos = _COMPLETE_INFO

    stage: Stage
    shards: int = Field(ge=0)
    rows: int = Field(ge=0)
    tokens: int = Field(ge=0)
    fingerprint: str
    created_at: float = Field(default_factory=time.time)
    extra: CorpusCompleteInfo | TokensCompleteInfo | TopkCompleteInfo = Field(default_factory=CorpusCompleteInfo)


def stage_dir(run_root: RunRoot, stage: Stage, tag: str | None = None) -> str:
    if stage == "topk":
        if not tag:
            raise ValueError("the top-K store needs its tag")
        return run_root.path(TOPK_DIR, tag)
    return run_root.path(CORPUS_DIR if stage == "corpus" else TOKENS_DIR)


def write_commit(run_root: RunRoot, store: str, record: CommitRecord, *, exclusive: bool = False,
                 replaces: bytes | None = None) -> bool:
    """Write the shard's record; -> whether this call wrote it.

    `exclusive` (stages whose writers may race, like precompute's fan-out): created only if absent, atomically
    on local disk and S3, so of two writers racing on one shard one writes the record and the other finds it
    and moves on; an invalid record in the way (the reason the shard was computed again) is replaced. So is the
    record `replaces` (its bytes, read before computing), which the new data file may have made valid again (a
    data file deleted by hand, computed again: the same bytes). Otherwise the record is simply written."""
    path = f"{store}/{commit_file_name(record.stage, record.shard_id)}"
    data = record.model_dump_json(indent=1).encode()
    if not exclusive or (replaces is not None and stored_record(run_root, store, record.stage, record.shard_id)
                         == replaces):
        run_root.write_bytes_atomic(path, data)
        return True
    if run_root.create_if_absent(path, data):
        return True
    existing, _ = check_commit(run_root, store, record.stage, record.shard_id, record.fingerprint)
    if existing is not None and (existing.sha256 == record.sha256
                                 or sha256_of(run_root, f"{store}/{record.data_file}") != record.sha256):
        return False  # the other writer's record stands (the data file holds its bytes, which are ours too)
    run_root.write_bytes_atomic(path, data)  # an invalid record, or a valid one our later data file replaced
    return True


def commit_or_remove(run_root: RunRoot, store: str, record: CommitRecord, *, exclusive: bool = False,
                     replaces: bytes | None = None) -> bool:
    """Write the shard's commit record (`exclusive`, `replaces`: see write_commit; -> False if another process's
    valid record was there first); if that fails (a full disk), remove its data file too: an uncommitted file is
    never read, and the disk wants its space back."""
    try:
        return write_commit(run_root, store, record, exclusive=exclusive, replaces=replaces)
    except BaseException:
        run_root.remove(f"{store}/{record.data_file}")
        raise


def stored_record(run_root: RunRoot, store: str, stage: Stage, shard_id: int) -> bytes | None:
    """The shard's commit record's bytes as stored, valid or not (None: there is none)."""
    try:
        return run_root.read_bytes(f"{store}/{commit_file_name(stage, shard_id)}")
    except FileNotFoundError:
        return None


def read_commit(run_root: RunRoot, store: str, stage: Stage, shard_id: int,
                fingerprint: str | None = None) -> CommitRecord | None:
    """The shard's record if it is valid for this store, else None (the shard must be recomputed)."""
    record, _ = check_commit(run_root, store, stage, shard_id, fingerprint)
    return record


def check_commit(
    run_root: RunRoot, store: str, stage: Stage, shard_id: int, fingerprint: str | None = None
) -> tuple[CommitRecord | None, str]:
    """-> (record, "") when valid, or (None, reason) when missing or invalid."""
    raw = stored_record(run_root, store, stage, shard_id)
    if raw is None:
        return None, "no commit record"

    def data_size(record: CommitRecord) -> int | None:
        try:
            return run_root.size(f"{store}/{record.data_file}")
        except FileNotFoundError:
            return None

    return _checked(raw, stage, shard_id, fingerprint, data_size)


def _checked(raw: bytes, stage: Stage, shard_id: int, fingerprint: str | None,
             data_size: Callable[[CommitRecord], int | None]) -> tuple[CommitRecord | None, str]:
    """The checks of `check_commit` on a record's bytes; `data_size` gives its data file's size (None: missing)."""
    try:
        record = CommitRecord.model_validate_json(raw)
    except (ValidationError, ValueError) as error:
        return None, f"unreadable commit record: {str(error).splitlines()[0]}"
    if record.stage != stage or record.shard_id != shard_id or record.data_file != data_file_name(stage, shard_id):
        return None, "commit record names another shard"
    if fingerprint is not None and record.fingerprint != fingerprint:
        return None, f"fingerprint {record.fingerprint} is not the store's {fingerprint}"
    size = data_size(record)
    if size is None:
        return None, "data file missing"
    if size != record.bytes:
        return None, f"data file has {size} bytes, its record says {record.bytes}"
    return record, ""


def check_commits(run_root: RunRoot, store: str, stage: Stage, fingerprint: str | None = None
                  ) -> dict[int, tuple[CommitRecord | None, str]]:
    """`check_commit` of every record in the store, by shard id: one listing (names and data file sizes),
    then the records read in one batch (concurrent requests on object stores), never a request per data file."""
    sizes = run_root.list_sizes(store)
    ids = sorted(shard_id for name in sizes if (shard_id := commit_shard_id(name)) is not None)
    raws = run_root.read_many([f"{store}/{commit_file_name(stage, shard_id)}" for shard_id in ids])
    checked = {}
    for shard_id, raw in zip(ids, raws, strict=True):
        checked[shard_id] = (None, "no commit record") if raw is None else _checked(
            raw, stage, shard_id, fingerprint, lambda record: sizes.get(record.data_file))
    return checked


def list_commits(run_root: RunRoot, store: str, stage: Stage,
                 fingerprint: str | None = None) -> dict[int, CommitRecord]:
    """All valid commit records of a store, by shard id. Data files without a record are invisible."""
    return {shard_id: record for shard_id, (record, _) in check_commits(run_root, store, stage, fingerprint).items()
            if record is not None}


def committed_prefix(records: dict[int, CommitRecord]) -> int:
    """How many shards from 0 on are committed without a gap: a sequential stage resumes after them."""
    count = 0
    while count in records:
        count += 1
    return count


def remove_shards_from(run_root: RunRoot, store: str, stage: Stage, first: int) -> None:
    """Remove shards `first`, `first + 1`, ... of any fingerprint (record, then data file): what a store of more
    shards (another seq_len or shard size) left beyond the end of one rewritten over it."""
    names = run_root.list_sizes(store)
    for shard_id in sorted({i for name in names if (i := commit_shard_id(name)) is not None and i >= first} | {
            i for i in range(first, first + len(names)) if data_file_name(stage, i) in names}):
        run_root.remove(f"{store}/{commit_file_name(stage, shard_id)}")
        run_root.remove(f"{store}/{data_file_name(stage, shard_id)}")


def write_complete(run_root: RunRoot, store: str, complete: StageComplete) -> None:
    run_root.write_bytes_atomic(f"{store}/{COMPLETE_FILE}", complete.model_dump_json(indent=1).encode())


def read_complete(run_root: RunRoot, store: str) -> StageComplete | None:
    try:
        return StageComplete.model_validate_json(run_root.read_bytes(f"{store}/{COMPLETE_FILE}"))
    except FileNotFoundError:
        return None
    except (ValidationError, ValueError) as error:
        raise StoreError(f"{store}/{COMPLETE_FILE}: unreadable: {str(error).splitlines()[0]}") from None
