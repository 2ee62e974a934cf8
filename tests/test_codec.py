"""Tests of the v2 top-K codec: exact ids, bounded values, exact tails, adaptive K, corruption, metadata."""

from __future__ import annotations

import base64
import io
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from kdflow.schemas import codec as C
from kdflow.schemas.codec_meta import CRC32, META_TABLE, Renumbering


def teacher_rows(rows: int, seq_len: int, top_k: int, vocab: int, seed: int = 0, skew: float = 1.0):
    """Random top-K rows like a teacher's: distinct ids, descending log-probs, exact float64 tail."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, seq_len, vocab)) * 3.0 - skew * np.log1p(np.arange(vocab))
    order = np.argsort(-logits, axis=-1, kind="stable")[..., :top_k]
    log_norm = np.log(np.exp(logits).sum(-1))
    top = np.take_along_axis(logits, order, -1)
    rest = np.exp(logits).sum(-1) - np.exp(top).sum(-1)
    with np.errstate(divide="ignore"):
        tail = np.log(np.maximum(rest, 0.0)) - log_norm
    return order.astype(np.int32), (top - log_norm[..., None]).astype(np.float32), tail.astype(np.float32)


def roundtrip(codec: C.TopkCodec, ids, logprobs, tail, **decode_options) -> C.DecodedTopk:
    sink = io.BytesIO()  # through a real IPC stream, as a shard would be
    with ipc.new_stream(sink, codec.schema()) as writer:
        writer.write_batch(C.encode(codec, ids, logprobs, tail))
    table = ipc.open_stream(pa.BufferReader(sink.getvalue())).read_all()
    return C.decode(table, **decode_options)


def by_id(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each position's entries by id (padding -1 last), for order-free comparisons."""
    key = np.where(ids >= 0, ids, np.iinfo(np.int32).max)
    order = np.argsort(key, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(values, order, -1)


SHAPES = [  # rows, seq_len, top_k, vocab
    (3, 7, 16, 300), (1, 1, 1, 1), (0, 4, 8, 50), (1, 5, 40, 40), (2, 3, 1, 70_000), (1, 2, 256, 257),
    (2, 4, 12, 256), (1, 3, 5, 65_537),
]


@pytest.mark.parametrize("rows,seq_len,top_k,vocab", SHAPES)
@pytest.mark.parametrize("values", ["float16", "float32", "sqrt"])
@pytest.mark.parametrize("renumber", [False, True])
def test_ids_round_trip_exactly(rows, seq_len, top_k, vocab, values, renumber):
    ids, logprobs, tail = teacher_rows(rows, seq_len, top_k, vocab)
    table = Renumbering(np.random.default_rng(1).permutation(vocab)) if renumber else None
    codec = C.TopkCodec(seq_len, top_k, vocab, values=values, renumbering=table)
    decoded = roundtrip(codec, ids, logprobs, tail)
    assert decoded.ids.shape == ids.shape and decoded.ids.dtype == np.int32
    assert (np.sort(decoded.ids, -1) == np.sort(ids, -1)).all()
    assert (decoded.kept == top_k).all()
    if values != "sqrt":
        got_ids, got = by_id(decoded.ids, decoded.logprobs)
        want_ids, want = by_id(ids, logprobs.astype(values).astype(np.float32))
        assert (got_ids == want_ids).all() and np.array_equal(got, want)  # lossless, -inf included


def test_extreme_ids_and_adversarial_gaps():
    vocab, top_k = 196_608, 4
    ids = np.array([[[0, vocab - 1, 1, vocab - 2], [vocab - 1, 65_535, 65_536, 0]]], np.int32)
    logprobs = np.array([[[-0.1, -2.0, -3.0, -30.0], [-1e-9, -5.0, -5.0, -np.inf]]], np.float32)
    tail = np.array([[-4.0, -np.inf]], np.float32)
    for values in ("sqrt", "float16", "float32"):
        decoded = roundtrip(C.TopkCodec(2, top_k, vocab, values=values), ids, logprobs, tail)
        assert (np.sort(decoded.ids, -1) == np.sort(ids, -1)).all()
        assert decoded.tail[0, 1] == -np.inf and np.isfinite(decoded.logprobs[0, 0]).all()


def test_output_is_sorted_descending_and_rank_order_is_the_same_set():
    ids, logprobs, tail = teacher_rows(2, 6, 32, 500)
    codec = C.TopkCodec(6, 32, 500, renumbering=Renumbering.from_counts(np.arange(500)))
    decoded = roundtrip(codec, ids, logprobs, tail)
    assert (np.diff(decoded.logprobs, axis=-1) <= 0).all()
    ranked = roundtrip(codec, ids, logprobs, tail, order="rank")
    ranks = codec.renumbering.rank_of_id[ranked.ids]
    assert (ranks[..., 1:] > ranks[..., :-1]).all()
    assert (by_id(decoded.ids, decoded.logprobs)[1] == by_id(ranked.ids, ranked.logprobs)[1]).all()


@pytest.mark.parametrize("levels", [1, 7, 255, 256, 400, 65535])
def test_sqrt_quantisation_error_is_within_the_documented_bound(levels):
    ids, logprobs, tail = teacher_rows(2, 16, 64, 400, skew=0.3)
    logprobs[0, 0, -1] = -np.inf  # p = 0 is coded too
    decoded = roundtrip(C.TopkCodec(16, 64, 400, levels=levels), ids, logprobs, tail)
    got_ids, got = by_id(decoded.ids, decoded.logprobs)
    want_ids, want = by_id(ids, logprobs)
    assert (got_ids == want_ids).all() and np.isfinite(got).all()
    error = np.abs(np.exp(got.astype(np.float64) / 2) - np.exp(want.astype(np.float64) / 2))
    assert error.max() <= 0.5 / levels + 1e-6


def test_float16_output_and_rank_order_decode_the_same_values():
    ids, logprobs, tail = teacher_rows(2, 5, 16, 900)
    codec = C.TopkCodec(5, 16, 900, keep_mass=0.9)
    batch = C.encode(codec, ids, logprobs, tail)
    full, half = C.decode(batch), C.decode(batch, dtype=np.float16)
    assert half.logprobs.dtype == np.float16 and (half.ids == full.ids).all()
    assert np.array_equal(half.logprobs, full.logprobs.astype(np.float16))
    with pytest.raises(ValueError, match="order must be"):
        C.decode(batch, order="id")


def test_tail_is_stored_exactly():
    ids, logprobs, tail = teacher_rows(2, 9, 8, 100)
    tail[0, 0], tail[0, 1] = -np.inf, 2e-7  # empty tail; a rounding hair above 0 is clamped to 0
    exact = roundtrip(C.TopkCodec(9, 8, 100, tail="float32"), ids, logprobs, tail)
    assert np.array_equal(exact.tail, np.minimum(tail, 0))
    half = roundtrip(C.TopkCodec(9, 8, 100, tail="float16"), ids, logprobs, tail)
    assert np.array_equal(half.tail, np.minimum(tail, 0).astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("keep_mass", [0.5, 0.9, 0.999, 1.0])
def test_adaptive_k_keeps_the_fewest_leading_ids_and_an_exact_tail(keep_mass):
    ids, logprobs, tail = teacher_rows(2, 10, 24, 300)
    codec = C.TopkCodec(10, 24, 300, values="float32", tail="float32", keep_mass=keep_mass)
    decoded = roundtrip(codec, ids, logprobs, tail)
    p = np.exp(logprobs.astype(np.float64))
    cumulative = np.cumsum(p, -1)
    kept = decoded.kept
    reached = np.take_along_axis(cumulative, kept[..., None] - 1, -1)[..., 0]
    assert (reached >= keep_mass * cumulative[..., -1] * (1 - 1e-12)).all()
    before = np.take_along_axis(cumulative, np.maximum(kept[..., None] - 2, 0), -1)[..., 0]
    assert ((kept == 1) | (before < keep_mass * cumulative[..., -1])).all()  # fewest
    pad = np.arange(24) >= kept[..., None]
    assert (decoded.ids[pad] == -1).all() and (decoded.logprobs[pad] == -np.inf).all()
    leading = np.where(~pad, ids, -1)
    assert (np.sort(decoded.ids, -1) == np.sort(leading, -1)).all()
    dropped = np.where(pad, p, 0.0).sum(-1)
    np.testing.assert_allclose(decoded.tail, np.log(np.exp(tail.astype(np.float64)) + dropped), rtol=1e-6)
    mass = np.exp(decoded.tail.astype(np.float64)) + np.where(pad, 0.0, np.exp(decoded.logprobs)).sum(-1)
    np.testing.assert_allclose(mass, 1.0, atol=1e-5)


def test_adaptive_k_with_quantised_values_and_renumbering():
    ids, logprobs, tail = teacher_rows(3, 8, 40, 1000)
    table = Renumbering(np.random.default_rng(2).permutation(1000))
    decoded = roundtrip(C.TopkCodec(8, 40, 1000, keep_mass=0.95, renumbering=table), ids, logprobs, tail)
    pad = np.arange(40) >= decoded.kept[..., None]
    assert (decoded.kept < 40).any() and (decoded.ids[pad] == -1).all()
    assert (np.sort(decoded.ids, -1) == np.sort(np.where(pad, -1, ids), -1)).all()
    assert np.isfinite(decoded.logprobs[~pad]).all() and (decoded.tail <= 0).all()


def test_rows_decode_on_their_own_and_from_tables_of_many_batches():
    ids, logprobs, tail = teacher_rows(5, 4, 8, 120)
    codec = C.TopkCodec(4, 8, 120)
    batches = [C.encode(codec, ids[part], logprobs[part], tail[part]) for part in (slice(0, 2), slice(2, 5))]
    whole = C.decode(pa.Table.from_batches(batches))
    for row in range(5):
        batch, index = (batches[0], row) if row < 2 else (batches[1], row - 2)
        alone = C.decode(batch.slice(index, 1))
        assert all(np.array_equal(a[0], w[row]) for a, w in zip(alone, whole) if w is not None)


def test_bad_input_is_refused():
    ids, logprobs, tail = teacher_rows(1, 3, 4, 50)
    codec = C.TopkCodec(3, 4, 50)
    bad = [
        (ids.copy(), logprobs[..., ::-1].copy(), tail, "sorted descending"),
        (np.where(ids == ids[0, 0, 0], 50, ids), logprobs, tail, "token ids must be in"),
        (np.concatenate([ids[..., :1], ids[..., :3]], -1), logprobs, tail, "repeat an id"),
        (ids, np.full_like(logprobs, np.nan), tail, "not NaN"),
        (ids, logprobs, tail + 1.0, "tail_logprob"),
        (ids[..., :3], logprobs[..., :3], tail, "want ids, logprobs"),
    ]
    for bad_ids, bad_logprobs, bad_tail, message in bad:
        with pytest.raises(ValueError, match=message):
            C.encode(codec, bad_ids, bad_logprobs, bad_tail)
    with pytest.raises(ValueError, match="top_k <= vocab_size"):
        C.TopkCodec(3, 60, 50)


def _with_cell(batch: pa.RecordBatch, name: str, cell: bytes, fix_crc: bool) -> pa.RecordBatch:
    columns = {n: batch.column(n).to_pylist() for n in batch.schema.names}
    columns[name][0] = cell
    if fix_crc:
        crc = 0
        for n in batch.schema.names[:-1]:
            crc = zlib.crc32(columns[n][0], crc)
        columns[CRC32][0] = crc
    return pa.record_batch([pa.array(columns[n], batch.schema.field(n).type) for n in batch.schema.names],
                           schema=batch.schema)


def test_corrupt_or_truncated_bytes_raise_a_clear_value_error():
    ids, logprobs, tail = teacher_rows(2, 16, 32, 70_000)
    codec = C.TopkCodec(16, 32, 70_000, keep_mass=0.99)
    batch = C.encode(codec, ids, logprobs, tail)
    for name in codec.columns():
        cell = batch.column(name)[0].as_py()
        if cell:
            flipped = bytes([cell[0] ^ 0x40]) + cell[1:]
            with pytest.raises(ValueError, match="row 0: crc32 mismatch"):
                C.decode(_with_cell(batch, name, flipped, fix_crc=False))
            with pytest.raises(ValueError, match=f"row 0, column {name}: corrupt or truncated"):
                C.decode(_with_cell(batch, name, cell[: len(cell) // 2], fix_crc=True))
    zstd = pa.Codec("zstd")
    forged = {  # valid zstd frames with wrong content, crc32 recomputed: caught by the semantic checks
        "gap_token": (zstd.compress(bytes(5), asbytes=True), "column gap_token: corrupt or truncated"),  # size
        "kept": (zstd.compress(np.full(16, 200, np.uint8).tobytes(), asbytes=True), "kept count beyond"),
        "level_min": (zstd.compress(np.full(32, 255, np.uint8).tobytes(), asbytes=True), "level beyond"),
    }
    for name, (cell, message) in forged.items():
        with pytest.raises(ValueError, match=message):
            C.decode(_with_cell(batch, name, cell, fix_crc=True))


def test_forged_gaps_beyond_the_vocabulary_are_caught():
    ids, logprobs, tail = teacher_rows(1, 2, 4, 300)
    codec = C.TopkCodec(2, 4, 300)
    batch = C.encode(codec, ids, logprobs, tail)
    zstd = pa.Codec("zstd")
    tokens = zstd.compress(np.full(8, 255, np.uint8).tobytes(), asbytes=True)  # all escaped
    forged = _with_cell(batch, "gap_token", tokens, True)
    extra = zstd.compress(np.full(8, 200, np.uint8).tobytes(), asbytes=True)  # gaps 455 > 299
    forged = _with_cell(forged, "gap_extra_b0", extra, True)
    with pytest.raises(ValueError, match="beyond vocabulary size 300"):
        C.decode(forged)


def test_truncated_ipc_streams_fail_loudly():
    """pyarrow itself refuses a cut stream (OSError or ArrowInvalid, a ValueError); the store's shard reader
    (schemas/shards.read_stream_table) turns both into its StoreError. A cut exactly between two batches
    reads as fewer rows: the commit record's row count and sha256 catch that."""
    ids, logprobs, tail = teacher_rows(2, 8, 16, 500)
    codec = C.TopkCodec(8, 16, 500)
    sink = io.BytesIO()
    with ipc.new_stream(sink, codec.schema()) as writer:
        writer.write_batch(C.encode(codec, ids, logprobs, tail))
    data = sink.getvalue()
    for cut in (10, len(codec.schema().serialize()) + 40, len(data) - 100):
        with pytest.raises((ValueError, OSError)):
            C.decode(ipc.open_stream(pa.BufferReader(data[:cut])).read_all())


def test_metadata_round_trips_and_is_canonical():
    table = Renumbering.from_counts(np.random.default_rng(3).integers(0, 9, 1000))
    codec = C.TopkCodec(16, 8, 1000, levels=300, keep_mass=0.99, renumbering=table)
    sink = io.BytesIO()
    with ipc.new_stream(sink, codec.schema()) as writer:
        writer.write_batch(C.encode(codec, *teacher_rows(1, 16, 8, 1000)))
    schema = ipc.open_stream(pa.BufferReader(sink.getvalue())).schema
    again = C.TopkCodec.from_schema(schema)
    assert again == codec and again.settings() == codec.settings()
    assert np.array_equal(again.renumbering.id_of_rank, table.id_of_rank)
    assert codec.settings_json() == C.TopkCodec(16, 8, 1000, levels=300, keep_mass=0.99,
                                                renumbering=Renumbering(table.id_of_rank)).settings_json()
    assert codec.settings()["renumbering"] == "sha256:" + table.sha256
    assert codec != C.TopkCodec(16, 8, 1000, levels=300, keep_mass=0.99, renumbering=Renumbering(np.arange(1000)))
    with pytest.raises(ValueError, match="columns"):
        C.decode(C.encode(C.TopkCodec(16, 8, 1000), *teacher_rows(1, 16, 8, 1000)), codec=codec)
    assert C.TopkCodec(16, 8, 1000, values="float16").settings()["levels"] is None
    settings = schema.metadata[C.META_CODEC]
    tampered = schema.with_metadata({**schema.metadata, C.META_CODEC: settings.replace(b"300", b"301")})
    assert C.TopkCodec.from_schema(tampered).levels == 301  # a different codec, not a silent mix
    other = base64.b64encode(Renumbering(np.arange(1000)).to_bytes())
    swapped = schema.with_metadata({**schema.metadata, META_TABLE: other})
    with pytest.raises(ValueError, match="does not match its sha256"):
        C.TopkCodec.from_schema(swapped)
    with pytest.raises(ValueError, match="no kdflow.topk_codec"):
        C.TopkCodec.from_schema(pa.schema([("topk_ids", pa.int32())]))


def test_renumbering_from_counts_is_deterministic_and_validated():
    counts = np.array([5, 9, 0, 9, 1])
    assert Renumbering.from_counts(counts).id_of_rank.tolist() == [1, 3, 0, 4, 2]
    with pytest.raises(ValueError, match="not a permutation"):
        Renumbering(np.array([0, 0, 1]))


def test_v1_arrays_map_to_the_same_output():
    ids, logprobs, _ = teacher_rows(1, 4, 6, 30)
    logprobs[0, 0] = np.log(np.full(6, 0.2))  # sums to 1.2: the v1 tail would be negative
    decoded = C.from_v1(ids, logprobs.astype(np.float16))
    assert decoded.tail[0, 0] == -np.inf and (decoded.tail <= 0).all() and (decoded.kept == 6).all()
    mass = np.exp(logprobs[0, 1:].astype(np.float16).astype(np.float64)).sum(-1)
    np.testing.assert_allclose(np.exp(decoded.tail[0, 1:]), 1 - mass, rtol=1e-4)


def test_encoding_is_deterministic():
    """Reruns of a shard must be byte-identical (the commit record holds its sha256)."""
    rows = teacher_rows(2, 6, 10, 2000)
    table = Renumbering.from_counts(np.arange(2000) % 7)
    first = C.encode(C.TopkCodec(6, 10, 2000, renumbering=table, keep_mass=0.99), *rows)
    again = C.encode(C.TopkCodec(6, 10, 2000, renumbering=Renumbering.from_counts(np.arange(2000) % 7),
                                 keep_mass=0.99), *rows)
    assert first.equals(again) and first.schema.metadata == again.schema.metadata
