"""DistillKit's packed logit format: read into SourceRows, written for export, and its settings files.

The capture test builds its bytes with a plain encoder written here from the published description (struct and
bit strings, one position at a time), not with kdflow's writer, and checks the reader against values computed
from that description by hand."""

from __future__ import annotations

import math
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.tasks.teacher.distillkit import distillkit_rows, distillkit_table, is_distillkit
from kdflow.tasks.teacher.distillkit_bytes import pack_bits, unpack_bits
from kdflow.tasks.teacher.distillkit_settings import (DistillKitSettings, ResidualBin, distillkit_settings,
                                                      lossless_settings, read_distillkit_settings,
                                                      settings_for_source, write_distillkit_settings)
from kdflow.tasks.teacher.source_rows import FULL

VOCAB = 300


def teacher_topk(rows: int, length: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens (rows, T) and a teacher's top-k ids and full-vocabulary log-probs (rows, T, k), descending."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, length, VOCAB)) * 2.0 - 0.8 * np.log1p(np.arange(VOCAB))
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-logprobs, axis=-1, kind="stable")[..., :k]
    return rng.integers(0, VOCAB, (rows, length)), ids, np.take_along_axis(logprobs, ids, -1).astype(np.float32)


def by_id(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each position's entries ordered by id: lossy decoding may swap near-equal neighbours."""
    order = np.argsort(ids, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(values, order, -1)


def read_back(table: pa.Table, settings: DistillKitSettings, top_k: int, first_row: int = 0):
    return distillkit_rows(table.combine_chunks().to_batches()[0], settings, first_row, top_k, VOCAB)


def test_lossless_round_trip_gives_the_same_ids_and_logprobs():
    tokens, ids, logprobs = teacher_topk(3, 7, 16)
    settings = lossless_settings(VOCAB, 16)
    rows = read_back(distillkit_table(tokens, ids, logprobs, settings), settings, 16)
    table = distillkit_table(tokens, ids, logprobs, settings)
    assert is_distillkit(table.column_names) and not is_distillkit(["input_ids", "topk_ids", "topk_logprobs"])
    from kdflow.schemas.logit_layouts import LAYOUTS
    from kdflow.tasks.teacher.logit_dataset import check_columns

    with pytest.raises(StoreError, match=r"has no column 'topk_ids' of layout kdflow \(columns: input_ids, "
                                         r".*\); it looks like a DistillKit capture: --layout distillkit$"):
        check_columns(table, LAYOUTS["kdflow"], "capture")  # imported with another layout: named
    assert rows.normalisation == FULL and rows.tail is None and rows.target.all()
    assert rows.offsets.tolist() == [0, 7, 14, 21]
    assert np.array_equal(rows.tokens.reshape(3, 7), tokens)
    assert np.array_equal(rows.ids.reshape(3, 7, 16), ids)
    assert np.array_equal(rows.logprobs.reshape(3, 7, 16), logprobs)
    batch = distillkit_table(tokens, ids, logprobs, settings).combine_chunks().to_batches()[0]
    middle = distillkit_rows(batch.slice(1, 1), settings, 1, 16, VOCAB)  # a slice, as a streaming reader gives
    assert middle.offsets.tolist() == [0, 7] and np.array_equal(middle.ids, ids[1])
    assert np.array_equal(middle.tokens, tokens[1]) and np.array_equal(middle.logprobs, logprobs[1])


def test_lossy_round_trip_stays_within_the_residual_quantisation_step():
    """exact_k values in bfloat16 (relative error <= 2**-8: half of 8 significant bits); the rest as a curve
    plus 16-bit residuals, which err by at most half a step: max|residual| / 2**15 / 2, with |residual| below
    the values' spread."""
    tokens, ids, logprobs = teacher_topk(2, 5, 24, seed=3)
    settings = DistillKitSettings(d=VOCAB, k=24, exact_k=4, exact_dtype="bfloat16", polynomial_terms=(0, 1, 2, "sqrt"),
                                  residual_bins=(ResidualBin("float32", 16, 20),), delta_encoding=False)
    rows = read_back(distillkit_table(tokens, ids, logprobs, settings), settings, 24)
    got_ids, got = by_id(rows.ids.reshape(2, 5, 24), rows.logprobs.reshape(2, 5, 24))
    want_ids, want = by_id(ids, logprobs)
    assert np.array_equal(got_ids, want_ids)
    exact = np.argsort(ids, axis=-1, kind="stable") < 4  # ordered by id: where the rank was below exact_k
    spread = (logprobs[..., 4:].max(-1) - logprobs[..., 4:].min(-1))[..., None]
    assert (np.abs(got - want)[exact] <= np.abs(want[exact]) * 2.0 ** -8).all()
    assert (np.abs(got - want) <= (spread / 2 ** 16 + 1e-5))[~exact].all()
    assert settings.logprob_bytes() == 4 * 2 + 4 * 4 + 4 + 20 * 2


def _bits(values: list[int], width: int) -> bytes:
    """Integers MSB first, one bit string, zero-padded to whole bytes (the description's bit packing)."""
    stream = "".join(format(value, f"0{width}b") for value in values)
    stream += "0" * (-len(stream) % 8)
    return bytes(int(stream[i:i + 8], 2) for i in range(0, len(stream), 8))


def _bfloat16(value: float) -> bytes:
    return struct.pack("<f", value)[2:]  # exact for the values used: their low 16 bits are zero


def test_reads_a_capture_built_from_the_published_description():
    """k=6: 2 exact bfloat16, a curve c0 + c1 t + c2 sqrt(t) (float32) over t = 0..3, one bin of 3 residuals of
    4 bits with a float16 scale (the 4th residual is 0), all as deltas; ids of ceil(log2 300) = 9 bits."""
    settings = distillkit_settings({"d": VOCAB, "k": 6, "exact_k": 2, "exact_dtype": "bfloat16",
                                    "polynomial_terms": [0, 1, "sqrt"], "term_dtype": "float32",
                                    "residual_bins": [{"scale_dtype": "float16", "element_bits": 4,
                                                       "num_elements": 3}], "delta_encoding": True}, "test")
    positions, expected = [], []
    for position in range(5):
        exact, coefficients = [-1.5 - position / 8, -0.25], [-0.3, -0.1 * (position + 1), -0.05]
        scale, levels = 0.0078125, [(3 * position + j) % 16 for j in range(3)]
        ids = [(37 * position + 11 * j) % VOCAB for j in range(6)]
        raw = b"".join(_bfloat16(v) for v in exact) + struct.pack("<3f", *coefficients)
        raw += struct.pack("<e", scale) + _bits(levels, 4)
        positions.append((raw, _bits(ids, 9)))
        residual = [(level - 8) * scale for level in levels] + [0.0]
        deltas = exact + [coefficients[0] + coefficients[1] * t + coefficients[2] * math.sqrt(t) + residual[t]
                          for t in range(4)]
        expected.append((ids, np.cumsum(deltas)))
    assert len(positions[0][0]) == settings.logprob_bytes() == 2 * 2 + 3 * 4 + 2 + 2
    assert len(positions[0][1]) == settings.index_bytes() == 7
    # row 0 as the capture writes it (one position fewer than tokens), row 1 as its packing step trims it
    table = pa.table({
        "input_ids": pa.array([[5, 6, 7, 8], [9, 10]], pa.list_(pa.uint64())),
        "compressed_logprobs": pa.array([[list(p[0]) for p in positions[:3]], [list(p[0]) for p in positions[3:]]],
                                        pa.list_(pa.list_(pa.uint8()))),
        "bytepacked_indices": pa.array([[list(p[1]) for p in positions[:3]], [list(p[1]) for p in positions[3:]]],
                                       pa.list_(pa.list_(pa.uint8())))})
    rows = read_back(table, settings, 6, first_row=40)
    assert rows.first_row == 40 and rows.offsets.tolist() == [0, 4, 6]
    assert rows.tokens.tolist() == [5, 6, 7, 8, 9, 10]
    assert rows.target.tolist() == [True, True, True, False, True, True]
    stored = np.flatnonzero(rows.target)
    for (ids, values), position in zip(expected, stored):
        assert rows.ids[position].tolist() == ids
        np.testing.assert_allclose(rows.logprobs[position], values, rtol=0, atol=1e-6)
    assert (rows.ids[3] == -1).all() and np.isneginf(rows.logprobs[3]).all()


def test_more_kept_than_the_store_holds_keeps_the_most_likely_and_fewer_pad():
    tokens, ids, logprobs = teacher_topk(1, 4, 8)
    settings = lossless_settings(VOCAB, 8)
    table = distillkit_table(tokens, ids, logprobs, settings)
    fewer = read_back(table, settings, 5)
    assert np.array_equal(fewer.ids, ids[0, :, :5]) and np.array_equal(fewer.logprobs, logprobs[0, :, :5])
    more = read_back(table, settings, 10)
    assert np.array_equal(more.ids[:, :8], ids[0]) and (more.ids[:, 8:] == -1).all()
    assert np.isneginf(more.logprobs[:, 8:]).all()


def test_labels_mark_targets_and_attention_mask_drops_padding():
    tokens, ids, logprobs = teacher_topk(2, 6, 4)
    target = np.ones((2, 6), bool)
    target[0, :2] = False  # a prompt: no teacher target
    settings = lossless_settings(VOCAB, 4)
    table = distillkit_table(tokens, ids, logprobs, settings, target=target)
    assert table.column("labels").to_pylist()[0][:3] == [-100, -100, tokens[0, 2]]
    rows = read_back(table, settings, 4)
    assert rows.target.tolist() == target.reshape(-1).tolist()
    assert np.array_equal(rows.ids[rows.target], ids[target])
    padded = table.append_column("attention_mask", pa.array([[1] * 6, [1, 1, 1, 1, 0, 0]], pa.list_(pa.int64())))
    rows = read_back(padded, settings, 4)
    assert rows.offsets.tolist() == [0, 6, 10] and rows.tokens.tolist() == tokens.reshape(-1)[:10].tolist()


def test_probabilities_summing_above_one_are_scaled_to_one():
    """An approximation can overshoot; the rows never claim more than the teacher's whole mass."""
    settings = lossless_settings(VOCAB, 3)
    table = distillkit_table(np.array([[1]]), np.array([[[4, 5, 6]]]), np.log(np.array([[[0.6, 0.5, 0.1]]])), settings)
    rows = read_back(table, settings, 3)
    np.testing.assert_allclose(np.exp(rows.logprobs).sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.exp(rows.logprobs[0]), np.array([0.6, 0.5, 0.1]) / 1.2, rtol=1e-6)


def test_empty_slots_survive_only_exact_settings():
    tokens, ids, logprobs = teacher_topk(1, 3, 4)
    logprobs[0, 1, 3] = -np.inf
    exact = lossless_settings(VOCAB, 4)
    rows = read_back(distillkit_table(tokens, ids, logprobs, exact), exact, 4)
    assert rows.ids[1, 3] == -1 and np.isneginf(rows.logprobs[1, 3]) and rows.ids[1, 2] == ids[0, 1, 2]
    curve = DistillKitSettings(d=VOCAB, k=4, exact_k=1, polynomial_terms=(0, 1), delta_encoding=False)
    with pytest.raises(StoreError, match=r"^row 0 field compressed_logprobs: position 1 holds fewer than k=4"):
        distillkit_table(tokens, ids, logprobs, curve)
    with pytest.raises(ConfigError, match="k=5 log-probs per position; the targets hold K=4"):
        distillkit_table(tokens, ids, logprobs, lossless_settings(VOCAB, 5))


def test_an_export_on_disk_reads_back_in_batches_with_its_settings_file(tmp_path):
    """As export writes it and a streaming import reads it: Parquet under data/, the settings one folder up,
    record batches of a few rows each, first_row counting on."""
    tokens, ids, logprobs = teacher_topk(5, 6, 8, seed=5)
    settings = DistillKitSettings(d=VOCAB, k=8, exact_k=3, exact_dtype="float16", polynomial_terms=(0, 1),
                                  residual_bins=(ResidualBin("float32", 12, 5),), delta_encoding=False)
    (tmp_path / "data").mkdir()
    pq.write_table(distillkit_table(tokens, ids, logprobs, settings), tmp_path / "data" / "train-00000.parquet")
    write_distillkit_settings(settings, tmp_path)
    found = settings_for_source(tmp_path / "data" / "train-00000.parquet")
    assert found == settings
    first, parts = 0, []
    for batch in pq.ParquetFile(tmp_path / "data" / "train-00000.parquet").iter_batches(batch_size=2):
        parts.append(distillkit_rows(batch, found, first, 8, VOCAB))
        first += batch.num_rows
    assert [part.first_row for part in parts] == [0, 2, 4] and sum(part.rows for part in parts) == 5
    got_ids, got = by_id(np.concatenate([p.ids for p in parts]), np.concatenate([p.logprobs for p in parts]))
    want_ids, want = by_id(ids.reshape(-1, 8), logprobs.reshape(-1, 8))
    assert np.array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -11, atol=2e-3)  # float16 exact, 12-bit residuals


def _capture(settings: DistillKitSettings, **changes) -> pa.RecordBatch:
    tokens, ids, logprobs = teacher_topk(3, 4, settings.k)
    table = distillkit_table(tokens, ids, logprobs, settings)
    for name, value in changes.items():
        index = table.schema.get_field_index(name)
        table = table.append_column(name, value) if index < 0 else table.set_column(index, name, value)
    return table.combine_chunks().to_batches()[0]


def _bytes(rows: list) -> pa.Array:
    return pa.array(rows, pa.list_(pa.list_(pa.uint8())))


@pytest.mark.parametrize("change, message", [
    ({"input_ids": pa.array([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4]], pa.list_(pa.int64()))},
     r"^row 11 field compressed_logprobs: 4 positions for 6 input_ids"),
    ({"input_ids": pa.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, VOCAB, 4]], pa.list_(pa.int64()))},
     rf"^row 12 field input_ids: token {VOCAB} at position 2 is outside the vocabulary"),
    ({"compressed_logprobs": _bytes([[[0] * 16] * 4, [[0] * 16] * 4, [[0] * 16] * 3 + [[0] * 15]])},
     r"^row 12 field compressed_logprobs: position 3 has 15 bytes, the compressor settings give 16"),
    ({"bytepacked_indices": _bytes([[[0] * 5] * 4, [[0] * 5] * 4, [[0] * 5] * 4])},
     r"^row 10 field bytepacked_indices: a repeated id at position 0$"),
    ({"bytepacked_indices": _bytes([[[0] * 5] * 4, [[255] * 5] * 4, [[0] * 5] * 4])},
     r"^row 11 field bytepacked_indices: an id outside the vocabulary of 300 at position 0$"),
    ({"labels": pa.array([[1, 2, 3, 4], [1], [1, 2, 3, 4]], pa.list_(pa.int64()))},
     r"^row 11 field labels: 1 values for 4 input_ids"),
    ({"coeffs": pa.array([[1.0]] * 3)}, r"^row 10 field coeffs: DistillKit's legacy compressed format"),
    ({"input_ids": pa.array([[1, 2, 3, 4], None, [1, 2, 3, 4]], pa.list_(pa.int64()))},
     r"^row 11 field input_ids: a null list$"),
    ({"compressed_logprobs": _bytes([[[0] * 16] * 4, [[0] * 16] * 4, [[0] * 16, None, [0] * 16, [0] * 16]])},
     r"^row 12 field compressed_logprobs: a null list at position 1$"),
])
def test_bad_input_is_one_line_naming_row_and_field(change, message):
    with pytest.raises(StoreError, match=message) as error:
        distillkit_rows(_capture(lossless_settings(VOCAB, 4), **change), lossless_settings(VOCAB, 4), 10, 4, VOCAB)
    assert "\n" not in str(error.value)


def test_ids_past_the_vocabulary_are_refused():
    """d=512 leaves room in 9 bits for ids the run's vocabulary of 300 does not have."""
    settings = lossless_settings(512, 2)
    table = distillkit_table(np.array([[1, 2]]), np.array([[[3, 4], [5, 400]]]),
                             np.log(np.array([[[0.5, 0.2], [0.5, 0.2]]])), settings)
    with pytest.raises(StoreError, match=r"^row 0 field bytepacked_indices: an id outside the vocabulary of 300 "
                                         r"at position 1$"):
        read_back(table, settings, 2)


def test_bit_packing_inverts_for_every_width():
    rng = np.random.default_rng(7)
    for bits in (1, 3, 8, 9, 17, 33, 64):
        values = rng.integers(0, 2 ** min(bits, 62), (4, 11), dtype=np.uint64) if bits < 64 else \
            rng.integers(0, 2 ** 63, (4, 11), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        packed = pack_bits(values, bits)
        assert packed.shape == (4, (11 * bits + 7) // 8)
        assert np.array_equal(unpack_bits(packed, bits, 11), values)
    assert pack_bits(np.array([[5, 3]]), 3).tolist() == [[0b10101100]]


def test_settings_are_read_from_a_capture_folder_or_a_distillkit_config(tmp_path):
    settings = DistillKitSettings(d=151936, k=128, exact_k=16, exact_dtype="bfloat16",
                                  polynomial_terms=(0, 1, 2, 3, 4, "sqrt"), delta_encoding=False)
    assert read_distillkit_settings(write_distillkit_settings(settings, tmp_path).parent) == settings
    assert settings.index_bits == 18 and settings.logprob_bytes() == 16 * 2 + 6 * 4
    config = tmp_path / "train.yaml"
    config.write_text("teacher:\n  kind: dataset\n  logprob_compressor:\n    d: 128256\n    k: 50\n    exact_k: 1\n"
                      "    polynomial_terms: [0, 1, sqrt]\n    residual_bins: []\n")
    read = read_distillkit_settings(config)
    assert settings_for_source(tmp_path / "data-00000.parquet") == settings == settings_for_source(tmp_path)
    (tmp_path / "data").mkdir()
    assert settings_for_source(tmp_path / "data" / "train-00000-of-00001.parquet") == settings
    assert settings_for_source(tmp_path, given=config) == read
    assert (read.d, read.k, read.exact_dtype, read.delta_encoding, read.index_bits) == (128256, 50, "float32", True, 17)


@pytest.mark.parametrize("text, message", [
    ("legacy_logit_compression: {k: 1}\n", "legacy_logit_compression format is not supported"),
    ("d: 10\nk: 4\nexact_k: 4\n", "the compressor setting 'residual_bins' is missing"),
    ("d: 10\nk: 4\nexact_k: 4\nresidual_bins: []\nzip: true\n", "unknown compressor setting 'zip'"),
    ("d: 10\nk: 4\nexact_k: 2\nresidual_bins: []\n", "polynomial_terms or residual_bins must say"),
    ("d: 10\nk: 4\nexact_k: 4\nexact_dtype: int8\nresidual_bins: []\n", "exact_dtype must be one of"),
    ("d: 10\nk: 4\nexact_k: 1\npolynomial_terms: [cube]\nresidual_bins: []\n", "polynomial term 'cube'"),
    ("d: 10\nk: 4\nexact_k: 2\nresidual_bins: [{scale_dtype: float16, element_bits: 65, num_elements: 2}]\n",
     r"residual_bins\[0\].element_bits must be at most 64"),
])
def test_bad_settings_are_one_config_error(tmp_path, text, message):
    (tmp_path / "compression_config.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_distillkit_settings(tmp_path)
    with pytest.raises(ConfigError, match="no DistillKit compressor settings"):
        read_distillkit_settings(tmp_path / "elsewhere")
