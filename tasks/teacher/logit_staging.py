"""The import's one pass over its source: read batch by batch, map and check every row once, pack the rows into
`seq_len` rows and stage them, shard by shard, where no reader looks (`_imports/KEY/`, kdflow.schemas.layout).

Nothing of the import becomes visible before the last row passed: the stores are written from the staged shards
only after this pass ends (kdflow.tasks.teacher.logit_import). Each staged shard is written whole (`packed-N.npz`),
then its progress record (`packed-N.json`: the stream position after it and a digest of its arrays). KEY names
the source files (names, sizes, modification times), the layout and everything that decides the packing, so a
rerun after kill -9 on an unchanged source keeps the staged shards and reads on from the position after the last
one; a changed source gets another KEY and starts over. A bad row fails the rerun the same way, since the rows
after the last staged shard are read and checked again.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from kdflow.schemas.config_hash import section_hash
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.layout import IMPORTS_DIR
from kdflow.schemas.logit_layouts import LogitLayout
from kdflow.schemas.owners import is_stale, owner_tag
from kdflow.schemas.storage import RunRoot, remove_stale_temp_files
from kdflow.tasks.common import faults
from kdflow.tasks.teacher.logit_dataset import check_columns, check_text, source_rows
from kdflow.tasks.teacher.logit_packing import PackedRows, RowPacker
from kdflow.tasks.common.progress import Progress
from kdflow.tasks.teacher.logit_reader import (SourceFiles, iter_source, located, source_columns, source_fingerprint,
                                              source_rows_total)
from kdflow.tasks.teacher.distillkit import distillkit_rows
from kdflow.tasks.teacher.distillkit_settings import settings_for_source
from kdflow.tasks.teacher.source_rows import FULL, SourceRows
from kdflow.tasks.teacher.source_values import MASS_TOLERANCE

logger = logging.getLogger("kdflow.import")
STAGING_VERSION = 3  # of the staged files' layout: part of KEY, so an older kdflow's staging is never reused
CHECKED_FILE = "_checked.json"  # written once every row passed: the totals the stores are written from
OWNER_FILE = "_owner.txt"  # the owner tag (kdflow.schemas.owners) of the import filling the folder


@dataclass(frozen=True)
class Packing:
    """What decides the packed rows besides the source."""

    seq_len: int
    top_k: int
    vocab_size: int
    sequences_per_shard: int


@dataclass(frozen=True)
class StagedShard:
    shard_id: int
    rows: int  # packed rows
    next_row: int  # the stream position after this shard: source row ...
    next_offset: int  # ... and offset into it
    digest: str  # sha256 of its arrays (what the teacher fingerprint is made of, and checked on reading)
    masked: bool  # some position has no teacher target
    normalisation: str
    has_tail: bool
    short: bool  # some position with a target holds fewer than top_k entries (id -1, log-prob -inf after them)
    targets: int = 0  # positions with a teacher target
    whole_mass: int = 0  # of those, the ones whose kept probabilities sum to 1 (normalisation full)


@dataclass(frozen=True)
class Checked:
    """Every row of the source passed: the staged shards and the totals."""

    shards: list[StagedShard]
    rows: int  # source rows
    positions: int  # source positions (after dropping padding)
    dropped_positions: int  # the remainder that did not fill a packed row
    digest: str  # over the layout and every staged shard's digest
    reused: int  # staged shards an earlier, killed run left and this one kept

    @property
    def packed_rows(self) -> int:
        return sum(shard.rows for shard in self.shards)

    @property
    def masked(self) -> bool:
        return any(shard.masked for shard in self.shards)

    @property
    def normalisation(self) -> str:
        return self.shards[0].normalisation

    @property
    def has_tail(self) -> bool:
        return self.shards[0].has_tail

    @property
    def short(self) -> bool:
        return any(shard.short for shard in self.shards)

    @property
    def targets(self) -> int:
        return sum(shard.targets for shard in self.shards)

    @property
    def whole_mass(self) -> int:
        return sum(shard.whole_mass for shard in self.shards)


RowReader = Callable[[pa.RecordBatch, int, int, int], SourceRows]  # (batch, first_row, top_k, vocab_size)


def row_reader(layout: LogitLayout, source: SourceFiles, distillkit_settings: str | None = None,
               top_k: int | None = None) -> tuple[RowReader, str]:
    """How a batch of the source becomes SourceRows, and what besides the layout decides it (for KEY): the layout's
    own mapping, or for DistillKit's packed captures their decoder with the capture's compressor settings (the file
    the user gave, else the one the capture ships)."""
    if layout.kind != "distillkit" and distillkit_settings:
        raise ConfigError(f"--distillkit-settings applies to DistillKit's packed captures (--layout distillkit), not "
                          f"layout {layout.name}: remove it")
    if layout.kind != "distillkit":
        return (lambda batch, first_row, top_k, vocab: source_rows(batch, layout, first_row, top_k, vocab)), ""
    settings = settings_for_source(source.path, distillkit_settings)
    if top_k is not None and settings.k != top_k:  # its format allows it (formats.md); other layouts refuse
        logger.warning("import: the DistillKit capture keeps k=%d ids a position and precompute.top_k is %d: %s",
                       settings.k, top_k, f"the {settings.k - top_k} least likely join the tail" if settings.k > top_k
                       else f"the last {top_k - settings.k} entries of each position are padding")
    return (lambda batch, first_row, top_k, vocab: distillkit_rows(batch, settings, first_row, top_k, vocab)), \
        repr(settings)


def staging_dir(run_root: RunRoot, source: SourceFiles, layout: LogitLayout, packing: Packing, decoder: str = ""
                ) -> str:
    key = section_hash("import-staging", STAGING_VERSION, source_fingerprint(source), repr(layout), asdict(packing),
                       *([decoder] if decoder else []))
    return run_root.path(IMPORTS_DIR, key[:24])


def claim_staging(run_root: RunRoot, staging: str) -> None:
    """Write this process's owner tag into the staging folder: an import that finds another import's folder whose
    process is gone removes it (`remove_abandoned_staging`)."""
    run_root.write_bytes_atomic(f"{staging}/{OWNER_FILE}", owner_tag().encode())


def remove_abandoned_staging(run_root: RunRoot, keep: str) -> list[str]:
    """The staging folders of other imports whose process is gone: a killed import whose source then changed has
    another KEY, so none would ever reuse them (each may hold ~8 KB a position). Another host's are judged by their
    newest file's age, on local disk only; a folder without an owner tag is left alone. -> the folders removed."""
    imports, removed = run_root.path(IMPORTS_DIR), []
    for name in run_root.listdir(imports):
        folder = f"{imports}/{name}"
        if folder == keep:
            continue
        try:
            owner = run_root.read_bytes(f"{folder}/{OWNER_FILE}").decode(errors="replace")
        except (FileNotFoundError, NotADirectoryError):
            continue
        if is_stale(owner, _newest_mtime(folder) if run_root.is_local else time.time()):
            with contextlib.suppress(FileNotFoundError):
                run_root.fs.rm(folder, recursive=True)
            removed.append(folder)
    return removed


def _newest_mtime(folder: str) -> float:
    """The latest modification time in a staging folder: a live import on another host keeps staging shards (the
    owner file is written once, at its start), so its folder stays fresh however long the import runs."""
    with os.scandir(folder) as entries:
        return max((entry.stat().st_mtime for entry in entries), default=0.0)


def _name(shard_id: int, suffix: str) -> str:
    return f"packed-{shard_id:05d}{suffix}"


def arrays_digest(packed: PackedRows) -> str:
    sha = hashlib.sha256()
    for array in (packed.tokens, packed.ids, packed.logprobs, packed.target, packed.tail):
        sha.update(b"none" if array is None else np.ascontiguousarray(array).tobytes())
    return sha.hexdigest()


def read_staged(run_root: RunRoot, staging: str, shard: StagedShard) -> PackedRows:
    """A staged shard's arrays, checked against its recorded digest (a damaged file is an error, not data)."""
    with np.load(io.BytesIO(run_root.read_bytes(f"{staging}/{_name(shard.shard_id, '.npz')}"))) as stored:
        packed = PackedRows(stored["tokens"], stored["ids"], stored["logprobs"], stored["target"],
                            stored["tail"] if "tail" in stored.files else None)
    if arrays_digest(packed) != shard.digest:
        raise StoreError(f"staged import shard {shard.shard_id} in {run_root.display(staging)} is damaged; "
                         "remove that folder and import again")
    return packed


def _stage(run_root: RunRoot, staging: str, shard_id: int, packed: PackedRows, packer: RowPacker,
           normalisation: str) -> StagedShard:
    buffer = io.BytesIO()
    arrays = {"tokens": packed.tokens, "ids": packed.ids, "logprobs": packed.logprobs, "target": packed.target}
    np.savez(buffer, **arrays, **({} if packed.tail is None else {"tail": packed.tail}))
    run_root.write_bytes_atomic(f"{staging}/{_name(shard_id, '.npz')}", buffer.getvalue())
    faults.maybe_fire("commit", run_root, stage="import", shard=shard_id)
    row, offset = packer.position()
    kept = np.exp(packed.logprobs[packed.target].astype(np.float64)).sum(-1)
    whole = int((np.abs(kept - 1.0) <= MASS_TOLERANCE).sum()) if normalisation == FULL else 0
    shard = StagedShard(shard_id, packed.rows, row, offset, arrays_digest(packed), bool(not packed.target.all()),
                        normalisation, packed.tail is not None, bool((packed.ids[packed.target] < 0).any()),
                        int(packed.target.sum()), whole)
    run_root.write_bytes_atomic(f"{staging}/{_name(shard_id, '.json')}", json.dumps(asdict(shard)).encode())
    return shard


def _staged_so_far(run_root: RunRoot, staging: str) -> list[StagedShard]:
    """The staged shards with their progress record, 0, 1, ... up to the first missing one."""
    names = set(run_root.listdir(staging))
    shards = []
    while _name(len(shards), ".json") in names and _name(len(shards), ".npz") in names:
        record = json.loads(run_root.read_bytes(f"{staging}/{_name(len(shards), '.json')}"))
        shards.append(StagedShard(**record))
    return shards


def stage_source(run_root: RunRoot, staging: str, source: SourceFiles, layout: LogitLayout, packing: Packing,
                 tokenizer: Any, read_rows: RowReader | None = None) -> Checked:
    """Check every row of `source` once and stage its packed shards (resuming staged work); -> the totals."""
    done = f"{staging}/{CHECKED_FILE}"
    if run_root.exists(done):
        record = json.loads(run_root.read_bytes(done))
        return Checked(**record | {"shards": [StagedShard(**s) for s in record["shards"]], "reused": len(
            record["shards"])})
    remove_stale_temp_files(run_root, staging)  # half-written staged files of a killed import
    shards = _staged_so_far(run_root, staging)
    reused = len(shards)
    packer = RowPacker(packing.seq_len, (shards[-1].next_row, shards[-1].next_offset) if shards else (0, 0))
    positions = normalisation = None
    read_rows = read_rows or row_reader(layout, source)[0]
    wanted = [c for c in (layout.tokens, *layout.target_fields(), layout.tail, layout.target_mask,
                          layout.attention_mask, layout.text) if c]
    wanted += ["labels"] if layout.kind == "distillkit" else []  # DistillKit's rows mask targets by their labels
    total = source_rows_total(source)
    progress = Progress("import", None if total is None else total - packer.start[0], unit="row")
    for read in iter_source(source, wanted, start_row=packer.start[0]):
        try:
            check_columns(read.batch, layout, source.path, lambda: source_columns(source))
            rows = read_rows(read.batch, read.first_row, packing.top_k, packing.vocab_size)
            check_text(rows, tokenizer, read.first_row, layout)
            if positions is None and rows.text is None:  # said once, at the first batch
                logger.info("import: the source has no text column%s: its token ids are checked against the "
                            "tokenizer's vocabulary size only, not its encoding", f" ({layout.text})" * bool(
                                layout.text))
            if normalisation is not None and rows.normalisation != normalisation:
                raise StoreError(f"row {read.first_row}: normalisation {rows.normalisation}, earlier rows "
                                 f"{normalisation}")
        except StoreError as error:
            raise located(error, source, read) from None
        normalisation = rows.normalisation
        packer.add(rows)
        while packer.rows_ready() >= packing.sequences_per_shard:
            shards.append(_stage(run_root, staging, len(shards), packer.take(packing.sequences_per_shard), packer,
                                 normalisation))
        positions = (positions or 0) + rows.positions
        progress.update(rows.rows, tokens=rows.positions)
    progress.close()
    if packer.rows_ready():
        shards.append(_stage(run_root, staging, len(shards), packer.take(packer.rows_ready()), packer,
                             normalisation or FULL))
    if packer.next_row == 0:
        raise StoreError(f"import source {source.path!r} has no rows")
    if not shards:
        raise StoreError(f"import source {source.path!r} holds {packer.remainder} positions, fewer than one row "
                         f"of seq_len {packing.seq_len}")
    # the positions before the stream position this run started from are those of the staged shards it kept
    total = sum(s.rows for s in shards[:reused]) * packing.seq_len + (positions or 0) - packer.start[1]
    digest = hashlib.sha256(f"{layout.name}\n{shards[0].normalisation}\n".encode())
    for shard in shards:
        digest.update(shard.digest.encode())
    checked = Checked(shards, packer.next_row, total, packer.remainder, digest.hexdigest(), reused)
    run_root.write_bytes_atomic(done, json.dumps({k: v for k, v in asdict(checked).items() if k != "reused"}).encode())
    return checked
