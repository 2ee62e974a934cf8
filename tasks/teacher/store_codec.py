"""The codec a v2 top-K store is written with: the config's `precompute.store` settings, the teacher's
vocabulary, and (renumbering: unigram) the token store's unigram counts as a frequency renumbering.

The renumbering table is a deterministic function of the token store (stable sort, ties by id), so every
worker of a fanned-out pass, on any machine, builds the same table; the first one keeps it in
`topk/TAG/_renumbering.bin` so the others need not read the whole token store again. Every shard also
carries the table in its own schema metadata, so a shard decodes on its own.
"""

from __future__ import annotations

import numpy as np

from kdflow.schemas.codec import TopkCodec
from kdflow.schemas.codec_meta import Renumbering
from kdflow.schemas.commits import StageComplete, list_commits, stage_dir
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.layout import RENUMBERING_FILE
from kdflow.schemas.shards import read_token_shard
from kdflow.schemas.stage_settings import TeacherPassSettings
from kdflow.schemas.storage import RunRoot


def unigram_counts(run_root: RunRoot, tokens_done: StageComplete, vocab_size: int) -> np.ndarray:
    """(vocab_size,) int64: how often each id occurs in the committed token store (ids >= vocab_size ignored)."""
    tokens_store = stage_dir(run_root, "tokens")
    records = list_commits(run_root, tokens_store, "tokens", tokens_done.fingerprint)
    missing = [i for i in range(tokens_done.shards) if i not in records]
    if missing:
        raise StoreError(f"token shard {missing[0]} in {run_root.display(tokens_store)} is not committed; "
                         "run tokenise again")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for shard_id in range(tokens_done.shards):
        input_ids = read_token_shard(run_root, f"{tokens_store}/{records[shard_id].data_file}")  # (rows, T)
        ids = input_ids.ravel()
        counts += np.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    return counts


def renumbering_table(run_root: RunRoot, store: str, tokens_done: StageComplete, vocab_size: int) -> Renumbering:
    """The store's frequency renumbering: read from its `_renumbering.bin`, else counted and written there."""
    path = f"{store}/{RENUMBERING_FILE}"
    try:
        return Renumbering.from_bytes(run_root.read_bytes(path), vocab_size)
    except (FileNotFoundError, ValueError):  # none yet, or damaged: count (the same table comes out)
        pass
    table = Renumbering.from_counts(unigram_counts(run_root, tokens_done, vocab_size))
    run_root.write_bytes_atomic(path, table.to_bytes())
    return table


def store_codec(settings: TeacherPassSettings, run_root: RunRoot, store: str, tokens_done: StageComplete,
                vocab_size: int, masked: bool = False, normalisation: str = "full", short: bool = False
                ) -> TopkCodec | None:
    """The v2 codec for this config's store and teacher vocabulary; None when the config asks for v1. `masked`
    (a per-position target mask) and `normalisation` ("top_k": log-probs renormalised over the K, no tail) are
    properties of an imported source: they make the v3 codec, which v1 stores cannot hold. `short`: some
    position of an imported source holds fewer than K entries, so the store keeps each position's count (adaptive
    K at keep_mass 1, which keeps every entry) unless the config asks for adaptive K already."""
    stored = settings.precompute.store
    if short and stored.format == "v2" and stored.keep_mass is None:
        stored = stored.model_copy(update={"keep_mass": 1.0})
    if stored.format == "v1":
        if masked or normalisation != "full":
            what = "a target mask" if masked else "log-probs renormalised over the top-K (no tail)"
            raise ConfigError(f"the source holds {what}, which a v1 store cannot: set precompute.store.format: v2")
        return None
    if normalisation != "full" and stored.keep_mass not in (None, 1.0):
        raise ConfigError("the source's log-probs are renormalised over the top-K, so adaptive K has no tail to fold "
                          "dropped mass into: set precompute.store.keep_mass: null")
    table = renumbering_table(run_root, store, tokens_done, vocab_size) if stored.renumbering == "unigram" else None
    codec = TopkCodec(settings.seq_len, settings.precompute.top_k, vocab_size, values=stored.values,
                      levels=stored.levels, tail=stored.tail, keep_mass=stored.keep_mass, zstd_level=stored.zstd_level,
                      renumbering=table, masked=masked, normalisation=normalisation)
    codec.schema()  # built once here (compresses the table), shared by every shard and the writer thread
    return codec
