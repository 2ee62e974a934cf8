"""`kdflow bench store`: bytes/position, KL and speed of every top-K codec setting, one JSON object per line.

Real (default): the demo teacher (SmolLM2-135M-Instruct, V = 49,152) at K = 128 on Python's docs
(`pydoc_data.topics`, as the demo), through the real pipeline (materialise, tokenise, precompute) into two
stores under `--run-root`: the default codec, and a lossless one (float32 values and tail: the teacher's
float32 capture, exactly). Every setting is then encoded from the lossless store's contents, shard by shard
as a store would hold them, and compared with it: KL(exact || decoded) per position over the K+1 buckets
(the decoded side normalised: what the loss fits to), `kdflow.tasks.teacher.store_report.bucket_kl`.
`--train-steps N` also trains the same student on both stores (kdflow/bench/store_train.py).

Synthetic (`--synthetic`): a Zipf-like teacher with V = 196,608 written here in numpy, see `synthetic_capture`.

Encode and decode rates are single-threaded; run it alone (`flock /work/wt/heavy.lock ...` on shared
machines) and read the load average printed beside every line.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from kdflow.bench.harness import note
from kdflow.schemas.codec import CRC32, DecodedTopk, Renumbering, TopkCodec, decode, encode, from_v1
from kdflow.schemas.shards import topk_batch, topk_schema

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


def _stream_bytes(schema: pa.Schema, batches: list[pa.RecordBatch]) -> int:
    sink = io.BytesIO()
    with ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return len(sink.getvalue())


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
                    repeats: int) -> dict[str, Any]:
    """Encode every shard with one codec setting; bytes, KL against the exact input, invalid tails, speed."""
    from kdflow.tasks.teacher.store_report import bucket_kl

    options = dict(options)
    renumbering = table if options.pop("table") == "unigram" else None
    _, seq_len, top_k = shards[0][0].shape
    codec = TopkCodec(seq_len, top_k, vocab, renumbering=renumbering, **options)
    schema_bytes = len(codec.schema().serialize())
    split = {"ids_B": 0, "values_B": 0, "tail_B": 0}
    stream, kls, invalid, kept, moved = 0, [], 0, [], []
    encode_s = decode_s = row_s = 0.0
    rng = np.random.default_rng(0)
    for shard in shards:
        batch = encode(codec, *shard)
        stream += _stream_bytes(codec.schema(), [batch]) - schema_bytes
        for name in batch.schema.names:
            if name != CRC32:
                key = ("ids_B" if name.startswith(ID_COLUMNS) else "values_B" if name.startswith(VALUE_COLUMNS)
                       else "tail_B")
                split[key] += batch.column(name).buffers()[-1].size
        decoded = decode(batch, codec=codec)
        kl, _ = bucket_kl(_exact(shard), decoded)
        kls.append(kl.ravel())
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
    kl = np.concatenate(kls)
    return {
        "setting": label, "vocab": vocab, "positions": positions, "shards": len(shards),
        "total_B": round(stream / positions, 2), **{k: round(v / positions, 2) for k, v in split.items()},
        "schema_metadata_B_per_shard": schema_bytes, "kl_mean": float(kl.mean()),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_max": float(kl.max()), "invalid_positions": invalid, "mean_kept": float(np.concatenate(kept).mean()),
        "mass_moved_to_tail": float(np.concatenate(moved).mean()),
        "encode_pos_s": round(positions / encode_s), "decode_pos_s": round(positions / decode_s),
        "decode_one_row_pos_s": round(len(shards) * seq_len / row_s), "loadavg_1m": _loadavg(),
        "codec": codec.settings(),
    }


def measure_v1(shards: list[Shard], vocab: int) -> dict[str, Any]:
    """v1 for comparison: int32 ids + float16 log-probs, the tail derived as 1 - sum(exp) (what v1 readers do)."""
    from kdflow.tasks.teacher.store_report import bucket_kl

    _, seq_len, top_k = shards[0][0].shape
    schema = topk_schema(seq_len, top_k, "float16")
    stream = sum(_stream_bytes(schema, [pa.record_batch(list(topk_batch(ids, lp, "float16")), schema=schema)])
                 - len(schema.serialize()) for ids, lp, _ in shards)
    kls, invalid = [], 0
    for shard in shards:
        decoded = from_v1(shard[0], shard[1].astype(np.float16))
        decoded = decoded._replace(logprobs=decoded.logprobs.astype(np.float32))
        with np.errstate(divide="ignore"):
            kls.append(bucket_kl(_exact(shard), decoded)[0].ravel())
        invalid += _invalid(decoded, shard[2])
    kl = np.concatenate(kls)
    finite = np.isfinite(kl)
    positions = sum(s[2].size for s in shards)
    return {"setting": "v1 int32 ids + float16, tail = 1 - sum", "vocab": vocab, "positions": positions,
            "total_B": round(stream / positions, 2), "kl_mean_where_finite": float(kl[finite].mean()),
            "kl_max_where_finite": float(kl[finite].max()), "share_infinite_kl": float((~finite).mean()),
            "invalid_positions": invalid, "loadavg_1m": _loadavg()}


def synthetic_capture(vocab: int, rows: int, seq_len: int, top_k: int, seed: int = 0) -> tuple[list[Shard], np.ndarray]:
    """A Zipf-like teacher over `vocab` ids, exact top-K and tail in float32 (64 positions at a time).

    Token i has frequency rank perm[i] (a random permutation: ids are not frequency ordered) and base
    log-frequency -1.1 log(1 + rank) (Zipf); each position's logits are s * (base + 2.2 * N(0, 1) per token),
    with a confidence s ~ U(0.8, 2.5) per position. The tail is the log-sum-exp over the complement of the
    top-K minus the full one. Unigram counts (the renumbering's input) are a 20M-token sample of the base
    distribution. -> (one shard of `rows` rows, counts)."""
    rng = np.random.default_rng(seed)
    base = (-1.1 * np.log1p(rng.permutation(vocab))).astype(np.float32)
    p_base = np.exp(base.astype(np.float64) - base.max())
    counts = rng.multinomial(20_000_000, p_base / p_base.sum()).astype(np.int64)
    ids = np.empty((rows * seq_len, top_k), np.int32)
    logprobs = np.empty((rows * seq_len, top_k), np.float32)
    tail = np.empty(rows * seq_len, np.float32)
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
        logprobs[start:start + n] = top_logits - peak - np.log(total)[:, None].astype(np.float32)
    shard = (ids.reshape(rows, seq_len, top_k), logprobs.reshape(rows, seq_len, top_k), tail.reshape(rows, seq_len))
    return [shard], counts


def run_settings(shards: list[Shard], vocab: int, counts: np.ndarray, repeats: int, only: str | None,
                 source: str) -> None:
    import torch

    torch.set_num_threads(1)  # single-core rates
    table = Renumbering.from_counts(counts)
    print(json.dumps({"source": source} | measure_v1(shards, vocab)), flush=True)
    for label, options in SETTINGS:
        if only is None or only in label:
            measured = measure_setting(label, options, shards, vocab, table, repeats)
            print(json.dumps({"source": source} | measured), flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdflow bench store", description=__doc__.splitlines()[0])
    parser.add_argument("--run-root", default="runs/bench-store",
                        help="where the real stores are built (kept for reruns)")
    parser.add_argument("--shards", type=int, default=8, help="token shards of 16 rows x 512 tokens (real)")
    parser.add_argument("--synthetic", action="store_true",
                        help="the synthetic V=196,608 teacher instead of the real one")
    parser.add_argument("--vocab", type=int, default=196_608, help="synthetic vocabulary")
    parser.add_argument("--rows", type=int, default=16, help="synthetic rows of 512 positions")
    parser.add_argument("--repeats", type=int, default=3, help="timings: best of this many")
    parser.add_argument("--only", default=None, help="only settings whose label contains this")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="real: also train the demo-size student this many steps on the default and the "
                             "lossless store")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.synthetic:
        started = time.perf_counter()
        shards, counts = synthetic_capture(args.vocab, args.rows, 512, 128)
        note({"source": "synthetic", "vocab": args.vocab, "positions": shards[0][2].size,
              "seconds_to_build": round(time.perf_counter() - started, 1),
              "mean_tail_mass": float(np.exp(shards[0][2].astype(np.float64)).mean()),
              "mean_top1_p": float(np.exp(shards[0][1][..., 0].astype(np.float64)).mean())})
        run_settings(shards, args.vocab, counts, args.repeats, args.only, "synthetic")
        return 0
    from kdflow.bench.store_train import build_real_stores, lossless_shards, train_comparison

    stores = build_real_stores(args.run_root, args.shards)
    shards, counts = lossless_shards(stores)
    note({"source": "real", **stores.describe()})
    run_settings(shards, stores.vocab, counts, args.repeats, args.only, "real")
    if args.train_steps:
        for record in train_comparison(stores, args.train_steps):
            print(json.dumps({"source": "real"} | record | {"loadavg_1m": _loadavg()}), flush=True)
    return 0
