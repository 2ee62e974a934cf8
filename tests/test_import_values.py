"""What an import makes of a source's values when they are not what the layout says, or say nothing: probabilities
(a kind of their own, and named where another kind was declared), a `[T][K]` target mask that masks single entries,
a source without a single teacher target, and log-probs that sum to 1 at every position (renormalised, read as
full). Each is checked against values written out by hand, position by position."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from support.import_sources import import_config

from kdflow.schemas.errors import StoreError
from kdflow.schemas.logit_layouts import LAYOUTS, declare_layout
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.tasks.teacher.logit_dataset import source_rows
from kdflow.tasks.teacher.logit_export import layout_table
from kdflow.tasks.teacher.logit_import import import_store
from kdflow.tasks.teacher.source_rows import FULL

VOCAB, K = 60, 4
INF = float("inf")


def _distribution(rng: np.random.Generator, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (N, K), probabilities (N, K)) of a random full-vocabulary distribution's K largest, descending."""
    p = rng.dirichlet(np.full(VOCAB, 0.3), positions)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :K]
    return ids, np.take_along_axis(p, ids, 1)


def _table(tokens: list[list[int]], ids: list, values: list, **more: pa.Array) -> pa.Table:
    return pa.table({"input_ids": pa.array(tokens, pa.list_(pa.int64())),
                     "topk_ids": pa.array(ids, pa.list_(pa.list_(pa.int64()))),
                     "topk_logprobs": pa.array(values, pa.list_(pa.list_(pa.float64()))), **more})


def _rows_of(array: np.ndarray, lengths: list[int]) -> list:
    return [part.tolist() for part in np.split(array, np.cumsum(lengths)[:-1])]


def test_probabilities_are_read_as_their_log_with_their_tail_and_written_back_as_probabilities() -> None:
    rng = np.random.default_rng()
    lengths = [3, 5]
    ids, p = _distribution(rng, sum(lengths))
    p[1, 3] = 0.0  # a zero pads the end, as -inf does among log-probs
    tail = 1.0 - p.sum(1)
    tokens = _rows_of(rng.integers(0, VOCAB, sum(lengths)), lengths)
    layout = declare_layout("kdflow", {"tail": "tail_mass"}, kind="probabilities")
    batch = _table(tokens, _rows_of(ids, lengths), _rows_of(p, lengths),
                   tail_mass=pa.array(_rows_of(tail, lengths), pa.list_(pa.float64())))
    rows = source_rows(batch, layout, 0, K, VOCAB)
    assert rows.normalisation == FULL and rows.target.all()
    for n in range(sum(lengths)):
        for j in range(K):
            want_id, want = (-1, -INF) if p[n, j] == 0 else (int(ids[n, j]), math.log(p[n, j]))
            assert rows.ids[n, j] == want_id
            assert rows.logprobs[n, j] == pytest.approx(want, rel=1e-6) if want != -INF else rows.logprobs[n, j] == -INF
        assert rows.tail[n] == pytest.approx(math.log(tail[n]), rel=1e-5)

    table = layout_table(layout, np.asarray([tokens[1]]), rows.ids[None, 3:], rows.logprobs[None, 3:],
                         rows.tail[None, 3:])
    np.testing.assert_allclose(np.asarray(table.column("topk_logprobs").to_pylist()[0]), p[3:], rtol=1e-6)
    np.testing.assert_allclose(table.column("tail_mass").to_pylist()[0], tail[3:], rtol=1e-5)

    batch = _table(tokens, _rows_of(ids, lengths), _rows_of(np.where(np.arange(K) == 2, 1.5, p), lengths))
    with pytest.raises(StoreError) as error:
        source_rows(batch, declare_layout("kdflow", {}, kind="probabilities"), 7, K, VOCAB)
    assert str(error.value) == "row 7 field topk_logprobs: a probability outside [0, 1] at position 0"


@pytest.mark.parametrize("kind, message", [
    ("logprobs", "row 4 field topk_logprobs: log-probs whose probabilities sum above 1 at position 0: values in "
                 "[0, 1] that sum to at most 1 look like probabilities, declare kind probabilities"),
    ("renormalised", "row 4 field topk_logprobs: values sum to {mass}, not 1, at position 0: declare kind "
                     "probabilities"),
    ("logits", "row 4 field topk_logprobs: probabilities declared as logits (every value in [0, 1], summing to at "
               "most 1) at position 0: declare kind probabilities"),
])
def test_probabilities_declared_as_another_kind_are_refused_naming_kind_probabilities(kind: str, message: str) -> None:
    rng = np.random.default_rng()
    ids, p = _distribution(rng, 6)
    batch = _table([rng.integers(0, VOCAB, 6).tolist()], [ids.tolist()], [p.tolist()])
    with pytest.raises(StoreError) as error:
        source_rows(batch, declare_layout("kdflow", {}, kind=kind), 4, K, VOCAB)
    assert str(error.value) == message.format(mass=f"{np.exp(p[0]).sum():.3g}")
    # logits that are no probabilities still import as logits: their log-softmax over the K
    logits = np.log(p) * 2.0 + 9.0
    rows = source_rows(_table([list(range(6))], [ids.tolist()], [logits.tolist()]), declare_layout(
        "kdflow", {}, kind="logits"), 0, K, VOCAB)
    shifted = logits - logits.max(1, keepdims=True)
    np.testing.assert_allclose(rows.logprobs, shifted - np.log(np.exp(shifted).sum(1, keepdims=True)), rtol=1e-5)


@pytest.mark.parametrize("kind", ["logprobs", "probabilities"])
def test_a_target_mask_of_k_entries_drops_the_masked_entries_and_keeps_the_others_in_order(kind: str) -> None:
    rng = np.random.default_rng()
    ids, p = _distribution(rng, 5)
    logprobs = np.log(p)
    values = logprobs.copy() if kind == "logprobs" else p.copy()
    values[2, 1] = np.nan  # what a masked entry holds does not matter
    entry_mask = np.ones((5, K), np.int8)
    entry_mask[0, 1] = entry_mask[2, 1] = entry_mask[2, 3] = 0  # single entries
    entry_mask[4] = 0  # a whole position: no target
    layout = declare_layout("kdflow", {"target_mask": "target_mask"}, kind=kind)
    batch = _table([rng.integers(0, VOCAB, 5).tolist()], [ids.tolist()], [values.tolist()],
                   target_mask=pa.array([entry_mask.tolist()], pa.list_(pa.list_(pa.int8()))))
    rows = source_rows(batch, layout, 0, K, VOCAB)
    assert rows.target.tolist() == [True, True, True, True, False]
    for n in range(5):
        kept = [j for j in range(K) if entry_mask[n, j]]
        want_ids = [int(ids[n, j]) for j in kept] + [-1] * (K - len(kept))
        want = [logprobs[n, j] for j in kept] + [-INF] * (K - len(kept))
        assert rows.ids[n].tolist() == (want_ids if kept else [-1] * K)
        np.testing.assert_allclose(rows.logprobs[n], np.float32(want) if kept else [-INF] * K, rtol=1e-6)


def _import(make_config, tmp_path: Path, table: pa.Table) -> dict:
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "capture.parquet")
    config = import_config(make_config, tmp_path / "run", precompute__top_k=K, seq_len=8)
    return import_store(open_run_root(config), teacher_pass_settings(config), str(tmp_path / "capture.parquet"),
                        LAYOUTS["kdflow"], "t")


def test_a_source_without_any_teacher_target_is_refused_and_leaves_nothing(make_config, tmp_path: Path) -> None:
    rng = np.random.default_rng()
    ids, _ = _distribution(rng, 40)
    table = _table(_rows_of(rng.integers(0, VOCAB, 40), [20, 20]), _rows_of(ids, [20, 20]),
                   _rows_of(np.full((40, K), -INF), [20, 20]))
    with pytest.raises(StoreError) as error:
        _import(make_config, tmp_path, table)
    assert str(error.value) == (f"import source '{tmp_path / 'capture.parquet'}' has no position with a teacher "
                                "target (each is masked, or its values are all -inf): nothing to train on")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []  # no store, no staged work


def test_log_probs_that_sum_to_one_everywhere_import_with_a_warning_to_declare_them_renormalised(
        make_config, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng()
    ids, p = _distribution(rng, 40)
    renormalised = np.log(p / p.sum(1, keepdims=True))
    rows = _table(_rows_of(rng.integers(0, VOCAB, 40), [20, 20]), _rows_of(ids, [20, 20]),
                  _rows_of(renormalised, [20, 20]))
    with caplog.at_level(logging.WARNING, logger="kdflow.import"):
        summary = _import(make_config, tmp_path, rows)
    assert summary["targets"] == 40 and summary["complete"]
    assert "sum to 1 at every one of the 40 positions with a target; if the source renormalised them over the K, " \
           "import it with --kind renormalised" in caplog.text
    caplog.clear()
    (tmp_path / "full").mkdir()
    with caplog.at_level(logging.WARNING, logger="kdflow.import"):  # full log-probs (mass below 1): no warning
        _import(make_config, tmp_path / "full", _table(rows.column(0).to_pylist(), _rows_of(ids, [20, 20]),
                                                       _rows_of(np.log(p), [20, 20])))
    assert "renormalised" not in caplog.text


def test_an_import_says_how_far_it_read_and_what_it_could_not_check(make_config, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng()
    ids, p = _distribution(rng, 40)
    rows = _table(_rows_of(rng.integers(0, VOCAB, 40), [20, 20]), _rows_of(ids, [20, 20]), _rows_of(np.log(p),
                                                                                                    [20, 20]))
    with caplog.at_level(logging.INFO, logger="kdflow"):
        _import(make_config, tmp_path, rows)
    assert "import: 2/2 rows, 40 tokens, " in caplog.text  # Parquet's footers give the total: a rate and an ETA
    assert "import: the source has no text column (text): its token ids are checked against the tokenizer's " \
           "vocabulary size only" in caplog.text


@pytest.mark.parametrize("fault", ["disk full", "store unreachable"])
def test_a_full_disk_or_a_lost_store_keeps_the_staged_work_for_the_rerun(make_config, tmp_path: Path, monkeypatch,
                                                                         fault: str) -> None:
    """Unlike a bad row (which a rerun meets again), these are not the source's fault: the rerun goes on from what
    was staged."""
    from kdflow.schemas.disk_space import DiskFull
    from kdflow.schemas.errors import StoreUnreachable
    from kdflow.tasks.teacher import logit_staging

    rng = np.random.default_rng()
    ids, p = _distribution(rng, 200)
    table = _table(_rows_of(rng.integers(0, VOCAB, 200), [20] * 10), _rows_of(ids, [20] * 10),
                   _rows_of(np.log(p), [20] * 10))
    error = DiskFull("somewhere") if fault == "disk full" else StoreUnreachable("the store went away")

    def fail_at_shard_2(site: str, run_root, **where) -> None:
        if where.get("shard") == 2:
            raise error

    monkeypatch.setattr(logit_staging.faults, "maybe_fire", fail_at_shard_2)
    with pytest.raises(type(error)):
        _import(make_config, tmp_path, table)
    assert len(list((tmp_path / "run" / "_imports").glob("*/packed-*.npz"))) == 3  # shards 0-2 written, kept
    monkeypatch.undo()
    config = import_config(make_config, tmp_path / "run", precompute__top_k=K, seq_len=8)
    again = import_store(open_run_root(config), teacher_pass_settings(config), str(tmp_path / "capture.parquet"),
                         LAYOUTS["kdflow"], "t")  # the same file: the same staging key
    assert again["staged_reused"] == 2 and again["complete"]  # the two with their progress record
