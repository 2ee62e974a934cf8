"""`kdflow bench store`: bytes/position, KL and speed of every top-K codec setting, one JSON object per line.

Real (default): the demo teacher (SmolLM2-135M-Instruct, V = 49,152) at K = 128 on Python's docs
(`pydoc_data.topics`, as the demo), through the real pipeline (materialise, tokenise, precompute) into two
stores under `--run-root`: the default codec, and a lossless one (float32 values and tail: the teacher's
float32 capture, exactly). Every setting is then encoded from the lossless store's contents, shard by shard
as a store would hold them. Per setting:
- `kl_teacher_store_*`: the store metric, KL(teacher || what the store implies: its ids at their stored probabilities,
  its tail spread evenly over the ids it does not hold) over the full vocabulary, per position, in nats
  (`kdflow.tasks.teacher.store_metric.full_kl_from_topk`; the tail's sum of p log p from a dense teacher pass
  over the same rows). The same definition for every setting: smaller is more faithful, adaptive K included.
- `kl_buckets_lower_bound_*`: KL(exact || decoded) over the K+1 buckets (the decoded side normalised: what the
  loss fits to), `kdflow.tasks.teacher.store_quality.bucket_kl`. Partition-dependent: an adaptive store merges
  the ids it drops into the rest bucket on both sides, which can only lower it. A lower bound, not a ranking.
- `bytes_per_position`: every byte of the store as the teacher pass would write it, counted by
  `kdflow.schemas.store_bytes` on a store folder written here: the shards' whole data files (schema, codec
  settings, each shard's copy of the renumbering table, one record batch per shard here), a commit record
  per shard (the pass's timing fields left out), `_complete.json`, `_renumbering.bin`, and (real) the real
  default store's `_store.json` and `config.yaml`; `ids_B` / `values_B` / `tail_B` split the row payload only.
  `bytes_over_default_codec` and `bytes_over_lossless` are its ratios to the default codec's and to the
  lossless float32 setting's (both measured in the same run).
`--train-steps N` also trains the same student on both stores (kdflow/bench/store_train.py).

Synthetic (`--synthetic`): a Zipf-like teacher with V = 196,608 written here in numpy, see `synthetic_capture`
(its logits are the dense pass).

Encode and decode rates are single-threaded; run it alone (`flock /work/wt/heavy.lock ...` on shared
machines) and read the load average printed beside every line.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from kdflow.bench.args import bench_parser
from kdflow.bench.harness import note, open_root
from kdflow.schemas.codec import DecodedTopk, TopkCodec, decode, encode, from_v1
from kdflow.schemas.codec_meta import CRC32, Renumbering
from kdflow.schemas.commits import CommitRecord, StageComplete, TopkShardInfo, write_commit, write_complete
from kdflow.schemas.layout import RENUMBERING_FILE, data_file_name
from kdflow.schemas.shards import topk_batch, topk_schema
from kdflow.schemas.store_bytes import StoreBytes, store_bytes

# (label, TopkCodec options; "table": "unigram" renumbers by the token store's counts, None codes ids as they are)
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("sqrt400/none", {"table": None}),
    ("sqrt400/unigram (default)", {"table": "unigram"}),
    ("sqrt400/unigram/tail32", {"table": "unigram", "tail": "float32"}),
    ("sqrt256/unigram", {"table": "unigram", "levels": 256}),
    ("sqrt320/unigram", {"table": "unigram", "levels": 320}),
    ("sqrt512/unigram", {"table": "unigram", "levels": 512}),
    ("float16/unigram (lossless fp16)", {"table": "unigram", "values": "float16"}),
    ("float32/unigram/tail32 (lossless)", {"table": "unigram", "values": "float32", "tail": "float32"}),
    ("sqrt400/unigram/keep0.99", {"table": "unigram", "keep_mass": 0.99}),
    ("sqrt400/unigram/keep0.999", {"table": "unigram", "keep_mass": 0.999}),
    ("float16/unigram/keep0.999", {"table": "unigram", "values": "float16", "keep_mass": 0.999}),
]
ID_COLUMNS = ("kept", "gap_")
VALUE_COLUMNS = ("level_min", "value_")
DEFAULT, LOSSLESS = "sqrt400/unigram (default)", "float32/unigram/tail32 (lossless)"
# ids (r, T, K) int32, logprobs (r, T, K) float32, tail (r, T) float32
Shard = tuple[np.ndarray, np.ndarray, np.ndarray]


def _loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def _best_seconds(function: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def _stream(schema: pa.Schema, batches: list[pa.RecordBatch]) -> bytes:
    sink = io.BytesIO()
    with ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue()


def written_store_bytes(codec: TopkCodec | None, schema: pa.Schema, batches: list[pa.RecordBatch],
                        table: Renumbering | None, store_files: dict[str, bytes]) -> StoreBytes:
    """The shards (one record batch each) written as the teacher pass writes a store, into a temporary folder,
    and counted by `kdflow.schemas.store_bytes` (as `kdflow store report` counts a real store)."""
    with tempfile.TemporaryDirectory(prefix="kdflow-bench-store-") as folder:
        run_root, seq_len = open_root(folder), int(schema.metadata[b"kdflow.seq_len"])
        info = TopkShardInfo(teacher_fingerprint="0" * 16, tokens_fingerprint="0" * 16, seq_len=seq_len,
                             top_k=int(schema.metadata[b"kdflow.top_k"]), micro_batch=4,
                             format="v2" if codec is not None else None,
                             codec=codec.settings() if codec is not None else None)
        records = {}
        for shard_id, batch in enumerate(batches):
            data, name = _stream(schema, [batch]), data_file_name("topk", shard_id)
            run_root.write_bytes_atomic(f"{folder}/{name}", data)
            sha = hashlib.sha256(data).hexdigest()
            records[shard_id] = CommitRecord(stage="topk", shard_id=shard_id, data_file=name, rows=batch.num_rows,
                                             tokens=batch.num_rows * seq_len, bytes=len(data), sha256=sha,
                                             input_sha256=sha, fingerprint="0" * 12, extra=info)
            write_commit(run_root, folder, records[shard_id])
        write_complete(run_root, folder, StageComplete(stage="topk", shards=len(records), fingerprint="0" * 12,
                                                       rows=sum(r.rows for r in records.values()),
                                                       tokens=sum(r.tokens for r in records.values())))
        for name, data in ({**store_files, RENUMBERING_FILE: table.to_bytes()} if table else store_files).items():
            run_root.write_bytes_atomic(f"{folder}/{name}", data)
        return store_bytes(run_root, folder, records)


def _exact(shard: Shard) -> DecodedTopk:
    ids, logprobs, tail = shard
    return DecodedTopk(ids, logprobs, tail, np.full(tail.shape, ids.shape[-1], np.int32))


def _invalid(decoded: DecodedTopk, exact_tail: np.ndarray) -> int:
    """Positions whose tail is NaN or positive, or zero where the teacher has tail mass, or with a kept non-finite
    log-prob."""
    kept = np.arange(decoded.ids.shape[-1]) < decoded.kept[..., None]
    bad = np.isnan(decoded.tail) | (decoded.tail > 0) | (np.isneginf(decoded.tail) & ~np.isneginf(exact_tail))
    return int((bad | ~np.where(kept, np.isfinite(decoded.logprobs), True).all(-1)).sum())


def measure_setting(label: str, options: dict[str, Any], shards: list[Shard], vocab: int, table: Renumbering | None,
                    repeats: int, tail_plogp: list[np.ndarray], store_files: dict[str, bytes]) -> dict[str, Any]:
    """Encode every shard with one codec setting; bytes, the full KL to the teacher and the K+1-bucket lower bound
    against the exact input, invalid tails, speed."""
    from kdflow.tasks.teacher.store_fidelity import bucket_fields, bucket_kl
    from kdflow.tasks.teacher.store_metric import STORE_KL, full_kl_from_topk, kl_summary

    options = dict(options)
    renumbering = table if options.pop("table") == "unigram" else None
    _, seq_len, top_k = shards[0][0].shape
    codec = TopkCodec(seq_len, top_k, vocab, renumbering=renumbering, **options)
    schema_bytes = len(codec.schema().serialize())
    split = {"ids_B": 0, "values_B": 0, "tail_B": 0}
    batches, kls, full, invalid, kept, moved = [], [], [], 0, [], []
    encode_s = decode_s = row_s = 0.0
    rng = np.random.default_rng(0)
    for shard, plogp in zip(shards, tail_plogp, strict=True):
        batch = encode(codec, *shard)
        batches.append(batch)
        for name in batch.schema.names:
            if name != CRC32:
                key = ("ids_B" if name.startswith(ID_COLUMNS) else "values_B" if name.startswith(VALUE_COLUMNS)
                       else "tail_B")
                split[key] += batch.column(name).buffers()[-1].size
        decoded = decode(batch, codec=codec)
        kl, _ = bucket_kl(_exact(shard), decoded)
        kls.append(kl.ravel())
        full.append(full_kl_from_topk(_exact(shard), plogp, vocab, decoded).ravel())
        invalid += _invalid(decoded, shard[2])
        kept.append(decoded.kept.ravel())
        dropped = np.arange(top_k) >= decoded.kept[..., None]
        moved.append(np.where(dropped, np.exp(shard[1].astype(np.float64)), 0.0).sum(-1).ravel())
        encode_s += _best_seconds(lambda s=shard: encode(codec, *s), repeats)
        decode_s += _best_seconds(lambda b=batch: decode(b, codec=codec), repeats)
        picks = rng.integers(0, batch.num_rows, 4)  # the data loader's access: single random rows
        one_rows = _best_seconds(lambda b=batch: [decode(b.slice(int(r), 1), codec=codec) for r in picks], repeats)
        row_s += one_rows / len(picks)
    positions = sum(s[2].size for s in shards)
    sizes = written_store_bytes(codec, codec.schema(), batches, renumbering, store_files)
    return {
        "setting": label, "vocab": vocab, "positions": positions, "shards": len(shards),
        "bytes_per_position": round(sizes.per_position, 2), **{k: round(v / positions, 2) for k, v in split.items()},
        "renumbering_table_B": len(renumbering.to_bytes()) if renumbering is not None else 0,
        "data_B": round(sizes.data / positions, 2), "records_and_store_files_B":
            round((sizes.records + sizes.store_files) / positions, 2), "schema_metadata_B_per_shard": schema_bytes,
        **kl_summary(np.concatenate(full), STORE_KL), **bucket_fields(np.concatenate(kls)),
        "invalid_positions": invalid, "mean_kept": float(np.concatenate(kept).mean()),
        "mass_moved_to_tail": float(np.concatenate(moved).mean()),
        "encode_pos_s": round(positions / encode_s), "decode_pos_s": round(positions / decode_s),
        "decode_one_row_pos_s": round(len(shards) * seq_len / row_s), "loadavg_1m": _loadavg(),
        "codec": codec.settings(),
    }


def measure_v1(shards: list[Shard], vocab: int, tail_plogp: list[np.ndarray], store_files: dict[str, bytes]
               ) -> dict[str, Any]:
    """v1 for comparison: int32 ids + float16 log-probs, the tail derived as 1 - sum(exp) (what v1 readers do).
    KL figures are over the positions where they are finite; `share_infinite_kl`: where the derived tail is 0."""
    from kdflow.tasks.teacher.store_fidelity import bucket_kl
    from kdflow.tasks.teacher.store_metric import STORE_KL, full_kl_from_topk

    _, seq_len, top_k = shards[0][0].shape
    schema = topk_schema(seq_len, top_k, "float16")
    batches = [pa.record_batch(list(topk_batch(ids, lp, "float16")), schema=schema) for ids, lp, _ in shards]
    kls, full, invalid = [], [], 0
    for shard, plogp in zip(shards, tail_plogp, strict=True):
        decoded = from_v1(shard[0], shard[1].astype(np.float16))
        decoded = decoded._replace(logprobs=decoded.logprobs.astype(np.float32))
        with np.errstate(divide="ignore"):
            kls.append(bucket_kl(_exact(shard), decoded)[0].ravel())
            full.append(full_kl_from_topk(_exact(shard), plogp, vocab, decoded).ravel())
        invalid += _invalid(decoded, shard[2])
    kl, full_kl = np.concatenate(kls), np.concatenate(full)
    finite = np.isfinite(full_kl)
    positions = sum(s[2].size for s in shards)
    sizes = written_store_bytes(None, schema, batches, None, store_files)
    return {"setting": "v1 int32 ids + float16, tail = 1 - sum", "vocab": vocab, "positions": positions,
            "bytes_per_position": round(sizes.per_position, 2), "data_B": round(sizes.data / positions, 2),
            f"{STORE_KL}_mean": float(full_kl[finite].mean()), f"{STORE_KL}_max": float(full_kl[finite].max()),
            "kl_buckets_lower_bound_mean": float(kl[finite].mean()), "share_infinite_kl": float((~finite).mean()),
            "invalid_positions": invalid, "loadavg_1m": _loadavg()}


def synthetic_capture(vocab: int, rows: int, seq_len: int, top_k: int, seed: int = 0
                      ) -> tuple[list[Shard], np.ndarray, list[np.ndarray]]:
    """A Zipf-like teacher over `vocab` ids, exact top-K and tail in float32 (64 positions at a time).

    Token i has frequency rank perm[i] (a random permutation: ids are not frequency ordered) and base
    log-frequency -1.1 log(1 + rank) (Zipf); each position's logits are s * (base + 2.2 * N(0, 1) per token),
    with a confidence s ~ U(0.8, 2.5) per position. The tail is the log-sum-exp over the complement of the
    top-K minus the full one. Unigram counts (the renumbering's input) are a 20M-token sample of the base
    distribution. -> (one shard of `rows` rows, counts, the tail's sum of p log p per position (rows, T): what the
    store metric needs of the dense distribution beyond the top-K)."""
    rng = np.random.default_rng(seed)
    base = (-1.1 * np.log1p(rng.permutation(vocab))).astype(np.float32)
    p_base = np.exp(base.astype(np.float64) - base.max())
    counts = rng.multinomial(20_000_000, p_base / p_base.sum()).astype(np.int64)
    ids = np.empty((rows * seq_len, top_k), np.int32)
    logprobs = np.empty((rows * seq_len, top_k), np.float32)
    tail = np.empty(rows * seq_len, np.float32)
    tail_plogp = np.empty(rows * seq_len)
    block = 64
    for start in range(0, rows * seq_len, block):
        n = min(block, rows * seq_len - start)
        sharp = rng.uniform(0.8, 2.5, size=(n, 1)).astype(np.float32)
        logits = sharp * (base[None] + 2.2 * rng.standard_normal((n, vocab), dtype=np.float32))  # (n, V)
        top = np.argpartition(-logits, top_k, axis=1)[:, :top_k]
        top_logits = np.take_along_axis(logits, top, 1)
        order = np.argsort(-top_logits, axis=1, kind="stable")
        top, top_logits = np.take_along_axis(top, order, 1), np.take_along_axis(top_logits, order, 1)
        peak = top_logits[:, :1]
        shifted = np.exp(logits - peak)  # (n, V)
        np.put_along_axis(shifted, top, 0.0, 1)
        rest = shifted.sum(1, dtype=np.float64)
        total = rest + np.exp(top_logits - peak).sum(1, dtype=np.float64)
        ids[start:start + n], tail[start:start + n] = top, np.log(rest) - np.log(total)
        # sum over the tail of p log p, p = shifted / total, log p = logits - peak - log total (float64 sums)
        weighted = (shifted * (logits - peak)).sum(1, dtype=np.float64)
        tail_plogp[start:start + n] = weighted / total - rest / total * np.log(total)
        logprobs[start:start + n] = top_logits - peak - np.log(total)[:, None].astype(np.float32)
    shard = (ids.reshape(rows, seq_len, top_k), logprobs.reshape(rows, seq_len, top_k), tail.reshape(rows, seq_len))
    return [shard], counts, [tail_plogp.reshape(rows, seq_len)]


def run_settings(shards: list[Shard], vocab: int, counts: np.ndarray, repeats: int, only: str | None,
                 source: str, tail_plogp: list[np.ndarray], store_files: dict[str, bytes] | None = None) -> None:
    """Every setting (and v1), printed once all are measured: each line carries its bytes over the default
    codec's and over the lossless setting's (both always measured, `--only` or not)."""
    import torch

    torch.set_num_threads(1)  # single-core rates
    table, store_files = Renumbering.from_counts(counts), store_files or {}
    records = [measure_v1(shards, vocab, tail_plogp, store_files)]
    for label, options in SETTINGS:
        if only is None or only in label or label in (DEFAULT, LOSSLESS):
            records.append(measure_setting(label, options, shards, vocab, table, repeats, tail_plogp, store_files))
    by_label = {r["setting"]: r["bytes_per_position"] for r in records}
    for record in records:
        if only is None or only in record["setting"] or record is records[0]:
            ratios = {"bytes_over_default_codec": round(record["bytes_per_position"] / by_label[DEFAULT], 4),
                      "bytes_over_lossless": round(record["bytes_per_position"] / by_label[LOSSLESS], 4)}
            print(json.dumps({"source": source} | record | ratios), flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("store", __doc__, run_root=True, repeats=3,
                          helps={"run_root": "where the real stores are built (kept for reruns)",
                                 "repeats": "timings: best of this many"})
    parser.add_argument("--shards", type=int, default=8, help="token shards of 16 rows x 512 tokens (real)")
    parser.add_argument("--synthetic", action="store_true",
                        help="the synthetic V=196,608 teacher instead of the real one")
    parser.add_argument("--vocab", type=int, default=196_608, help="synthetic vocabulary")
    parser.add_argument("--rows", type=int, default=16, help="synthetic rows of 512 positions")
    parser.add_argument("--only", default=None, help="only settings whose label contains this")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="real: also train the demo-size student this many steps on the default and the "
                             "lossless store")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.synthetic:
        started = time.perf_counter()
        shards, counts, tail_plogp = synthetic_capture(args.vocab, args.rows, 512, 128)
        note({"source": "synthetic", "vocab": args.vocab, "positions": shards[0][2].size,
              "seconds_to_build": round(time.perf_counter() - started, 1),
              "mean_tail_mass": float(np.exp(shards[0][2].astype(np.float64)).mean()),
              "mean_top1_p": float(np.exp(shards[0][1][..., 0].astype(np.float64)).mean())})
        run_settings(shards, args.vocab, counts, args.repeats, args.only, "synthetic", tail_plogp)
        return 0
    from kdflow.bench.store_train import (build_real_stores, default_store_files, dense_tail_plogp, lossless_shards,
                                          train_comparison)

    stores = build_real_stores(args.run_root, args.shards)
    shards, counts = lossless_shards(stores)
    note({"source": "real", **stores.describe()})
    run_settings(shards, stores.vocab, counts, args.repeats, args.only, "real", dense_tail_plogp(stores, shards),
                 default_store_files(stores))
    if args.train_steps:
        for record in train_comparison(stores, args.train_steps):
            print(json.dumps({"source": "real"} | record | {"loadavg_1m": _loadavg()}), flush=True)
    return 0
