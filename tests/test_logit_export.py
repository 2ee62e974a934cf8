"""`kdflow store export` writes each layout as its trainer reads it: the columns the layout's fields name, the
values of its `kind` (full log-probs, renormalised over the K, logits), the stacked pair in its declared order,
and a target mask where the layout has one, -inf and mask 0 where a position has no teacher target.

The unit tests build decoded arrays by hand and check the tables against a reference written here with plain
Python loops; the round trips export a real tiny store (tests/support/runs.py) in every built-in layout and read it
back with the importer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.runs import DENSE_TAG, read_lines, student_path

from kdflow.schemas.commits import list_commits, stage_dir
from kdflow.schemas.logit_layouts import LAYOUTS, LogitLayout
from kdflow.schemas.shards import TopkShard
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings, training_settings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.teacher.logit_export import export_problem, export_store, layout_table

# The layouts as their public sources lay them out (the built-ins of part "layouts" are instances of these).
AXOLOTL = LogitLayout("axolotl-prepared", "axolotl's KD rows after its chat-template strategy", tokens="input_ids",
                      ids="target_token_ids", values="target_logprobs", kind="renormalised",
                      target_mask="target_mask", attention_mask="attention_mask")
VALUES_FIRST = LogitLayout("stacked-values-first", "targets [T, 2, K], log-probs first", tokens="inputs",
                           stacked="targets", stacked_order="values_first")
LOGITS = LogitLayout("top-k-logits", "top-K ids and raw logits", tokens="token_ids", ids="topk_indices",
                     values="topk_logits", kind="logits", target_mask="loss_mask")
KDFLOW = LogitLayout("kdflow-own", "kdflow's own, with the tail", tokens="input_ids", ids="topk_ids",
                     values="topk_logprobs", tail="tail_logprob")
VOCAB, K = 50, 4


def _decoded(rows: int = 2, seq_len: int = 5, padded: bool = True) -> tuple[np.ndarray, ...]:
    """input_ids (n, T), ids (n, T, K) by descending log-prob (one position of adaptive K: 2 kept, -1/-inf), full
    log-probs (n, T, K) and their tail (n, T)."""
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.ones(K + 1), (rows, seq_len))  # K kept + the tail's mass
    order = np.argsort(-probs[..., :K], axis=-1)
    logprobs = np.log(np.take_along_axis(probs[..., :K], order, axis=-1)).astype(np.float32)
    ids = np.stack([[rng.permutation(VOCAB)[:K] for _ in range(seq_len)] for _ in range(rows)]).astype(np.int32)
    tail = np.log(probs[..., K]).astype(np.float32)
    if padded:
        ids[1, 2, 2:], logprobs[1, 2, 2:] = -1, -np.inf
    return rng.integers(0, VOCAB, (rows, seq_len)).astype(np.int32), ids, logprobs, tail


def _reference_renormalised(logprobs: list[float]) -> list[float]:
    """log(p_i / sum p) over the finite entries, written with math only."""
    mass = sum(math.exp(v) for v in logprobs if v != -math.inf)
    return [v - math.log(mass) if v != -math.inf else -math.inf for v in logprobs]


def test_axolotl_rows_carry_renormalised_logprobs_a_per_id_mask_and_gatherable_ids() -> None:
    input_ids, ids, logprobs, tail = _decoded()
    target = np.ones(input_ids.shape, bool)
    target[0, :2] = False  # a prompt: no teacher target
    table = layout_table(AXOLOTL, input_ids, ids, logprobs, None, target)
    assert table.column_names == ["input_ids", "target_token_ids", "target_logprobs", "target_mask",
                                  "attention_mask"]
    rows = table.to_pylist()
    assert np.asarray(rows[0]["target_logprobs"]).shape == (5, K) and len(rows[0]["attention_mask"]) == 5
    assert pa.types.is_int32(table.schema.field("target_token_ids").type.value_type.value_type)
    assert pa.types.is_float32(table.schema.field("target_logprobs").type.value_type.value_type)
    for r, row in enumerate(rows):
        assert row["attention_mask"] == [1] * 5
        for t in range(5):
            lp, got_ids, mask = row["target_logprobs"][t], row["target_token_ids"][t], row["target_mask"][t]
            assert all(0 <= i < VOCAB for i in got_ids), got_ids  # a trainer gathers at every id before masking
            if not target[r, t]:
                assert mask == [0] * K and lp == [-math.inf] * K and got_ids == list(range(K))
                continue
            want = _reference_renormalised([float(v) for v in logprobs[r, t]])
            assert mask == [1 if v != -math.inf else 0 for v in want]
            assert lp == pytest.approx(want, abs=1e-6)
            assert math.fsum(math.exp(v) for v in lp) == pytest.approx(1.0, abs=1e-6)
            kept = [i for i, m in zip(got_ids, mask) if m]
            assert kept == [int(i) for i in ids[r, t] if i >= 0]
    assert rows[1]["target_token_ids"][2][2:] == [0, 0]  # adaptive K's padding: a valid placeholder, masked


def test_axolotl_s_top_k_forward_kl_reads_the_rows_as_written() -> None:
    """The KD loss axolotl's trainer computes on a batch of these rows (gather the student's log-probs at every id,
    keep the entries target_mask marks, sum p (log p - log q) over them; it then divides by a count, left out
    here), written from its description, equals a dense reference over the store's own distribution: no -inf
    reaches the sum, no id is out of range."""
    import torch

    input_ids, ids, logprobs, tail = _decoded()
    target = np.ones(input_ids.shape, bool)
    target[:, :2] = False
    rows = layout_table(AXOLOTL, input_ids, ids, logprobs, None, target).to_pydict()
    student = torch.randn(2, 5, VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    log_q = torch.log_softmax(student, -1)
    gathered = torch.gather(log_q, -1, torch.tensor(rows["target_token_ids"]))
    mask = torch.tensor(rows["target_mask"]).bool()
    teacher = torch.tensor(rows["target_logprobs"], dtype=torch.float64)[mask]
    loss = (teacher.exp() * (teacher - gathered[mask])).sum()
    reference = 0.0
    for r in range(2):
        for t in range(2, 5):
            kept = [(int(i), float(v)) for i, v in zip(ids[r, t], logprobs[r, t]) if i >= 0]
            total = sum(math.exp(v) for _, v in kept)
            reference += sum(math.exp(v) / total * (v - math.log(total) - float(log_q[r, t, i])) for i, v in kept)
    assert float(loss) == pytest.approx(reference, rel=1e-5)


def test_the_stacked_pair_follows_its_declared_order() -> None:
    input_ids, ids, logprobs, tail = _decoded(padded=False)
    first = layout_table(VALUES_FIRST, input_ids, ids, logprobs, tail).column("targets").to_pylist()
    ids_first = LogitLayout("s", "", tokens="inputs", stacked="targets")
    second = layout_table(ids_first, input_ids, ids, logprobs, tail).column("targets").to_pylist()
    for r in range(2):
        for t in range(5):
            assert first[r][t][0] == pytest.approx(logprobs[r, t].tolist()) and first[r][t][1] == ids[r, t].tolist()
            assert second[r][t] == [first[r][t][1], first[r][t][0]]


def test_logits_give_the_renormalised_distribution_under_a_log_softmax_over_the_k() -> None:
    input_ids, ids, logprobs, tail = _decoded()
    table = layout_table(LOGITS, input_ids, ids, logprobs, None)
    assert table.column_names == ["token_ids", "topk_indices", "topk_logits", "loss_mask"]
    logits = table.to_pylist()
    for r in range(2):
        for t in range(5):
            row = logits[r]["topk_logits"][t]
            finite = [v for v in row if v != -math.inf]
            log_z = max(finite) + math.log(sum(math.exp(v - max(finite)) for v in finite))
            got = [v - log_z if v != -math.inf else -math.inf for v in row]
            assert got == pytest.approx(_reference_renormalised([float(v) for v in logprobs[r, t]]), abs=1e-6)


def test_kdflow_s_own_layout_keeps_the_full_logprobs_and_the_tail() -> None:
    input_ids, ids, logprobs, tail = _decoded()
    table = layout_table(KDFLOW, input_ids, ids, logprobs, tail)
    assert table.column_names == ["input_ids", "topk_ids", "topk_logprobs", "tail_logprob"]
    assert np.array_equal(np.asarray(table.column("topk_ids").to_pylist()), ids)  # -1 padding kept
    assert np.array_equal(np.asarray(table.column("topk_logprobs").to_pylist(), np.float32), logprobs)
    assert np.array_equal(np.asarray(table.column("tail_logprob").to_pylist(), np.float32), tail)


@pytest.mark.parametrize("layout, normalisation, masked, says", [
    (KDFLOW, "top_k", False, "renormalised over the K ids (no tail), layout kdflow-own declares log-probs over the "
                             "full vocabulary and a tail"),
    (VALUES_FIRST, "top_k", False, "export to a renormalised or logits layout"),
    (VALUES_FIRST, "full", True, "layout stacked-values-first has no target_mask column to say so"),
])
def test_a_store_is_not_exported_as_what_it_is_not(layout: LogitLayout, normalisation: str, masked: bool,
                                                   says: str) -> None:
    assert says in export_problem(layout, normalisation, masked)


@pytest.mark.parametrize("layout, normalisation, masked", [
    (AXOLOTL, "top_k", True), (LOGITS, "top_k", True), (AXOLOTL, "full", False), (KDFLOW, "full", False)])
def test_what_a_layout_can_say_exports(layout: LogitLayout, normalisation: str, masked: bool) -> None:
    assert export_problem(layout, normalisation, masked) is None


# --- round trips on a real tiny store ----------------------------------------------------------------------------

V1 = {"precompute__store__format": "v1", "student__steps": 3, "student__save_every": 3}


def _store_arrays(config, tag: str) -> tuple[np.ndarray, np.ndarray]:
    run_root = RunRoot(config.run_root)
    store = stage_dir(run_root, "topk", tag)
    records = list_commits(run_root, store, "topk", tag)
    decoded = [TopkShard(run_root, f"{store}/{records[i].data_file}").read() for i in sorted(records)]
    return np.concatenate([d.ids for d in decoded]), np.concatenate([d.logprobs for d in decoded])


def _check_columns(layout: LogitLayout, table: pa.Table, seq_len: int, k: int) -> None:
    """The table holds the columns the layout's fields name, nested as its documentation says."""
    names = [layout.tokens, *layout.target_fields()]
    names += [name for name in (layout.tail, layout.target_mask, layout.attention_mask) if name is not None]
    assert table.column_names == names
    row = table.slice(0, 1).to_pylist()[0]
    assert len(row[layout.tokens]) == seq_len
    if layout.stacked is not None:
        assert np.asarray(row[layout.stacked]).shape == (seq_len, 2, k)
    else:
        assert np.asarray(row[layout.ids]).shape == np.asarray(row[layout.values]).shape == (seq_len, k)
    if layout.target_mask is not None:
        assert np.asarray(row[layout.target_mask]).shape == (seq_len, k)


def _log_softmax(values: np.ndarray) -> np.ndarray:
    """Over the last axis, in float64, -inf entries kept at -inf (the reference a trainer applies to logits)."""
    values = values.astype(np.float64)
    top = np.max(values, axis=-1, keepdims=True)
    return values - (np.log(np.exp(values - top).sum(axis=-1, keepdims=True)) + top)


# (DistillKit's packed columns are not a layout of plain columns: its export is tested in test_store_io.py)
@pytest.mark.parametrize("layout", [*(layout for layout in LAYOUTS.values() if layout.kind != "distillkit"), AXOLOTL,
                                    VALUES_FIRST, LOGITS, KDFLOW],
                         ids=lambda layout: layout.name)
def test_every_layout_exports_a_real_store_as_documented(fresh_run, tmp_path: Path, layout: LogitLayout) -> None:
    import datasets

    original = fresh_run(student__topk_tag=DENSE_TAG, **V1)
    out = tmp_path / "out"
    summary = export_store(str(original.run_root), str(out), DENSE_TAG, layout)
    assert summary["kind"] == layout.kind and summary["normalisation"] == "full"
    assert json.loads((out / "kdflow_export.json").read_text()) == summary
    files = sorted(str(p) for p in (out / "data").glob("*.parquet"))
    _check_columns(layout, pq.read_table(files[0]), 32, 8)
    table = pa.concat_tables(pq.read_table(f) for f in files)
    assert table.num_rows == summary["rows"] == datasets.load_dataset("parquet", data_files=files,
                                                                        split="train").num_rows
    assert not list((out / "data").glob(".*"))  # no temporary file left
    want_ids, want_logprobs = _store_arrays(original, DENSE_TAG)
    if layout.stacked is not None:
        pair = np.asarray(table.column(layout.stacked).to_pylist(), np.float32)  # (n, T, 2, K)
        got_ids, values = (pair[:, :, 0], pair[:, :, 1]) if layout.stacked_order == "ids_first" else \
            (pair[:, :, 1], pair[:, :, 0])
    else:
        got_ids = np.asarray(table.column(layout.ids).to_pylist())
        values = np.asarray(table.column(layout.values).to_pylist(), np.float32)
    assert np.array_equal(got_ids, want_ids)
    reference = want_logprobs.astype(np.float32)
    if layout.kind == "logprobs":
        assert np.array_equal(values, reference)
    else:  # renormalised, or logits a log-softmax turns into it: the store's distribution over its K
        np.testing.assert_allclose(_log_softmax(values), _log_softmax(reference), atol=1e-5)
    if layout.kind == "renormalised":
        np.testing.assert_allclose(np.exp(values.astype(np.float64)).sum(-1), 1.0, atol=1e-5)
    if layout.target_mask is not None:  # every position of this store has a target
        assert np.asarray(table.column(layout.target_mask).to_pylist()).all()


def test_axolotl_round_trip_imports_and_trains_to_the_original_losses(fresh_run, tmp_path: Path) -> None:
    """Exported in the built-in axolotl layout, imported back into a lossless (float32) store and trained on: a
    logprobs-kind layout gives back the store's arrays and its losses; a renormalised one (axolotl's prepared rows)
    gives back the ids and the store's distribution over its K, which the importer keeps as a top_k store."""
    from kdflow.tasks.student.train import train
    from kdflow.tasks.teacher.logit_import import import_store

    lossless = {"precompute__store__values": "float32", "precompute__store__tail": "float32"}
    original = fresh_run(student__topk_tag=DENSE_TAG, **V1)
    export_store(str(original.run_root), str(tmp_path / "out"), DENSE_TAG, "axolotl")
    # a v2 store: axolotl's renormalised rows make a top_k store, which v1 cannot record
    imported = fresh_run(student__steps=3, student__save_every=3, **lossless).model_copy(
        update={"run_root": str(tmp_path / "imported")})
    summary = import_store(open_run_root(imported), teacher_pass_settings(imported), str(tmp_path / "out" / "data"),
                           "axolotl", "sharp-tiny")
    imported = imported.model_copy(update={"student": imported.student.model_copy(
        update={"topk_tag": summary["tag"]})})
    (got_ids, got_logprobs), (want_ids, want_logprobs) = (_store_arrays(imported, summary["tag"]),
                                                          _store_arrays(original, DENSE_TAG))
    # the same ids at every position; equal float16 values may come in another order (v2 breaks ties by id)
    assert np.array_equal(np.sort(got_ids, axis=-1), np.sort(want_ids, axis=-1))
    order_got, order_want = np.argsort(got_ids, axis=-1), np.argsort(want_ids, axis=-1)
    got_logprobs = np.take_along_axis(got_logprobs, order_got, axis=-1)
    want_logprobs = np.take_along_axis(want_logprobs, order_want, axis=-1)
    if LAYOUTS["axolotl"].kind == "logprobs":
        assert np.array_equal(got_logprobs, want_logprobs.astype(np.float32))
    else:
        np.testing.assert_allclose(_log_softmax(got_logprobs), _log_softmax(want_logprobs), atol=1e-5)
    train(open_run_root(original), training_settings(original))
    train(open_run_root(imported), training_settings(imported))
    losses = [[r["loss"] for r in read_lines(student_path(c, "metrics.jsonl"))] for c in (original, imported)]
    if LAYOUTS["axolotl"].kind == "logprobs":  # the same targets: the same K+1 loss
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    else:  # the renormalised-K loss of a top_k store (part "masks"), on the same distribution over the K
        assert all(math.isfinite(loss) for loss in losses[1]) and len(losses[1]) == len(losses[0])
    # credit: the imported store's card names the imported teacher; kl_full against teacher.model is not computed
    # (the config does not say the imported teacher is teacher.model), and the card says why in one line
    evals = [read_lines(student_path(c, "eval.jsonl")) for c in (original, imported)]
    assert all("kl_full" in e for e in evals[0]) and not any("kl_full" in e for e in evals[1])
    card = student_path(imported, "final", "README.md").read_text()
    assert "| teacher | `sharp-tiny` (its targets imported with `kdflow store import`) |" in card
    assert card.count(Path(original.teacher.model).name) == 1 and str(tmp_path) not in card  # in the note only
    assert ("No kl_full: the store's targets were imported from teacher 'sharp-tiny', and the config does not say "
            f"that is teacher.model '{Path(original.teacher.model).name}' (student.imported_is_teacher_model).\n"
            in card)
    # saying the imported teacher is teacher.model (it is: the store was exported from its own targets) brings it back
    same = imported.model_copy(update={"student": imported.student.model_copy(
        update={"name": "same-teacher", "imported_is_teacher_model": True})})
    train(open_run_root(same), training_settings(same))
    assert all("kl_full" in e for e in read_lines(student_path(same, "eval.jsonl")))
    assert "No kl_full" not in student_path(same, "final", "README.md").read_text()


def test_the_export_record_names_the_teacher_without_its_local_path(fresh_run, tmp_path: Path) -> None:
    """`kdflow_export.json` travels with the export: the teacher's folder by its name, not where it lay."""
    from kdflow.schemas.store_info import TopkStoreInfo, write_store_info

    original = fresh_run(student__topk_tag=DENSE_TAG, **V1)
    run_root = RunRoot(original.run_root)
    write_store_info(run_root, stage_dir(run_root, "topk", DENSE_TAG), TopkStoreInfo(
        tag=DENSE_TAG, teacher_fingerprint="t", tokens_fingerprint="k", teacher={"model": original.teacher.model},
        teacher_identity={}, top_k=8, logprobs_dtype="float16", seq_len=32))
    summary = export_store(str(original.run_root), str(tmp_path / "out"), DENSE_TAG, "kdflow")
    assert summary["teacher"] == {"model": Path(original.teacher.model).name}
    assert str(tmp_path) not in (tmp_path / "out" / "kdflow_export.json").read_text()


def test_an_export_goes_into_an_empty_folder_or_over_its_own_earlier_one(fresh_run, tmp_path: Path) -> None:
    from kdflow.schemas.errors import ConfigError

    original = fresh_run(student__topk_tag=DENSE_TAG, **V1)
    out = tmp_path / "out"
    first = export_store(str(original.run_root), str(out), DENSE_TAG, "kdflow")
    (out / "data" / first["files"][0].split("/")[-1]).unlink()  # as a killed export left it
    from kdflow.tasks.teacher.logit_reader import source_files

    with pytest.raises(ConfigError, match=f"holds {len(first['files']) - 1} of the {len(first['files'])} files named "
                                          "train-NNNNN-of-"):  # not imported as the part it holds
        source_files(str(out / "data"))
    assert export_store(str(original.run_root), str(out), DENSE_TAG, "kdflow")["files"] == first["files"]
    assert len(source_files(str(out / "data")).files) == len(first["files"])
    with pytest.raises(ConfigError, match="holds an export of store .* in layout kdflow, which is not this export's"):
        export_store(str(original.run_root), str(out), DENSE_TAG, "axolotl")  # other rows under the same names
    (out / "data" / "train-00000-of-00099.parquet").write_bytes(b"")  # another store's shard
    with pytest.raises(ConfigError, match=r"holds data/train-00000-of-00099.parquet, which is not this export's"):
        export_store(str(original.run_root), str(out), DENSE_TAG, "kdflow")
    assert sorted(p.name for p in (out / "data").iterdir()) == sorted(
        [f.split("/")[-1] for f in first["files"]] + ["train-00000-of-00099.parquet"])  # nothing written
