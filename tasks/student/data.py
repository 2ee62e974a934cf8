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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kdflow.schemas.commits import CommitRecord, list_commits, read_commit, read_complete, stage_dir
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.fingerprints import corpus_fingerprint, tokens_fingerprint, topk_fingerprint
from kdflow.schemas.layout import TOPK_DIR, data_file_name
from kdflow.schemas.codec_sampled import SampledShard
from kdflow.schemas.shards import TopkShard, read_token_shard, stream_schema_ints
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.stores import alignment_problem, find_topk_stores, format_mismatch, read_store_info, topk_tags
from kdflow.tasks.common.models import teacher_fingerprint
from kdflow.tasks.student.model import check_token_store_tokenizer


@dataclass(frozen=True)
class ShardPair:
    shard_id: int
    rows: int
    token_path: str
    topk_path: str


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


@dataclass(frozen=True)
class DistillBatch:
    input_ids: torch.Tensor  # (n, T) int64
    topk_ids: torch.Tensor  # (n, T, K) int32; -1 = padding (adaptive K)
    topk_logprobs: torch.Tensor  # (n, T, K) float16 | float32; -inf = padding
    tail_logprob: torch.Tensor  # (n, T) float32: log of the teacher's mass outside the ids (v1: from 1 - sum)
    # Sampled targets: topk_* hold the head (K = H, 0 for `sampled`), these the sample_ids (n, T, S) int32,
    # sample_logprobs (n, T, S) float32 and log_threshold (n, T) float32 (kdflow.tasks.common.sampled).
    samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def to(self, device: torch.device | str) -> DistillBatch:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return DistillBatch(*map(move, (self.input_ids, self.topk_ids, self.topk_logprobs, self.tail_logprob)),
                            samples=None if self.samples is None else tuple(map(move, self.samples)))


# --- locating and verifying the stores --------------------------------------------------------------------


def find_topk_store(run_root: RunRoot, config: KDFlowConfig, tokens_fp: str, first_token: CommitRecord) -> str:
    """The top-K store to train on: `student.topk_tag`; else the store precompute made for this config's
    teacher, K and token store (found through its `_store.json`; of several, e.g. a CPU and a GPU pass
    with dtype auto, the one this host would make); else the one store without `_store.json` whose first
    shard was made from this token store (written by other tools)."""
    if config.student.topk_tag is not None:
        return stage_dir(run_root, "topk", config.student.topk_tag)
    made_for_config = find_topk_stores(run_root, config)
    if len(made_for_config) > 1:
        here = topk_fingerprint(teacher_fingerprint(config.teacher), tokens_fp, config)
        made_for_config = [tag for tag in made_for_config if tag == here] or made_for_config
    if len(made_for_config) == 1:
        return stage_dir(run_root, "topk", made_for_config[0])
    topk_root = run_root.display(run_root.path(TOPK_DIR))
    if made_for_config:
        raise StoreError(f"several top-K stores under {topk_root} fit this config ({', '.join(made_for_config)}): "
                         "choose one with student.topk_tag")
    other_format = find_topk_stores(run_root, config, any_format=True)
    if other_format:  # made for this teacher, K and token store, with other format settings: name both
        store = stage_dir(run_root, "topk", other_format[0])
        raise StoreError(format_mismatch(read_store_info(run_root, store), config, run_root.display(store)))
    ours, others = [], []
    for tag in topk_tags(run_root):
        if read_store_info(run_root, stage_dir(run_root, "topk", tag)) is not None:
            others.append(tag)  # made by precompute, for another teacher, K or token store
            continue
        record = read_commit(run_root, stage_dir(run_root, "topk", tag), "topk", 0)
        if record is not None:
            (ours if record.input_sha256 == first_token.sha256 else others).append(tag)
    if len(ours) == 1:
        return stage_dir(run_root, "topk", ours[0])
    if ours:
        raise StoreError(f"several top-K stores under {topk_root} were made from token store {tokens_fp} "
                         f"({', '.join(ours)}): choose one with student.topk_tag")
    found = f" (found {', '.join(others)}, made for another teacher, K or token store)" if others else ""
    raise StoreError(f"no top-K store under {topk_root} was made for this teacher, K and token store "
                     f"{tokens_fp}{found}; run precompute first")


def open_stores(config: KDFlowConfig, tokenizer: Any) -> DistillStores:
    """Find the token and top-K stores for this config and check that they belong together, shard by shard."""
    run_root = RunRoot(config.run_root)
    tokens_store = stage_dir(run_root, "tokens")
    shown = run_root.display(tokens_store)
    complete = read_complete(run_root, tokens_store)
    if complete is None:
        raise StoreError(f"token store {shown} is not complete; run tokenise first")
    tok_fp = check_token_store_tokenizer(tokenizer, complete.extra.tokenizer_fingerprint, shown)
    tokens_fp = tokens_fingerprint(corpus_fingerprint(config), tok_fp, config)
    if complete.fingerprint != tokens_fp:
        raise StoreError(f"token store {shown} (fingerprint {complete.fingerprint}) was made from another dataset, "
                         f"seq_len or shard size than this config ({tokens_fp}); run tokenise first")
    token_records = list_commits(run_root, tokens_store, "tokens", tokens_fp)
    missing = [i for i in range(complete.shards) if i not in token_records]
    if missing or not token_records:
        raise StoreError(f"token store {shown} lacks shard(s) {missing[:5] or 'all'}; run tokenise first")

    topk_store = find_topk_store(run_root, config, tokens_fp, token_records[0])
    info = read_store_info(run_root, topk_store)
    mismatch = format_mismatch(info, config, run_root.display(topk_store)) if info is not None else None
    if mismatch is not None:  # student.topk_tag named a store of other format settings
        raise StoreError(mismatch)
    topk_records = list_commits(run_root, topk_store, "topk")
    fingerprints = {record.fingerprint for record in topk_records.values()}
    if len(fingerprints) > 1:
        raise StoreError(f"top-K store {run_root.display(topk_store)} mixes fingerprints {sorted(fingerprints)}")
    pairs = tuple(_verify_pair(run_root, config, token_records[i], topk_records.get(i), tokens_store, topk_store)
                  for i in range(complete.shards))
    return DistillStores(tokens_store, topk_store, tokens_fp, tok_fp, fingerprints.pop(), config.seq_len,
                         config.precompute.top_k, pairs, info.codec if info is not None else None,
                         info.targets if info is not None else "topk", info.store_format().get("sampling") if info else None)


def _verify_pair(run_root: RunRoot, config: KDFlowConfig, token: CommitRecord, topk: CommitRecord | None,
                 tokens_store: str, topk_store: str) -> ShardPair:
    """Top-K shard i must be made from token shard i, with this config's K and seq_len."""
    token_path = f"{tokens_store}/{token.data_file}"
    topk_path = f"{topk_store}/{data_file_name('topk', token.shard_id)}"
    shown = run_root.display(topk_path)
    if topk is None:
        raise StoreError(f"top-K shard {shown} is not committed; run precompute first")
    problem = alignment_problem(token, topk)
    if problem is not None:
        raise StoreError(f"top-K shard {shown} {problem}")
    stored = {"top_k": topk.extra.top_k, "seq_len": topk.extra.seq_len}
    if None in stored.values():  # not recorded by the writer: read the shard's stream header (one small read)
        stored = stream_schema_ints(run_root, topk_path)
    if stored.get("top_k") != config.precompute.top_k:
        raise StoreError(f"top-K shard {shown} has K={stored.get('top_k')}, precompute.top_k is {config.precompute.top_k}")
    if stored.get("seq_len") != config.seq_len:
        raise StoreError(f"top-K shard {shown} has seq_len {stored.get('seq_len')}, the token store's is {config.seq_len}")
    return ShardPair(token.shard_id, token.rows, token_path, topk_path)


# --- order, sharding, reading -----------------------------------------------------------------------------


def epoch_permutation(rows: int, seed: int, epoch: int) -> np.ndarray:
    """(rows,) int64: the order of global training rows in epoch `epoch`, fixed by the seed alone."""
    return np.random.default_rng([seed % (1 << 63), epoch]).permutation(rows)


class DistillData:
    """Training and held-out rows of verified stores; shards are read lazily (memory-mapped on local disk)."""

    def __init__(self, run_root: RunRoot, stores: DistillStores, *, eval_shards: int, eval_sequences: int, seed: int) -> None:
        shards = len(stores.pairs)
        if eval_shards >= shards:
            raise ConfigError(f"student.eval_shards={eval_shards} leaves no training shard: the token store has {shards}")
        self.run_root, self.stores, self.seed = run_root, stores, seed
        self.train_pairs = stores.pairs[: shards - eval_shards]
        self.eval_pairs = stores.pairs[shards - eval_shards:]
        self.offsets = np.cumsum([0] + [pair.rows for pair in self.train_pairs])  # (S + 1,) first global row of each
        self.train_rows = int(self.offsets[-1])
        if self.train_rows == 0:
            raise StoreError("the training shards hold no rows")
        held_out = [(pair, row) for pair in self.eval_pairs for row in range(pair.rows)]
        self.eval_rows: list[tuple[ShardPair, int]] = held_out[:eval_sequences]
        self._epoch_order = functools.lru_cache(maxsize=2)(lambda epoch: epoch_permutation(self.train_rows, seed, epoch))

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

    def locate(self, global_rows: np.ndarray) -> list[tuple[ShardPair, int]]:
        shard_index = np.searchsorted(self.offsets, global_rows, side="right") - 1
        return [(self.train_pairs[s], int(g - self.offsets[s])) for s, g in zip(shard_index, global_rows, strict=True)]

    def train_batch(self, global_rows: np.ndarray) -> DistillBatch:
        return self.load(self.locate(global_rows))

    def eval_batches(self, batch_size: int, rank: int = 0, world_size: int = 1) -> list[list[tuple[ShardPair, int]]]:
        mine = self.eval_rows[rank::world_size]
        return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]

    def load(self, rows: list[tuple[ShardPair, int]]) -> DistillBatch:
        """Gather rows from their shards: v1 rows copied out of the memory map, v2 rows decoded."""
        input_ids, topk_ids, topk_logprobs, tail_logprob, samples = [], [], [], [], []
        for pair, row in rows:
            tokens, topk = self._shard(pair)
            decoded = topk.read([row])  # (1, T, K), (1, T, K), (1, T); sampled targets: the head as K, and samples
            input_ids.append(tokens[row])
            topk_ids.append(decoded.ids[0])
            topk_logprobs.append(decoded.logprobs[0])
            tail_logprob.append(decoded.tail[0])
            if self.stores.targets != "topk":
                samples.append((decoded.sample_ids[0], decoded.sample_logprobs[0], decoded.log_threshold[0]))
        return DistillBatch(torch.from_numpy(np.stack(input_ids).astype(np.int64)),  # (n, T)
                            torch.from_numpy(np.stack(topk_ids)),  # (n, T, K)
                            torch.from_numpy(np.stack(topk_logprobs)),  # (n, T, K)
                            torch.from_numpy(np.stack(tail_logprob)),  # (n, T)
                            samples=tuple(torch.from_numpy(np.stack(part)) for part in zip(*samples)) if samples else None)

    @functools.cache  # noqa: B019 - one DistillData per run: its shards stay mapped (local) or loaded (remote)
    def _shard(self, pair: ShardPair) -> tuple[np.ndarray, TopkShard]:
        tokens = read_token_shard(self.run_root, pair.token_path, self.stores.seq_len)  # (rows, T)
        topk = (TopkShard(self.run_root, pair.topk_path, self.stores.seq_len, self.stores.top_k) if self.stores.targets == "topk"
                else SampledShard(self.run_root, pair.topk_path, self.stores.seq_len))
        if tokens.shape[0] != pair.rows or topk.rows != pair.rows:
            raise StoreError(f"{self.run_root.display(pair.topk_path)}: row count differs from its commit record")
        settings = None if topk.codec is None else topk.codec.settings()
        if self.stores.codec is not None and settings != self.stores.codec:
            raise StoreError(f"{topk.path} was written with codec {settings}, its store's is {self.stores.codec}: "
                             "a store never mixes codecs; delete the shard's commit record and rerun precompute")
        return tokens, topk


def open_distill_data(config: KDFlowConfig, tokenizer: Any) -> DistillData:
    student = config.student
    stores = open_stores(config, tokenizer)
    return DistillData(RunRoot(config.run_root), stores, eval_shards=student.eval_shards,
                       eval_sequences=student.eval_sequences, seed=student.seed)
