"""Student training on a tiny teacher's top-K: learning, metrics, exact resume, accumulation, data order,
one-line errors for mismatched stores, checkpoints on an object store. (The flow and the real precompute:
test_train_flow.py.)

The top-K stores here are written by the test itself from a dense `log_softmax(logits).topk(k)` of a tiny
teacher, with the schema writers (tests/support/runs.py), so these tests do not depend on the precompute code.
The tiny teacher's lm_head is scaled up so that its distributions are peaked enough to learn from.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.corpus import sample_documents, write_jsonl
from support.runs import DENSE_TAG, final_weights, make_tokens, read_lines, student_path, write_dense_topk

from kdflow.schemas.commits import read_commit, stage_dir, write_commit
from kdflow.schemas.errors import FingerprintMismatch, KDFlowError, StoreError
from kdflow.schemas.shards import read_token_shard, read_topk_shard
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.common.tokenizer import load_tokenizer


def assert_one_line(error: BaseException, *phrases: str) -> None:
    message = str(error)
    assert "\n" not in message and message, message
    for phrase in phrases:
        assert phrase in message, message


# --- training ---------------------------------------------------------------------------------------------


def test_training_reduces_heldout_kl_logs_every_step_and_keeps_two_checkpoints(fresh_run) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    config = fresh_run(student__steps=16, student__save_every=3, student__eval_every=8, student__kd__kd_weight=0.8)
    summary = train(open_run_root(config), training_settings(config))

    before, after = summary["eval_before"], summary["eval_after"]
    assert before["step"] == 0 and after["step"] == 16
    assert after["kl"] < 0.9 * before["kl"], (before, after)
    assert after["top1_agreement"] > before["top1_agreement"]
    assert math.isclose(after["perplexity"], math.exp(after["ce"]), rel_tol=1e-9)

    metrics = read_lines(student_path(config, "metrics.jsonl"))
    assert [r["step"] for r in metrics] == list(range(1, 17))
    for record in metrics:
        for key in ("loss", "kd", "ce", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed"):
            assert math.isfinite(record[key]), (key, record)
        assert record["tokens"] == 4 * 32
        assert record["loss"] == pytest.approx(0.8 * record["kd"] + 0.2 * record["ce"], rel=1e-5)
    lrs = [r["lr"] for r in metrics]
    assert lrs[0] == pytest.approx(5e-3) and lrs[1] == pytest.approx(1e-2)  # warmup over 2 steps
    assert lrs[-1] == pytest.approx(1e-3) and lrs[1:] == sorted(lrs[1:], reverse=True)  # cosine down to 0.1 lr
    assert [r["step"] for r in read_lines(student_path(config, "eval.jsonl"))] == [0, 8, 16]

    # save_every 3 -> checkpoints 3, 6, 9, 12, 15 and 16 at the end; the newest two are kept
    assert sorted(p.name for p in student_path(config).glob("checkpoint-*")) == ["checkpoint-15", "checkpoint-16"]
    assert not [p for p in student_path(config).iterdir() if p.name.startswith(".")]
    assert torch.equal(final_weights(config)["model.norm.weight"],
                       load_file(student_path(config, "checkpoint-16", "model.safetensors"))["model.norm.weight"])

    files = {p: p.stat().st_mtime_ns for p in student_path(config).rglob("*")}
    # a rerun of a finished run trains nothing and touches no file
    again = train(open_run_root(config), training_settings(config))
    assert again["start_step"] == again["steps"] == 16 and again["tokens"] == 0
    assert again["eval_after"] == after and again["final_loss"] == summary["final_loss"]
    assert {p: p.stat().st_mtime_ns for p in student_path(config).rglob("*")} == files


def test_interrupted_and_resumed_runs_end_with_the_same_weights(fresh_run) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    def stop_at(step: int, *, crash: bool) -> Callable[[dict[str, Any]], bool]:
        def on_step(record: dict[str, Any]) -> bool:
            if record["step"] == step and crash:
                raise RuntimeError("simulated crash")
            return record["step"] == step
        return on_step

    common = {"student__steps": 7, "student__save_every": 2, "student__grad_accum": 2}
    whole = fresh_run(student__name="whole", **common)
    train(open_run_root(whole), training_settings(whole))

    crashed = fresh_run(student__name="crashed", **common)
    with pytest.raises(RuntimeError, match="simulated crash"):
        # after step 5: the newest checkpoint is step 4
        train(open_run_root(crashed), training_settings(crashed), on_step=stop_at(5, crash=True))
    resumed = train(open_run_root(crashed), training_settings(crashed))
    assert resumed["start_step"] == 4 and resumed["resumed_from"].endswith("checkpoint-4")

    stopped = fresh_run(student__name="stopped", **common)
    first = train(open_run_root(stopped), training_settings(stopped), on_step=stop_at(3, crash=False))
    assert first["stopped"] and first["steps"] == 3 and student_path(stopped, "checkpoint-3",
                                                                     "checkpoint.json").exists()
    assert train(open_run_root(stopped), training_settings(stopped))["start_step"] == 3

    reference = final_weights(whole)
    for run in (crashed, stopped):
        weights = final_weights(run)
        assert weights.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(weights[name], tensor), name
        whole_metrics = read_lines(student_path(whole, "metrics.jsonl"))
        run_metrics = read_lines(student_path(run, "metrics.jsonl"))
        assert [r["step"] for r in run_metrics] == list(range(1, 8))
        assert [r["loss"] for r in run_metrics] == [r["loss"] for r in whole_metrics]


def test_more_steps_on_a_resume_follow_the_longer_schedule_from_the_first_step_resumed(fresh_run) -> None:
    """`student.steps` is not part of the checkpoint's fingerprint: a finished student trains on when it is raised.
    The first step resumed ran at the rate the old schedule last applied (its minimum), then jumped to the new one."""
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.schemas.config_io import dump_config
    from kdflow.tasks.student.steps import lr_factor
    from kdflow.tasks.student.train import train

    common = {"student__name": "longer", "student__save_every": 3, "student__warmup_steps": 1, "student__lr": 1e-3}
    train(open_run_root(short := fresh_run(student__steps=3, **common)), training_settings(short))
    longer = fresh_run(student__steps=6, **common)
    assert train(open_run_root(longer), training_settings(longer))["start_step"] == 3
    rates = [record["lr"] for record in read_lines(student_path(longer, "metrics.jsonl"))]
    want = [1e-3 * lr_factor(step, short.student) for step in range(3)]
    want += [1e-3 * lr_factor(step, longer.student) for step in range(3, 6)]
    assert rates == pytest.approx(want, rel=1e-6)
    fewer = fresh_run(student__steps=4, **common)  # nothing to train: the config beside the student stays
    assert train(open_run_root(fewer), training_settings(fewer))["start_step"] == 6
    assert (student_path(longer, "config.yaml")).read_text() == dump_config(longer)


def test_gradient_accumulation_equals_one_big_batch(fresh_run) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    # lr 1e-3: Adam divides by |g| + 1e-8, so where a gradient is ~1e-8 its rounding shows in the step;
    # loss and gradient norm per step show any normalisation error directly (Adam alone would hide a scale).
    common = {"student__steps": 3, "student__lr": 1e-3}
    one_batch = fresh_run(student__name="one", student__grad_accum=1, **common)
    accumulated = fresh_run(student__name="accumulated", student__grad_accum=2, **common)
    train(open_run_root(one_batch), training_settings(one_batch))
    train(open_run_root(accumulated), training_settings(accumulated))
    for key in ("loss", "kd", "ce", "grad_norm"):
        expected = [r[key] for r in read_lines(student_path(one_batch, "metrics.jsonl"))]
        assert ([r[key] for r in read_lines(student_path(accumulated, "metrics.jsonl"))]
                == pytest.approx(expected, rel=1e-5))
    reference = final_weights(one_batch)
    for name, tensor in final_weights(accumulated).items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0)


def test_a_checkpoint_of_other_settings_is_not_resumed(fresh_run) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    first, other = fresh_run(student__steps=2), fresh_run(student__steps=4, student__lr=5e-3)
    train(open_run_root(first), training_settings(first))
    with pytest.raises(StoreError) as caught:
        train(open_run_root(other), training_settings(other))
    assert_one_line(caught.value, "trained with other data or settings", "student.name")


# --- data order and pairing -------------------------------------------------------------------------------


def test_order_covers_every_training_row_once_per_epoch_and_ranks_split_batches(fresh_run) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.data import epoch_permutation, open_distill_data

    config = fresh_run(student__eval_shards=2, student__eval_sequences=10)
    data = open_distill_data(open_run_root(config), training_settings(config),
                             load_tokenizer(config.teacher, config.tokenizer))
    pairs = data.stores.pairs
    rows = data.train_rows
    assert (rows == sum(p.rows for p in pairs[:-2])
            and [p.shard_id for p in data.eval_pairs] == [len(pairs) - 2, len(pairs) - 1])
    assert [(pair.shard_id, row) for pair, row in data.eval_rows] == [(pair.shard_id, r) for pair in data.eval_pairs
                                                                       for r in range(pair.rows)][:10]

    batch = 6  # does not divide the row count: batches straddle the epoch boundary
    epochs = 2
    seen = np.concatenate([data.global_batch(p, batch)
                           for p in range(0, epochs * rows + batch, batch)])[: epochs * rows]
    for epoch in range(epochs):
        order = seen[epoch * rows:(epoch + 1) * rows]
        assert sorted(order.tolist()) == list(range(rows))
        assert np.array_equal(order, epoch_permutation(rows, config.student.seed, epoch))
    assert not np.array_equal(seen[:rows], seen[rows:])
    assert not np.array_equal(epoch_permutation(rows, 0, 0), epoch_permutation(rows, 1, 0))

    for position in (0, 6, rows - 2, 3 * rows + 1):
        whole = data.rank_rows(position, batch, 0, 1)
        halves = [data.rank_rows(position, batch, r, 2) for r in range(2)]
        assert sorted(np.concatenate(halves).tolist()) == sorted(whole.tolist())
        assert np.array_equal(halves[0], whole[0::2]) and np.array_equal(halves[1], whole[1::2])

    run_root = RunRoot(config.run_root)
    some = np.array([0, rows - 1, 17])
    loaded = data.train_batch(some)
    for i, (pair, row) in enumerate(data.locate(some)):
        assert np.array_equal(loaded.input_ids[i].numpy(), read_token_shard(run_root, pair.token_path)[row])
        ids, logprobs = read_topk_shard(run_root, pair.topk_path)
        assert np.array_equal(loaded.topk_ids[i].numpy(), ids[row])
        assert np.array_equal(loaded.topk_logprobs[i].numpy(), logprobs[row])


# --- one-line errors --------------------------------------------------------------------------------------


def test_topk_made_from_another_token_store_is_an_error(fresh_run, tmp_path: Path) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.data import open_stores

    config = fresh_run()
    run_root = RunRoot(config.run_root)
    store = stage_dir(run_root, "topk", DENSE_TAG)
    record = read_commit(run_root, store, "topk", 3)
    write_commit(run_root, store, record.model_copy(update={"input_sha256": "0" * 64}))  # shard 3 names another input
    with pytest.raises(StoreError) as caught:
        open_stores(open_run_root(config), training_settings(config), load_tokenizer(config.teacher, config.tokenizer))
    assert_one_line(caught.value, "shard-00003", "made from another token shard")

    # Another corpus: tokenise rewrites tokens/ and the top-K store is stale. (A corpus that only grew or
    # shrank at its end would keep shards whose top-K is still right: those shards pass the checks.)
    reordered = write_jsonl(tmp_path / "reordered.jsonl", sample_documents(60)[::-1])
    other = fresh_run(dataset__path=str(reordered))
    make_tokens(other)
    with pytest.raises(StoreError) as caught:
        open_stores(open_run_root(other), training_settings(other), load_tokenizer(other.teacher, other.tokenizer))
    assert_one_line(caught.value, "no top-K store", "made for another teacher, K or token store", "run precompute")
    assert ": K=" not in str(caught.value)  # the same K: nothing said of it
    fewer = fresh_run(dataset__path=str(reordered), precompute__top_k=4)  # another K too: the store's is named
    with pytest.raises(StoreError) as caught:
        open_stores(open_run_root(fewer), training_settings(fewer), load_tokenizer(fewer.teacher, fewer.tokenizer))
    assert_one_line(caught.value, "made for this teacher, K=4 and token store", ": K=8, made for another teacher")


@pytest.mark.parametrize("what", ["top_k", "seq_len"])
def test_topk_store_with_other_k_or_seq_len_is_an_error(fresh_run, sharp_teacher_dir: Path, what: str) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.data import open_stores

    config = fresh_run()
    shutil.rmtree(stage_dir(RunRoot(config.run_root), "topk", DENSE_TAG))
    write_dense_topk(config, sharp_teacher_dir, tag="other", **{what: 4 if what == "top_k" else 16})
    with pytest.raises(StoreError) as caught:
        open_stores(open_run_root(config), training_settings(config), load_tokenizer(config.teacher, config.tokenizer))
    assert_one_line(caught.value,
                    "K=4, precompute.top_k is 8" if what == "top_k" else "seq_len 16, the token store's is 32")


def test_tokenizer_other_than_the_token_stores_is_an_error(fresh_run, tmp_path: Path, sharp_teacher_dir: Path) -> None:
    from transformers import AutoTokenizer

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    tokenizer = AutoTokenizer.from_pretrained(sharp_teacher_dir)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(tmp_path / "other-tokenizer")
    foreign = fresh_run(tokenizer=str(tmp_path / "other-tokenizer"))
    with pytest.raises(FingerprintMismatch) as caught:
        train(open_run_root(foreign), training_settings(foreign))
    assert_one_line(caught.value, "tokenizer", "fingerprint")


def test_init_from_that_is_not_a_model_is_an_error(fresh_run, tmp_path: Path) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    (tmp_path / "empty").mkdir()
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    for folder, phrase in (("empty", "no config.json"), ("config-only", "no model weights"),
                           ("missing", "no such folder"), ("config.json", "a file, not a model folder")):
        config = fresh_run(student__init_from=str(tmp_path / folder))
        with pytest.raises(KDFlowError) as caught:
            train(open_run_root(config), training_settings(config))
        assert_one_line(caught.value, "student.init_from", "is not a model", phrase)


def test_init_from_a_saved_student_continues_from_its_weights(fresh_run) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    first = fresh_run(student__name="first", student__steps=2)
    train(open_run_root(first), training_settings(first))
    second = fresh_run(student__name="second", student__steps=1, student__lr=1e-9, student__warmup_steps=0,
                       student__init_from=str(student_path(first, "final")))
    summary = train(open_run_root(second), training_settings(second))
    again = train(open_run_root(first), training_settings(first))
    assert summary["eval_before"]["kl"] == pytest.approx(again["eval_after"]["kl"], rel=1e-6)


# --- checkpoints on an object store -----------------------------------------------------------------------


def test_checkpoints_on_an_object_store_roundtrip_and_half_written_ones_are_ignored(fresh_run) -> None:
    import fsspec

    from kdflow.tasks.student.checkpoint import (TrainingState, latest_checkpoint, load_checkpoint_model,
                                                 load_training_state, prune_checkpoints, save_checkpoint)
    from kdflow.tasks.student.model import build_student
    from kdflow.tasks.student.steps import build_optimizer

    config = fresh_run()
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    model = build_student(config.student, config.seq_len, tokenizer)
    optimizer, scheduler = build_optimizer(model, config.student)
    model(torch.arange(8)[None]).logits.sum().backward()
    optimizer.step()
    scheduler.step()

    run_root = RunRoot("memory://kdflow-test-checkpoints")
    student_dir = run_root.path("students", "s")
    state = TrainingState(step=5, position=20, elapsed_s=1.5, fingerprint="abc")
    save_checkpoint(run_root, student_dir, model, tokenizer, optimizer, scheduler, state)
    half = f"{student_dir}/checkpoint-9"  # an upload that stopped before its marker
    run_root.fs.pipe(f"{half}/config.json", b"{}")
    assert latest_checkpoint(run_root, student_dir).state == state

    loaded = load_checkpoint_model(run_root, latest_checkpoint(run_root, student_dir).path, "cpu")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    fresh_optimizer, fresh_scheduler = build_optimizer(loaded, config.student)
    assert load_training_state(run_root, latest_checkpoint(run_root, student_dir), fresh_optimizer,
                               fresh_scheduler) == state
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    restored, saved = (list(o.state_dict()["state"].values()) for o in (fresh_optimizer, optimizer))
    assert len(restored) == len(saved)
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(restored, saved, strict=True))

    assert prune_checkpoints(run_root, student_dir, keep=2) == [half]
    assert not run_root.exists(half)
    fsspec.filesystem("memory").rm("/kdflow-test-checkpoints", recursive=True)
