"""The student's data: token shard i paired with top-K shard i, a seeded order, and rank sharding.

Training rows are all rows of every token shard except the last `student.eval_shards` (held out for
evaluation). Epoch e visits them in a permutation of global row indices fixed by (seed, e); a global
position counter (rows consumed so far, over all ranks) walks through the concatenation of epochs.
The global batch at position p is the next `batch_size` rows; rank r of W takes rows r::W of it. So
every row is seen once per epoch across ranks, and the position means the same thing for any W: a run
resumed on another number of ranks continues exactly where the last one stopped.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kdflow.schemas.commits import CommitRecord, list_commits, read_commit, read_complete, stage_dir
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.fingerprints import tokenizer_fingerprint
from kdflow.schemas.layout import TOPK_DIR, commit_file_name, data_file_name
from kdflow.schemas.protocol import format_shard_ids
from kdflow.schemas.shard_rows import ShardRows, take_rows
from kdflow.schemas.shards import decode_token_rows, stream_schema_ints
from kdflow.schemas.stage_settings import StudentDataSettings, TrainingSettings, held_out_problem
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_info import (alignment_problem, filled_by, find_topk_stores, format_mismatch, read_store_info,
                                      topk_tags)
from kdflow.schemas.token_store import open_token_store
from kdflow.schemas.topk_rows import TopkRows
from kdflow.tasks.common.models import teacher_fingerprint

logger = logging.getLogger("kdflow.train")
_TAIL_WARNED: set[str] = set()  # stores whose computed or unknown tail was warned about in this process


@dataclass(frozen=True)
class ShardPair:
    shard_id: int
    rows: int
    token_path: str
    topk_path: str
    token_bytes: int = 0  # sizes of the data files, from their commit records
    topk_bytes: int = 0
    topk_batch_rows: int | None = None  # rows per record batch of the top-K shard (its micro-batch), if recorded


@dataclass(frozen=True)
class DistillStores:
    """The verified token store and the top-K store made from it."""

    tokens_store: str
    topk_store: str
    tokens_fingerprint: str
    tokenizer_fingerprint: str
    topk_fingerprint: str
    seq_len: int
    top_k: int
    pairs: tuple[ShardPair, ...]
    codec: dict[str, Any] | None = None  # v2: the codec settings of the store (_store.json); every shard must match
    targets: str = "topk"  # or hybrid / sampled: shards hold sampled targets (kdflow.schemas.codec_sampled)
    sampling: dict[str, Any] | None = None  # sampled targets: head, samples, scheme, seed (_store.json)
    normalisation: str = "full"  # "top_k": log-probs renormalised over the K, tail unknown (renormalised-K loss)


@dataclass(frozen=True)
class DistillBatch:
    input_ids: torch.Tensor  # (n, T) int64
    topk_ids: torch.Tensor  # (n, T, K) int32; -1 = padding (adaptive K)
    topk_logprobs: torch.Tensor  # (n, T, K) float16 | float32; -inf = padding
    tail_logprob: torch.Tensor  # (n, T) float32: log of the teacher's mass outside the ids (v1: from 1 - sum)
    # Sampled targets: topk_* hold the head (K = H, 0 for `sampled`), these the sample_ids (n, T, S) int32,
    # sample_logprobs (n, T, S) float32 and log_threshold (n, T) float32 (kdflow.tasks.common.sampled).
    samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    target: torch.Tensor | None = None  # (n, T) bool, False: no teacher target there (masked stores); None: all

    def _map(self, move: Any) -> DistillBatch:
        return DistillBatch(*map(move, (self.input_ids, self.topk_ids, self.topk_logprobs, self.tail_logprob)),
                            samples=None if self.samples is None else tuple(map(move, self.samples)),
                            target=None if self.target is None else move(self.target))

    def to(self, device: torch.device | str) -> DistillBatch:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def rows(self, start: int, stop: int) -> DistillBatch:
        """The batch of rows start..stop-1 (views: pinned memory stays pinned)."""
        return self._map(lambda t: t[start:stop])

    def pinned(self) -> DistillBatch:
        """The same tensors in page-locked host memory, so that `to(cuda)` copies without blocking."""
        return self._map(lambda t: t.pin_memory())


# --- locating and verifying the stores --------------------------------------------------------------------


def find_topk_store(run_root: RunRoot, settings: TrainingSettings, tokens_fp: str, first_token: CommitRecord) -> str:
    """The top-K store to train on: `student.topk_tag`; else the store precompute made for this config's
    teacher, K and token store (found through its `_store.json`; of several, e.g. a CPU and a GPU pass
    with dtype auto, the one this host would make); else the one store without `_store.json` whose first
    shard was made from this token store (written by other tools)."""
    if settings.student.topk_tag is not None:
        tags = topk_tags(run_root)
        if settings.student.topk_tag not in tags:
            raise StoreError(f"student.topk_tag={settings.student.topk_tag!r}: no such top-K store under "
                             f"{run_root.display(run_root.path(TOPK_DIR))} (it holds: {', '.join(tags) or 'none'})")
        return stage_dir(run_root, "topk", settings.student.topk_tag)
    made_for_config = find_topk_stores(run_root, settings.teacher, settings.precompute, to_train=True)
    if len(made_for_config) > 1:
        here = settings.topk_fingerprint(teacher_fingerprint(settings.teacher), tokens_fp)
        made_for_config = [tag for tag in made_for_config if tag == here] or made_for_config
    if len(made_for_config) == 1:
        return stage_dir(run_root, "topk", made_for_config[0])
    topk_root = run_root.display(run_root.path(TOPK_DIR))
    if made_for_config:
        raise StoreError(f"several top-K stores under {topk_root} fit this config ({', '.join(made_for_config)}): "
                         "choose one with student.topk_tag")
    other_format = find_topk_stores(run_root, settings.teacher, settings.precompute, any_format=True)
    if other_format:  # made for this teacher, K and token store, with other format settings: name both
        store = stage_dir(run_root, "topk", other_format[0])
        raise StoreError(format_mismatch(read_store_info(run_root, store), settings.precompute,
                                         run_root.display(store)))
    ours, others, imported = [], [], []
    for tag in topk_tags(run_root):
        if (info := read_store_info(run_root, stage_dir(run_root, "topk", tag))) is not None:
            imports_ours = (info.model_extra or {}).get("imported") and info.tokens_fingerprint == tokens_fp
            if imports_ours and read_complete(run_root, stage_dir(run_root, "topk", tag)) is None:
                tag += " (unfinished: run its import again)"
            differs = "" if info.top_k == settings.data.top_k else f": K={info.top_k}"  # the likeliest one, said
            (imported if imports_ours else others).append(tag if imports_ours else tag + differs)
            continue
        record = read_commit(run_root, stage_dir(run_root, "topk", tag), "topk", 0)
        if record is not None and record.input_sha256 == first_token.sha256:
            ours.append(tag)
        elif record is not None:  # its K, from the record or the shard's header (one small read)
            store = stage_dir(run_root, "topk", tag)
            k = record.extra.top_k or stream_schema_ints(run_root, f"{store}/{record.data_file}").get("top_k")
            others.append(tag + (f": K={k}" if k is not None and k != settings.data.top_k else ""))
    if len(ours) == 1:
        return stage_dir(run_root, "topk", ours[0])
    if ours:
        raise StoreError(f"several top-K stores under {topk_root} were made from token store {tokens_fp} "
                         f"({', '.join(ours)}): choose one with student.topk_tag")
    if imported:  # `kdflow store import` names its teacher, which the config's is not: it said "run precompute"
        raise StoreError(f"top-K store{'s' * (len(imported) > 1)} {', '.join(imported)} under {topk_root} "
                         f"{'were' if len(imported) > 1 else 'was'} imported for this token store (kdflow store "
                         f"import): train on one with student.topk_tag")
    found = f" (found {', '.join(others)}, made for another teacher, K or token store)" if others else ""
    raise StoreError(f"no top-K store under {topk_root} was made for this teacher, K={settings.data.top_k} and token "
                     f"store {tokens_fp}{found}; run precompute first")


def open_stores(run_root: RunRoot, settings: TrainingSettings, tokenizer: Any) -> DistillStores:
    """Find the token and top-K stores for these settings and check that they belong together, shard by shard."""
    tokenizer_fp = tokenizer_fingerprint(tokenizer)
    tokens = open_token_store(run_root, tokenizer_fp, settings.tokens_fingerprint(tokenizer_fp))
    tokens_store, complete, tokens_fp = tokens.path, tokens.complete, tokens.fingerprint
    shown = run_root.display(tokens_store)
    token_records = list_commits(run_root, tokens_store, "tokens", tokens_fp)
    if not complete.shards:  # it said "lacks shard(s) all; run tokenise first", after tokenise had run
        raise StoreError(f"token store {shown}: {held_out_problem(0, 0, 0)}")
    missing = [i for i in range(complete.shards) if i not in token_records]
    if missing:
        raise StoreError(f"token store {shown} lacks shard(s) {format_shard_ids(missing)}; run tokenise first")

    topk_store = find_topk_store(run_root, settings, tokens_fp, token_records[0])
    info = read_store_info(run_root, topk_store)
    mismatch = format_mismatch(info, settings.precompute, run_root.display(topk_store)) if info is not None else None
    if mismatch is not None:  # student.topk_tag named a store of other format settings
        raise StoreError(mismatch)
    if info is not None and info.tail_computed and info.normalisation != "top_k" and topk_store not in _TAIL_WARNED:
        _TAIL_WARNED.add(topk_store)
        logger.warning("top-K store %s was imported without tail mass: its tail is 1 - sum(p) of the kept ids, "
                       "so the loss's tail bucket is only as exact as the source's log-probs",
                       run_root.display(topk_store))
    if info is not None and info.normalisation == "top_k" and topk_store not in _TAIL_WARNED:
        _TAIL_WARNED.add(topk_store)
        logger.warning("top-K store %s holds log-probs renormalised over K: training with the renormalised-K loss, "
                       "the teacher's tail is unknown", run_root.display(topk_store))
    topk_records = list_commits(run_root, topk_store, "topk")
    fingerprints = {record.fingerprint for record in topk_records.values()}
    if len(fingerprints) > 1:
        raise StoreError(f"top-K store {run_root.display(topk_store)} mixes fingerprints {sorted(fingerprints)}")
    data = settings.data
    pairs = tuple(verify_pair(run_root, data, token_records[i], topk_records.get(i), tokens_store, topk_store,
                               filled_by(info)) for i in range(complete.shards))
    return DistillStores(tokens_store, topk_store, tokens_fp, tokens.tokenizer_fingerprint, fingerprints.pop(),
                         data.seq_len, data.top_k, pairs, info.codec if info is not None else None,
                         info.targets if info is not None else "topk",
                         info.store_format().get("sampling") if info else None,
                         info.normalisation if info is not None else "full")


def verify_pair(run_root: RunRoot, settings: StudentDataSettings, token: CommitRecord, topk: CommitRecord | None,
                 tokens_store: str, topk_store: str, filler: str = "precompute") -> ShardPair:
    """Top-K shard i must be made from token shard i, with this config's K and seq_len."""
    token_path = f"{tokens_store}/{token.data_file}"
    topk_path = f"{topk_store}/{data_file_name('topk', token.shard_id)}"
    shown = run_root.display(topk_path)
    if topk is None:
        recorded = run_root.exists(f"{topk_store}/{commit_file_name('topk', token.shard_id)}")
        raise StoreError(f"top-K shard {shown} " + ("is missing though its commit record is there (deleted or "
                                                     f"lost); run {filler} again, which computes it again" if recorded
                                                     else f"is not committed; run {filler} first"))
    problem = alignment_problem(token, topk)
    if problem is not None:
        raise StoreError(f"top-K shard {shown} {problem}")
    stored = {"top_k": topk.extra.top_k, "seq_len": topk.extra.seq_len}
    if None in stored.values():  # not recorded by the writer: read the shard's stream header (one small read)
        stored = stream_schema_ints(run_root, topk_path)
    if stored.get("top_k") != settings.top_k:
        raise StoreError(f"top-K shard {shown} has K={stored.get('top_k')}, precompute.top_k is {settings.top_k}")
    if stored.get("seq_len") != settings.seq_len:
        raise StoreError(f"top-K shard {shown} has seq_len {stored.get('seq_len')}, the token store's is "
                         f"{settings.seq_len}")
    return ShardPair(token.shard_id, token.rows, token_path, topk_path, token.bytes, topk.bytes, topk.extra.micro_batch)


# --- order, sharding, reading -----------------------------------------------------------------------------


def epoch_permutation(rows: int, seed: int, epoch: int) -> np.ndarray:
    """(rows,) int64: the order of global training rows in epoch `epoch`, fixed by the seed alone."""
    return np.random.default_rng([seed % (1 << 63), epoch]).permutation(rows)


class DistillData:
    """Training and held-out rows of verified stores. A batch reads just its rows (kdflow.schemas.shard_rows):
    gathered from memory maps on local disk, fetched as byte ranges from object stores; nothing is cached
    but each shard's small index, so memory does not grow with the store."""

    def __init__(self, run_root: RunRoot, stores: DistillStores, *, eval_shards: int, eval_sequences: int,
                 seed: int) -> None:
        shards = len(stores.pairs)
        problem = held_out_problem(eval_shards, shards, sum(pair.rows for pair in stores.pairs))
        if problem:
            raise ConfigError(problem)
        self.run_root, self.stores, self.seed = run_root, stores, seed
        self.train_pairs = stores.pairs[: shards - eval_shards]
        self.eval_pairs = stores.pairs[shards - eval_shards:]
        self.offsets = np.cumsum([0] + [pair.rows for pair in self.train_pairs])  # (S + 1,) first global row of each
        self.train_rows = int(self.offsets[-1])
        if self.train_rows == 0:
            raise StoreError("the training shards hold no rows")
        held_out = [(pair, row) for pair in self.eval_pairs for row in range(pair.rows)]
        self.eval_rows: list[tuple[ShardPair, int]] = held_out[:eval_sequences]
        if eval_shards and len(held_out) < eval_sequences:
            logger.info("held-out evaluation on the %d sequences of the last %d shard(s): student.eval_sequences=%d "
                        "asks more than they hold", len(held_out), eval_shards, eval_sequences)
        self._epoch_order = functools.lru_cache(maxsize=2)(
            lambda epoch: epoch_permutation(self.train_rows, seed, epoch))
        self._train_ids = np.array([pair.shard_id for pair in self.train_pairs], dtype=np.int64)  # (S,)
        self._pairs = {pair.shard_id: pair for pair in stores.pairs}
        self._readers: dict[int, tuple[ShardRows, TopkRows]] = {}
        self._readers_lock = threading.Lock()

    def global_batch(self, position: int, batch_size: int) -> np.ndarray:
        """(batch_size,) global row indices of the batch starting at global position `position`."""
        parts, taken = [], 0
        while taken < batch_size:
            epoch, offset = divmod(position + taken, self.train_rows)
            take = min(batch_size - taken, self.train_rows - offset)
            parts.append(self._epoch_order(epoch)[offset:offset + take])
            taken += take
        return np.concatenate(parts)

    def rank_rows(self, position: int, batch_size: int, rank: int, world_size: int) -> np.ndarray:
        return self.global_batch(position, batch_size)[rank::world_size]

    def step_batches(self, position: int, batch_size: int, grad_accum: int, rank: int, world_size: int,
                     pin: bool = False) -> list[DistillBatch]:
        """This rank's micro-batches of the optimiser step at `position` (page-locked for a CUDA copy if `pin`)."""
        rows = self.rank_rows(position, batch_size, rank, world_size)  # this rank's rows of the global batch
        batches = [self.train_batch(micro) for micro in np.split(rows, grad_accum)]
        return [batch.pinned() for batch in batches] if pin else batches

    def locate(self, global_rows: np.ndarray) -> list[tuple[ShardPair, int]]:
        shard_index = np.searchsorted(self.offsets, global_rows, side="right") - 1
        return [(self.train_pairs[s], int(g - self.offsets[s])) for s, g in zip(shard_index, global_rows, strict=True)]

    def train_batch(self, global_rows: np.ndarray) -> DistillBatch:
        shard_index = np.searchsorted(self.offsets, global_rows, side="right") - 1  # (n,)
        return self.gather(self._train_ids[shard_index], global_rows - self.offsets[shard_index])

    def eval_batches(self, batch_size: int, rank: int = 0, world_size: int = 1) -> list[list[tuple[ShardPair, int]]]:
        mine = self.eval_rows[rank::world_size]
        return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]

    def load(self, rows: list[tuple[ShardPair, int]]) -> DistillBatch:
        """The batch of these (shard, row) pairs, in order."""
        return self.gather(np.array([pair.shard_id for pair, _ in rows], dtype=np.int64),
                           np.array([row for _, row in rows], dtype=np.int64))

    def gather(self, shard_ids: np.ndarray, rows: np.ndarray) -> DistillBatch:
        """(n,) shard ids and (n,) rows within them -> the batch of those rows, in order. One read request
        per shard and file (all shards' ranges fetched together on object stores), one decode per shard
        (v1: the rows' bytes; v2 and sampled targets: the record batches holding the rows, decoded), and
        numpy fancy-index assignment into the batch: no Python loop over rows."""
        seq_len, sampled = self.stores.seq_len, self.stores.targets != "topk"
        order = np.argsort(shard_ids, kind="stable")
        starts = np.flatnonzero(np.r_[True, shard_ids[order][1:] != shard_ids[order][:-1]]) if len(order) else order
        groups = np.split(order, starts[1:])  # positions in the batch, one array per shard
        requests, readers = [], []
        for positions in groups:
            token_rows, topk_rows = self._shard_readers(int(shard_ids[positions[0]]))
            requests += [(token_rows, rows[positions]), (topk_rows, rows[positions])]
            readers.append(topk_rows)
        fetched = take_rows(requests)
        input_ids = np.empty((len(rows), seq_len), dtype=np.int64)  # (n, T)
        parts_out: list[np.ndarray] = []  # ids, log-probs, tail (and sample ids, log-probs, log threshold)
        target: np.ndarray | None = None  # (n, T) bool, once a shard holds a mask
        for i, (positions, reader) in enumerate(zip(groups, readers, strict=True)):
            input_ids[positions] = decode_token_rows(fetched[2 * i], seq_len)
            decoded = reader.decode(fetched[2 * i + 1], rows[positions])
            parts = [decoded.ids, decoded.logprobs, decoded.tail]
            if sampled:
                parts += [decoded.sample_ids, decoded.sample_logprobs, decoded.log_threshold]
            if not parts_out:
                parts_out = [np.empty((len(rows), *part.shape[1:]), dtype=part.dtype) for part in parts]
            for out, part in zip(parts_out, parts, strict=True):
                out[positions] = part
            if getattr(decoded, "target", None) is not None:  # a masked shard: positions without a target
                target = np.ones((len(rows), seq_len), dtype=bool) if target is None else target
                target[positions] = decoded.target
        tensors = [torch.from_numpy(part) for part in parts_out]
        return DistillBatch(torch.from_numpy(input_ids), *tensors[:3], samples=tuple(tensors[3:]) if sampled else None,
                            target=None if target is None else torch.from_numpy(target))

    def _shard_readers(self, shard_id: int) -> tuple[ShardRows, TopkRows]:
        with self._readers_lock:
            if shard_id not in self._readers:
                pair, stores = self._pairs[shard_id], self.stores
                self._readers[shard_id] = (
                    ShardRows(self.run_root, pair.token_path,
                              pair.token_bytes or self.run_root.size(pair.token_path), pair.rows),
                    TopkRows(self.run_root, pair.topk_path, pair.topk_bytes or self.run_root.size(pair.topk_path),
                             pair.rows, pair.topk_batch_rows, seq_len=stores.seq_len, top_k=stores.top_k,
                             targets=stores.targets, store_codec=stores.codec))
            return self._readers[shard_id]


def open_distill_data(run_root: RunRoot, settings: TrainingSettings, tokenizer: Any) -> DistillData:
    data = settings.data
    return DistillData(run_root, open_stores(run_root, settings, tokenizer), eval_shards=data.eval_shards,
                       eval_sequences=data.eval_sequences, seed=data.seed)
