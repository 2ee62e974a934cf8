"""The store metric (tasks/teacher/store_metric.py) against a dense reference written here position by position,
adaptive K never scoring better than full K on the same teacher rows, and the bytes a store takes (and the
estimate the pre-flight disk check makes of them)."""

from __future__ import annotations

import numpy as np
import pytest

from kdflow.schemas.codec import DecodedTopk, TopkCodec, decode, encode
from kdflow.tasks.teacher.store_fidelity import bucket_kl
from kdflow.tasks.teacher.store_metric import full_kl_dense, full_kl_from_topk, tail_plogp_dense

VOCAB, SEQ, K = 700, 24, 32


def teacher(rows: int, seed: int = 0) -> np.ndarray:
    """(rows, SEQ, VOCAB) float64 log-probs, Zipf-like with noise."""
    rng = np.random.default_rng(seed)
    base = -1.2 * np.log1p(rng.permutation(VOCAB))
    logits = rng.uniform(0.8, 2.5, (rows, SEQ, 1)) * (base + 2.0 * rng.standard_normal((rows, SEQ, VOCAB)))
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def capture(log_p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The teacher pass's exact top-K (descending), their float32 log-probs and the tail's log mass."""
    ids = np.argsort(-log_p, -1, kind="stable")[..., :K].astype(np.int32)
    top = np.take_along_axis(log_p, ids, -1)
    rest = np.exp(log_p).sum(-1) - np.exp(top).sum(-1)
    return ids, top.astype(np.float32), np.log(rest).astype(np.float32)


def reference_kl(log_p: np.ndarray, held: dict[int, float], rest: float) -> float:
    """KL(p || q) for one position, q built id by id: held ids at their stored mass, the rest spread evenly over
    the other ids, then q normalised."""
    q = np.full(VOCAB, rest / (VOCAB - len(held)))
    for token, mass in held.items():
        q[token] = mass
    q /= q.sum()
    p = np.exp(log_p)
    return float(sum(p[v] * (log_p[v] - np.log(q[v])) for v in range(VOCAB) if p[v] > 0))


def positions(decoded: DecodedTopk):
    for r in range(decoded.ids.shape[0]):
        for t in range(decoded.ids.shape[1]):
            kept = int(decoded.kept[r, t])
            held = {int(i): float(np.exp(np.float64(v)))
                    for i, v in zip(decoded.ids[r, t, :kept], decoded.logprobs[r, t, :kept], strict=True)}
            yield r, t, held, float(np.exp(np.float64(decoded.tail[r, t])))


@pytest.mark.parametrize("options", [{}, {"keep_mass": 0.9}, {"values": "float32", "tail": "float32"}])
def test_full_kl_matches_a_dense_reference(options: dict) -> None:
    log_p = teacher(2)
    ids, top, tail = capture(log_p)
    codec = TopkCodec(SEQ, K, VOCAB, **options)
    stored = decode(encode(codec, ids, top, tail), codec=codec)
    exact = DecodedTopk(ids, top, tail, np.full(tail.shape, K, np.int32))
    plogp = tail_plogp_dense(log_p.reshape(-1, VOCAB), ids.reshape(-1, K)).reshape(tail.shape)
    from_topk = full_kl_from_topk(exact, plogp, VOCAB, stored)
    kept = np.arange(K) < stored.kept[..., None]
    dense = full_kl_dense(log_p.reshape(-1, VOCAB), np.where(kept, stored.ids, -1).reshape(-1, K),
                          stored.logprobs.reshape(-1, K), stored.tail.ravel()).reshape(tail.shape)
    for r, t, held, rest in positions(stored):
        expected = reference_kl(log_p[r, t], held, rest)
        assert expected > 1e-4  # the tail is not uniform: even a lossless top-K is not the full distribution
        np.testing.assert_allclose(dense[r, t], expected, rtol=1e-9)
        np.testing.assert_allclose(from_topk[r, t], expected, rtol=1e-5, atol=1e-7)  # teacher side: float32 top-K
    assert (bucket_kl(exact, stored)[0] <= from_topk + 1e-9).all()  # merging ids only lowers KL: a lower bound


def test_full_kl_dense_scores_ids_outside_the_top_k() -> None:
    """A sampled-like store: ids anywhere in the vocabulary, and a rest that is not the top-K's tail."""
    log_p = teacher(1, seed=3).reshape(-1, VOCAB)
    rng = np.random.default_rng(1)
    held_ids = np.stack([rng.choice(VOCAB, 10, replace=False) for _ in range(SEQ)]).astype(np.int64)
    held_ids[:, -2:] = -1  # unused slots
    held_logprobs = np.take_along_axis(log_p, np.maximum(held_ids, 0), -1) + rng.normal(0, 0.01, held_ids.shape)
    rest = np.log(rng.uniform(0.2, 0.9, SEQ))
    got = full_kl_dense(log_p, held_ids, held_logprobs, rest)
    for t in range(SEQ):
        held = {int(i): float(np.exp(v)) for i, v in zip(held_ids[t], held_logprobs[t], strict=True) if i >= 0}
        np.testing.assert_allclose(got[t], reference_kl(log_p[t], held, float(np.exp(rest[t]))), rtol=1e-6)


@pytest.mark.parametrize("values", ["sqrt", "float32"])
def test_adaptive_k_never_scores_better_than_full_k(values: str) -> None:
    """Same teacher rows, same codec, the adaptive store holds strictly fewer ids at some positions: its full KL
    is higher there (the K+1-bucket KL said the opposite, which is why it is only a lower bound)."""
    log_p = teacher(3, seed=5)
    ids, top, tail = capture(log_p)
    exact = DecodedTopk(ids, top, tail, np.full(tail.shape, K, np.int32))
    plogp = tail_plogp_dense(log_p.reshape(-1, VOCAB), ids.reshape(-1, K)).reshape(tail.shape)
    extra = {"tail": "float32"} if values == "float32" else {}
    full_codec = TopkCodec(SEQ, K, VOCAB, values=values, **extra)
    adaptive_codec = TopkCodec(SEQ, K, VOCAB, values=values, keep_mass=0.95, **extra)
    full = decode(encode(full_codec, ids, top, tail), codec=full_codec)
    adaptive = decode(encode(adaptive_codec, ids, top, tail), codec=adaptive_codec)
    fewer = adaptive.kept < K
    assert fewer.mean() > 0.5
    kl_all_kept = full_kl_from_topk(exact, plogp, VOCAB, full)
    kl_adaptive = full_kl_from_topk(exact, plogp, VOCAB, adaptive)
    assert kl_adaptive[fewer].mean() > kl_all_kept[fewer].mean() + 1e-3
    if values == "float32":  # exact values: holding fewer ids never lowers the KL, position by position
        assert (kl_adaptive[fewer] >= kl_all_kept[fewer] - 1e-9).all()
    buckets_full, buckets_adaptive = bucket_kl(exact, full)[0], bucket_kl(exact, adaptive)[0]
    assert buckets_adaptive[fewer].mean() <= buckets_full[fewer].mean() + 1e-9  # the old figure's inversion


def test_full_kl_from_topk_refuses_ids_outside_the_teacher_top_k() -> None:
    log_p = teacher(1)
    ids, top, tail = capture(log_p)
    exact = DecodedTopk(ids, top, tail, np.full(tail.shape, K, np.int32))
    other = exact._replace(ids=np.where(ids == ids[0, 0, 0], VOCAB - 1 - ids, ids))
    with pytest.raises(ValueError, match="outside the teacher's top-K"):
        full_kl_from_topk(exact, np.zeros(tail.shape), VOCAB, other)


def test_store_bytes_count_every_file_a_reader_needs_the_renumbering_table_included(tmp_path) -> None:
    import os

    from kdflow.bench.store import written_store_bytes
    from kdflow.schemas.codec_meta import Renumbering
    from kdflow.schemas.commits import list_commits
    from kdflow.schemas.layout import RENUMBERING_FILE
    from kdflow.schemas.storage import RunRoot
    from kdflow.schemas.store_bytes import store_bytes

    log_p = teacher(2)
    table = Renumbering.from_counts(np.random.default_rng(0).integers(0, 1000, VOCAB))
    codec = TopkCodec(SEQ, K, VOCAB, renumbering=table)
    batches = [encode(codec, *capture(log_p[i:i + 1])) for i in range(2)]
    sizes = written_store_bytes(codec, codec.schema(), batches, table, {"config.yaml": b"x" * 100})
    table_bytes = len(table.to_bytes())
    assert sizes.positions == 2 * SEQ and sizes.store_files > table_bytes + 100  # _renumbering.bin, config, complete
    assert sizes.data > sum(b.nbytes for b in batches) + 2 * table_bytes  # each shard's schema carries the table
    assert sizes.records > 0 and sizes.per_position == sizes.total / (2 * SEQ)
    # a store on disk: every file counted once, leases and temporary files not at all
    folder = tmp_path / "store"
    folder.mkdir()
    for name, data in (("shard-00000.arrow", b"d" * 50), ("shard-00000.commit.json", None),
                       (RENUMBERING_FILE, b"t" * 30), ("_store.json", b"s" * 7), ("shard-00001.lease", b"l" * 1000),
                       (".shard-00001.arrow.tmp-1-h-x", b"z" * 1000)):
        if data is not None:
            (folder / name).write_bytes(data)
    from kdflow.schemas.commits import CommitRecord, write_commit

    record = CommitRecord(stage="topk", shard_id=0, data_file="shard-00000.arrow", rows=1, tokens=SEQ, bytes=50,
                          sha256="0" * 64, input_sha256="0" * 64, fingerprint="f" * 12)
    run_root = RunRoot(str(tmp_path))
    write_commit(run_root, str(folder), record)
    counted = store_bytes(run_root, str(folder), list_commits(run_root, str(folder), "topk"))
    record_size = os.path.getsize(folder / "shard-00000.commit.json")
    assert (counted.data, counted.records, counted.store_files) == (50, record_size, 37)


@pytest.mark.parametrize("values", ["sqrt", "float16", "float32"])
@pytest.mark.parametrize("tail", ["float16", "float32"])
def test_the_disk_estimate_of_a_store_is_a_little_above_what_the_codec_writes(values: str, tail: str) -> None:
    from kdflow.schemas.config import PrecomputeConfig
    from kdflow.schemas.store_bytes import estimated_bytes_per_position

    vocab, seq, top_k = 50_000, 32, 128  # ids spread over a real vocabulary's range, no renumbering
    rng = np.random.default_rng(0)
    base = -1.1 * np.log1p(rng.permutation(vocab))
    logits = rng.uniform(0.8, 2.5, (4, seq, 1)) * (base + 2.0 * rng.standard_normal((4, seq, vocab)))
    log_p = logits - np.logaddexp.reduce(logits, -1, keepdims=True)
    ids = np.argsort(-log_p, -1)[..., :top_k].astype(np.int32)
    top = np.take_along_axis(log_p, ids, -1)
    tail_logprob = np.log(np.clip(1 - np.exp(top).sum(-1), 1e-30, None))
    batch = encode(TopkCodec(seq, top_k, vocab, values=values, tail=tail), ids, top.astype(np.float32),
                   tail_logprob.astype(np.float32))
    written = batch.nbytes / (4 * seq)
    estimate = estimated_bytes_per_position(PrecomputeConfig(top_k=top_k, store={"values": values, "tail": tail}))
    assert written <= estimate <= 1.25 * written, (written, estimate)
    v1 = PrecomputeConfig(top_k=top_k, logprobs_dtype="float32", store={"format": "v1"})
    assert estimated_bytes_per_position(v1) == top_k * 8  # v1 is fixed width: int32 ids, float32 values
