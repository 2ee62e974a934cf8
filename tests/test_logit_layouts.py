"""Layouts as data: every built-in reads small rows laid out exactly as its public source documents them (shape,
dtype, pair order, padding, mask), a YAML file and command-line options declare others, and `source_rows` turns
them into SourceRows equal to a separately written per-position reference; bad input is one line naming the row and
the field.

The teacher here is a fixed random distribution over a 50-token vocabulary: each row's top-K ids and log-probs are
its log-softmax's K largest, written in each layout's form (log-probs over the full vocabulary, renormalised over
the K, or raw logits).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kdflow.commands.store_io import declared_layout, import_parser
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.logit_layouts import LAYOUTS, declare_layout, logit_layout
from kdflow.tasks.teacher.logit_dataset import check_text, source_rows
from kdflow.tasks.teacher.source_rows import FULL, TOP_K

VOCAB, K = 50, 4
INF = float("inf")


def _teacher(lengths: list[int], seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Per row: tokens (T,), logits (T, V), full log-probs (T, V), the top-K ids (T, K) by descending value."""
    rng = np.random.default_rng(seed)
    rows = []
    for length in lengths:
        logits = rng.normal(size=(length, VOCAB)) * 3 + 5
        full = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        ids = np.argsort(-full, axis=1, kind="stable")[:, :K]
        rows.append({"tokens": rng.integers(0, VOCAB, length), "logits": logits, "full": full, "ids": ids})
    return rows


def _top(row: dict[str, np.ndarray], name: str) -> np.ndarray:
    return np.take_along_axis(row[name], row["ids"], 1)


def _reference(tokens: list[list[int]], ids: list[list[list[float]]], values: list[list[list[float]]], kind: str,
               keep: list[list[int]] | None = None, mask: list[list[int]] | None = None) -> dict[str, np.ndarray]:
    """What SourceRows must hold, one position at a time in plain Python (the dense reference)."""
    out: dict[str, list] = {"offsets": [0], "tokens": [], "ids": [], "logprobs": [], "target": []}
    for r, row in enumerate(tokens):
        for t, token in enumerate(row):
            if keep is not None and not keep[r][t]:
                continue
            entries = [float(v) for v in values[r][t]]
            has = (mask is None or bool(mask[r][t])) and any(v != -INF for v in entries)
            if kind == "logits" and has:
                top = max(entries)
                norm = math.log(sum(math.exp(v - top) for v in entries if v != -INF))
                entries = [v - top - norm if v != -INF else -INF for v in entries]
            out["tokens"].append(int(token))
            out["target"].append(has)
            out["ids"].append([int(i) if has and v != -INF else -1 for i, v in zip(ids[r][t], entries)])
            out["logprobs"].append([v if has else -INF for v in entries])
        out["offsets"].append(len(out["tokens"]))
    return {key: np.asarray(value) for key, value in out.items()}


def _assert_rows(rows, expected: dict[str, np.ndarray], normalisation: str) -> None:
    assert rows.normalisation == normalisation
    np.testing.assert_array_equal(rows.offsets, expected["offsets"])
    np.testing.assert_array_equal(rows.tokens, expected["tokens"])
    np.testing.assert_array_equal(rows.target, expected["target"])
    np.testing.assert_array_equal(rows.ids, expected["ids"])
    np.testing.assert_allclose(rows.logprobs, expected["logprobs"].astype(np.float32), rtol=1e-6, atol=1e-6)
    assert rows.tokens.dtype == np.int32 and rows.ids.dtype == np.int32 and rows.logprobs.dtype == np.float32


def _nested(values: list, kind: pa.DataType, depth: int) -> pa.Array:
    for _ in range(depth):
        kind = pa.list_(kind)
    return pa.array(values, type=kind)


def test_kdflow_layout_reads_rows_of_any_length_with_their_tail() -> None:
    teacher = _teacher([5, 2, 7])
    tokens = [row["tokens"].tolist() for row in teacher]
    ids = [row["ids"].tolist() for row in teacher]
    logprobs = [_top(row, "full").tolist() for row in teacher]
    tails = [np.log1p(-np.exp(_top(row, "full")).sum(1)).tolist() for row in teacher]
    batch = pa.table({"input_ids": _nested(tokens, pa.int32(), 1), "topk_ids": _nested(ids, pa.int32(), 2),
                      "topk_logprobs": _nested(logprobs, pa.float32(), 2),
                      "tail_logprob": _nested(tails, pa.float32(), 1), "text": ["a", "b", "c"]})
    rows = source_rows(batch, logit_layout("kdflow"), 40, K, VOCAB)
    _assert_rows(rows, _reference(tokens, ids, logprobs, "logprobs"), FULL)
    np.testing.assert_allclose(rows.tail, np.concatenate(tails).astype(np.float32), rtol=1e-5)
    assert rows.first_row == 40 and rows.rows == 3 and rows.text == ["a", "b", "c"]


def test_stacked_layout_reads_llamakd_pairs_log_probs_first_and_names_a_reversed_pair() -> None:
    # codys12/LlamaKD: inputs [T], targets [T, 2, K] with the pair (log-probs, ids), the ids stored as floats.
    teacher = _teacher([6, 3], seed=1)
    tokens = [row["tokens"].tolist() for row in teacher]
    pairs = [np.stack([_top(row, "full"), row["ids"].astype(float)], 1).tolist() for row in teacher]
    batch = pa.table({"inputs": _nested(tokens, pa.int64(), 1), "targets": _nested(pairs, pa.float32(), 3)})
    rows = source_rows(batch, LAYOUTS["stacked"], 0, K, VOCAB)
    expected = _reference(tokens, [[p[1] for p in row] for row in pairs], [[p[0] for p in row] for row in pairs],
                          "logprobs")
    _assert_rows(rows, expected, FULL)
    assert rows.tail is None
    ids_first = declare_layout("stacked", {}, stacked_order="ids_first")
    with pytest.raises(StoreError) as error:
        source_rows(batch, ids_first, 7, K, VOCAB)
    assert str(error.value) == (
        "row 7 field targets: ids that are not whole numbers at position 0: the pair order is probably reversed "
        "(layout stacked+options reads ids_first; declare stacked_order: values_first, or --stacked-order "
        "values_first)")


def test_axolotl_layout_reads_renormalised_rows_with_prompt_padding_and_target_mask() -> None:
    # axolotl's KD chat_template transform: position 0 padded with ids 0..K-1 and -inf, target_mask [T][K] 0 on
    # the prompt (labels -100), target_logprobs renormalised over the K kept.
    teacher = _teacher([6, 4], seed=2)
    prompt = [3, 2]
    tokens, ids, values, masks = [], [], [], []
    for row, prompt_len in zip(teacher, prompt):
        top = _top(row, "full")
        renormalised = top - np.log(np.exp(top).sum(1, keepdims=True))
        row_ids, row_values = row["ids"].tolist(), renormalised.tolist()
        row_ids[0], row_values[0] = list(range(K)), [-INF] * K
        tokens.append(row["tokens"].tolist())
        ids.append(row_ids)
        values.append(row_values)
        masks.append([[0] * K if t < prompt_len else [1] * K for t in range(len(row_ids))])
    batch = pa.table({"input_ids": _nested(tokens, pa.int64(), 1),
                      "attention_mask": _nested([[1] * len(t) for t in tokens], pa.int64(), 1),
                      "labels": _nested(tokens, pa.int64(), 1), "target_token_ids": _nested(ids, pa.int64(), 2),
                      "target_logprobs": _nested(values, pa.float32(), 2),
                      "target_mask": _nested(masks, pa.int64(), 2)})
    rows = source_rows(batch, LAYOUTS["axolotl"], 0, K, VOCAB)
    expected = _reference(tokens, ids, values, "renormalised", mask=[[m[0] for m in row] for row in masks])
    _assert_rows(rows, expected, TOP_K)
    assert rows.target.tolist() == [False] * 3 + [True] * 3 + [False] * 2 + [True] * 2
    assert rows.tail is None and (rows.ids[~rows.target] == -1).all()


def test_logits_layout_reads_float64_logits_and_drops_attention_padding() -> None:
    # arcee-ai/LLama-405B-Logits: input_ids, attention_mask, token_ids [T][K], top_values [T][K] raw logits;
    # here rows padded to one length with attention_mask 0, and an extra column the layout does not name.
    teacher = _teacher([5, 3], seed=3)
    width = 6
    tokens, ids, values, keep = [], [], [], []
    for row in teacher:
        pad = width - len(row["tokens"])
        tokens.append(row["tokens"].tolist() + [1] * pad)
        ids.append(row["ids"].tolist() + [[0, 1, 2, 3]] * pad)
        values.append(_top(row, "logits").tolist() + [[0.0] * K] * pad)
        keep.append([1] * len(row["tokens"]) + [0] * pad)
    batch = pa.table({"normalized_logits": _nested(values, pa.float64(), 2),
                      "input_ids": _nested(tokens, pa.int64(), 1), "attention_mask": _nested(keep, pa.int64(), 1),
                      "token_ids": _nested(ids, pa.int64(), 2), "top_values": _nested(values, pa.float64(), 2)})
    rows = source_rows(batch.to_batches()[0], LAYOUTS["logits"], 0, K, VOCAB)
    _assert_rows(rows, _reference(tokens, ids, values, "logits", keep=keep), TOP_K)
    np.testing.assert_allclose(np.exp(rows.logprobs.astype(np.float64)).sum(1), 1.0, rtol=1e-6)


def _own_capture() -> tuple[pa.Table, dict[str, np.ndarray]]:
    """A capture with its own column names, float16 logits and float ids with trailing -inf padding."""
    teacher = _teacher([4, 5], seed=4)
    tokens = [row["tokens"].tolist() for row in teacher]
    ids = [row["ids"].astype(float).tolist() for row in teacher]
    values = [np.float16(_top(row, "logits")).astype(float).tolist() for row in teacher]
    ids[1][2][3], values[1][2][3] = -1.0, -INF  # a position that kept 3
    table = pa.table({"tokens": _nested(tokens, pa.int32(), 1), "top_ids": _nested(ids, pa.float32(), 2),
                      "topk_logits": _nested(values, pa.float16(), 2)})
    return table, _reference(tokens, ids, values, "logits")


def test_a_yaml_declared_layout_reads_its_capture(tmp_path: Path) -> None:
    table, expected = _own_capture()
    path = tmp_path / "my_capture.yaml"
    path.write_text("tokens: tokens\nids: top_ids\nvalues: topk_logits\nkind: logits\n")
    layout = declare_layout(str(path), {})
    assert layout.name == "my_capture" and layout.kind == "logits"
    _assert_rows(source_rows(table, layout, 0, K, VOCAB), expected, TOP_K)


@pytest.mark.parametrize("options", [
    ["--column", "tokens=tokens", "--column", "ids=top_ids", "--column", "values=topk_logits", "--kind", "logits"],
    ["--layout", "kdflow", "--column", "tokens=tokens", "--column", "ids=top_ids", "--column", "values=topk_logits",
     "--kind", "logits"],
])
def test_a_command_line_declared_layout_reads_its_capture(options: list[str]) -> None:
    table, expected = _own_capture()
    args = import_parser().parse_args(["source", "--config", "c.yaml", "--teacher", "t", *options])
    _assert_rows(source_rows(table, declared_layout(args), 0, K, VOCAB), expected, TOP_K)


@pytest.mark.parametrize("declare, message", [
    (lambda p: declare_layout(p("tokens: a\nids: b\nvalues: c\nlogprob: d\n"), {}),
     "layout bad: unknown key 'logprob'; known: name, description, tokens"),
    (lambda p: declare_layout(p("tokens: a\nids: b\n"), {}),
     "layout bad: name the column of the values (or one `stacked` column of both)"),
    (lambda p: declare_layout(p("tokens: a\nstacked: b\nstacked_order: logprobs_first\n"), {}),
     "layout bad: stacked_order must be one of ids_first, values_first, not 'logprobs_first'"),
    (lambda p: declare_layout("llamakd", {}),
     "unknown logit layout 'llamakd'; known: axolotl, distillkit, kdflow, logits"),
    (lambda p: declare_layout(p("tokens: a\nids: b\nvalues: c\ntail: d\nkind: logits\n"), {}),
     "layout bad: a tail column needs kind logprobs or probabilities (kind logits has no known tail)"),
    (lambda p: declare_layout("kdflow", {"tail": "t"}, kind="renormalised"),
     "layout kdflow+options: a tail column needs kind logprobs"),
    (lambda p: declare_layout(None, {"token": "x"}), "--column token=...: unknown role; roles: tokens, ids"),
    (lambda p: declared_layout(import_parser().parse_args(["s", "--config", "c", "--teacher", "t"])),
     "name a --layout (a built-in or a YAML file) or declare one with --column ROLE=COLUMN"),
])
def test_a_bad_layout_is_one_line(tmp_path: Path, declare, message: str) -> None:
    def write(text: str) -> str:
        (tmp_path / "bad.yaml").write_text(text)
        return str(tmp_path / "bad.yaml")

    with pytest.raises(ConfigError) as error:
        declare(write)
    assert "\n" not in str(error.value) and str(error.value).startswith(message), str(error.value)


def _kdflow_rows(change: str) -> pa.Table:
    """Three kdflow-layout rows (lengths 4, 3, 5) with one thing wrong in row 1 (or everywhere, for K)."""
    teacher = _teacher([4, 3, 5], seed=5)
    tokens = [row["tokens"].tolist() for row in teacher]
    ids = [row["ids"].tolist() for row in teacher]
    values = [_top(row, "full").tolist() for row in teacher]
    bad_ids, bad_values = ids[1][2], values[1][2]
    if change == "K":
        ids = [[p + [49] for p in row] for row in ids]
        values = [[p + [-30.0] for p in row] for row in values]
    elif change == "ragged K":
        bad_ids.pop(), bad_values.pop()
    elif change == "values K":
        bad_values.pop()
    elif change == "positions":
        ids[1].pop(), values[1].pop()
    elif change == "outside":
        bad_ids[1] = VOCAB + 7
    elif change == "repeated":
        bad_ids[3] = bad_ids[0]
    elif change == "unsorted":
        bad_values[1], bad_values[2] = bad_values[2], bad_values[1]
    elif change == "inf middle":
        bad_values[1] = -INF
    elif change == "nan":
        bad_values[3] = float("nan")
    elif change == "logits":
        values[1] = _top(teacher[1], "logits").tolist()
    elif change == "null":
        ids[1] = None
    return pa.table({"input_ids": _nested(tokens, pa.int32(), 1), "topk_ids": _nested(ids, pa.int32(), 2),
                     "topk_logprobs": _nested(values, pa.float32(), 2)})


@pytest.mark.parametrize("change, message", [
    ("K", "row 10 field topk_ids: K=5, the config's precompute.top_k is 4; set precompute.top_k: 5"),
    ("ragged K", "row 11 field topk_ids: ragged K: position 2 has 3 ids, others 4"),
    ("positions", "row 11 field topk_ids: 2 positions, input_ids has 3"),
    ("values K", "row 11 field topk_logprobs: another number of values than ids at position 2 (topk_ids has K=4)"),
    ("outside", "row 11 field topk_ids: id 57 at position 2 is outside the vocabulary of 50"),
    ("repeated", "row 11 field topk_ids: a repeated id at position 2"),
    ("unsorted", "row 11 field topk_logprobs: log-probs not sorted by descending value at position 2"),
    ("inf middle", "row 11 field topk_logprobs: -inf before a finite value (-inf may only pad the end of a position) "
                   "at position 2"),
    ("nan", "row 11 field topk_logprobs: a value that is not a number at position 2"),
    ("logits", "row 11 field topk_logprobs: log-probs whose probabilities sum above 1 at position 0: values above 0 "
               "look like logits, declare kind logits"),
    ("null", "row 11 field topk_ids: a null position list"),
])
def test_bad_rows_are_one_line_naming_row_field_and_position(change: str, message: str) -> None:
    with pytest.raises(StoreError) as error:
        source_rows(_kdflow_rows(change), LAYOUTS["kdflow"], 10, K, VOCAB)
    assert str(error.value) == message


def test_renormalised_values_that_do_not_sum_to_one_name_the_kind_to_declare() -> None:
    teacher = _teacher([3], seed=6)
    top = _top(teacher[0], "full") - 3.0  # log-probs over the full vocabulary: their mass is far below 1
    batch = pa.table({"input_ids": _nested([teacher[0]["tokens"].tolist()], pa.int64(), 1),
                      "target_token_ids": _nested([teacher[0]["ids"].tolist()], pa.int64(), 2),
                      "target_logprobs": _nested([top.tolist()], pa.float32(), 2)})
    mass = float(np.exp(top[0].astype(np.float32).astype(np.float64)).sum())
    with pytest.raises(StoreError) as error:
        source_rows(batch, LAYOUTS["axolotl"], 0, K, VOCAB)
    assert str(error.value) == (f"row 0 field target_logprobs: values sum to {mass:.3g}, not 1, at position 0: "
                                "declare kind logprobs")


def test_a_declared_layout_names_only_columns_the_source_has() -> None:
    table, _ = _own_capture()
    layout = declare_layout(None, {"tokens": "tokens", "ids": "top_ids", "values": "topk_logits",
                                   "target_mask": "loss_mask"}, kind="logits")
    with pytest.raises(StoreError, match=r"^row 3: no column 'loss_mask' of layout declared \(columns: tokens, "):
        source_rows(table, layout, 3, K, VOCAB)


def test_check_text_compares_each_row_of_source_rows_with_its_tokens(tiny_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    texts = ["The quick brown fox", "jumps over the lazy dog"]
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    rng = np.random.default_rng(7)
    ids = [[sorted(rng.choice(VOCAB, K, replace=False).tolist()) for _ in row] for row in encoded]
    values = [[[-1.0, -2.0, -3.0, -4.0] for _ in row] for row in encoded]

    def rows(text: list[str]):
        batch = pa.table({"input_ids": _nested(encoded, pa.int64(), 1), "topk_ids": _nested(ids, pa.int64(), 2),
                          "topk_logprobs": _nested(values, pa.float32(), 2), "text": text})
        return source_rows(batch, LAYOUTS["kdflow"], 20, K, len(tokenizer))

    good = rows(texts)
    check_text(good, tokenizer, good.first_row, LAYOUTS["kdflow"])
    bad = rows([texts[0], "something else entirely"])
    with pytest.raises(StoreError, match=r"^row 21 field text: the tokenizer's encoding differs from input_ids at "):
        check_text(bad, tokenizer, bad.first_row, LAYOUTS["kdflow"])


def test_an_ids_first_source_read_as_stacked_names_the_order_and_a_bad_pair_is_one_line() -> None:
    # What kdflow's own stacked export wrote before the built-in followed LlamaKD's order: ids first.
    teacher = _teacher([3, 2], seed=8)
    pairs = [np.stack([row["ids"].astype(float), _top(row, "full")], 1).tolist() for row in teacher]
    tokens = _nested([row["tokens"].tolist() for row in teacher], pa.int64(), 1)
    with pytest.raises(StoreError) as error:
        source_rows(pa.table({"inputs": tokens, "targets": _nested(pairs, pa.float64(), 3)}), LAYOUTS["stacked"], 0,
                    K, VOCAB)
    assert str(error.value).endswith("the pair order is probably reversed (layout stacked reads values_first; "
                                     "declare stacked_order: ids_first, or --stacked-order ids_first)")
    pairs[1][1].append(pairs[1][1][0])
    with pytest.raises(StoreError) as error:
        source_rows(pa.table({"inputs": tokens, "targets": _nested(pairs, pa.float64(), 3)}), LAYOUTS["stacked"], 0,
                    K, VOCAB)
    assert str(error.value) == "row 1 field targets: not a pair of lists (ids and values) at position 1"


def test_a_boolean_target_mask_per_position_and_an_empty_batch() -> None:
    table, _ = _own_capture()
    mask = pa.array([[True, False, True, True], [False] * 5], type=pa.list_(pa.bool_()))
    layout = declare_layout(None, {"tokens": "tokens", "ids": "top_ids", "values": "topk_logits",
                                   "target_mask": "loss_mask"}, kind="logits")
    rows = source_rows(table.append_column("loss_mask", mask), layout, 0, K, VOCAB)
    assert rows.target.tolist() == [True, False, True, True] + [False] * 5
    assert (rows.ids[~rows.target] == -1).all() and np.isneginf(rows.logprobs[~rows.target]).all()
    empty = source_rows(table.slice(0, 0), dataclasses.replace(layout, target_mask=None), 5, K, VOCAB)
    assert empty.rows == 0 and empty.ids.shape == (0, K) and empty.offsets.tolist() == [0]
