"""Running out of the GPU's memory. The teacher pass: a store's shards that stepped down after an out-of-memory make
a later pass on the same kind of device start there; another device, or another configured micro-batch, starts from
the config (the flow's halving itself: tests/test_precompute_flow.py). Training: a step goes again in smaller pieces."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from support.runs import final_weights, prepare, read_lines, student_path

from kdflow.schemas.commits import list_commits, stage_dir
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.teacher.micro_batch import device_label, start_micro_batch, stepped_down
from kdflow.tasks.teacher.precompute import precompute_shards


def test_a_later_pass_starts_where_an_out_of_memory_stepped_down_on_this_device(make_config, caplog) -> None:
    config = prepare(make_config(dataset__max_documents=24, precompute__micro_batch=4))
    first = precompute_shards(open_run_root(config), teacher_pass_settings(config), [0], micro_batch=2)
    assert (first["micro_batch"], first["micro_batch_configured"]) == (2, 4)  # the flow's retry after 4 ran out
    with caplog.at_level(logging.WARNING, "kdflow.precompute"):
        later = precompute_shards(open_run_root(config), teacher_pass_settings(config), [1])
    assert (later["micro_batch"], later["micro_batch_configured"]) == (2, 4)
    assert "micro-batch 2, as shard 0 of this store ran on this device (cpu) after 4 ran out of its memory" \
        in caplog.text
    changed = config.model_copy(update={"precompute": config.precompute.model_copy(update={"micro_batch": 3})})
    other = precompute_shards(open_run_root(changed), teacher_pass_settings(changed), [2])
    assert (other["micro_batch"], other["micro_batch_configured"]) == (3, 3) and other["tag"] == first["tag"]

    run_root = RunRoot(config.run_root)
    records = list_commits(run_root, stage_dir(run_root, "topk", first["tag"]), "topk", first["tag"])
    facts = {i: (r.extra.micro_batch, r.extra.micro_batch_configured, r.extra.device) for i, r in records.items()}
    assert facts == {0: (2, 4, "cpu"), 1: (2, 4, "cpu"), 2: (3, 3, "cpu")}
    assert device_label(torch.device("cpu")) == "cpu"
    from kdflow.tasks.run_status import status_lines  # what `kdflow status` says under the store's line

    lines = list(status_lines(run_root))
    store_line = next(i for i, line in enumerate(lines) if line.startswith(f"topk/{first['tag']}"))
    assert lines[store_line + 1] == "  micro-batch 2 on cpu: the config's 4 ran out of memory there; later runs " \
                                    "there start at 2"
    assert sum(line.startswith("  micro-batch") for line in lines) == 1  # shard 2's config of 3 ran at 3

    # What fits on one GPU says nothing about another; the newest step-down on this one is where to start.
    gpu = "NVIDIA GeForce RTX 3090, 23.6 GiB"
    elsewhere = [r.model_copy(update={"extra": r.extra.model_copy(update={"device": gpu})}) for r in records.values()]
    assert start_micro_batch(elsewhere, "cpu", 4) == (4, None) and start_micro_batch(elsewhere, gpu, 3) == (3, None)
    newer = elsewhere[0].model_copy(update={"created_at": elsewhere[1].created_at + 1,
                                            "extra": elsewhere[0].extra.model_copy(update={"micro_batch": 1})})
    assert stepped_down([*elsewhere, newer], gpu, 4) is newer and start_micro_batch([newer], gpu, 4) == (1, newer)
    assert start_micro_batch([newer], gpu, 4, given=2) == (2, None)  # the flow's, halved from what ran, wins


@pytest.mark.parametrize("given", ["0", "-2"])
def test_the_worker_refuses_a_micro_batch_below_one(make_config, tmp_path, given: str, capsys) -> None:
    from kdflow.schemas.config_io import dump_config
    from kdflow.schemas.protocol import EXIT_USER_ERROR
    from kdflow.tasks.teacher.precompute_worker import run

    path = tmp_path / "config.yaml"
    path.write_text(dump_config(make_config()), encoding="utf-8")
    assert run(["--config", str(path), "--micro-batch", given]) == EXIT_USER_ERROR
    assert f"--micro-batch {given}: a micro-batch holds at least 1 sequence" in capsys.readouterr().out


def test_out_of_memory_in_a_step_computes_its_micro_batches_in_pieces_and_trains_alike(fresh_run, monkeypatch,
                                                                                      caplog) -> None:
    """A CUDA out-of-memory in a step of a one-process run: the step again with each micro-batch in twice as many
    pieces, as often as it recurs, to a row a piece; the same steps as an uninterrupted run. At a row a piece
    the error stands."""
    from kdflow.schemas.stage_settings import training_settings
    from kdflow.tasks.student.train import train

    common = {"student__steps": 3, "student__lr": 1e-3, "student__batch_size": 8, "student__grad_accum": 2}
    whole = fresh_run(student__name="whole", **common)
    assert train(open_run_root(whole), training_settings(whole))["micro_batch_parts"] == 1
    pieces = fresh_run(student__name="pieces", **common)
    # step 2's second micro-batch of 4 rows runs out, then its last piece of 2: earlier pieces' gradients were in
    monkeypatch.setenv("KDFLOW_FAULT", "cuda_oom@stage=train,step=2,micro_batch=1,micro_batch_size=4;"
                                       "cuda_oom@stage=train,step=2,micro_batch=3,micro_batch_size=2")
    with caplog.at_level(logging.WARNING, "kdflow.train"):
        summary = train(open_run_root(pieces), training_settings(pieces))
    assert summary["micro_batch_parts"] == 4 and summary["steps"] == 3
    assert "training step 2: out of the GPU's memory at 4 rows a micro-batch; the run goes on with each " \
           "micro-batch in 2 pieces of at most 2 rows (the same steps; student.grad_accum: 4 starts a run there)" \
        in caplog.text
    assert "in 4 pieces of at most 1 rows (the same steps; student.grad_accum: 8" in caplog.text
    for key in ("loss", "kd", "ce", "grad_norm"):
        expected = [r[key] for r in read_lines(student_path(whole, "metrics.jsonl"))]
        assert [r[key] for r in read_lines(student_path(pieces, "metrics.jsonl"))] == pytest.approx(expected, rel=1e-5)
    evals = [r["kl"] for r in read_lines(student_path(whole, "eval.jsonl"))]  # the last one in pieces of a row
    assert len(evals) >= 2 and [r["kl"] for r in read_lines(student_path(pieces, "eval.jsonl"))] == pytest.approx(
        evals, rel=1e-5)
    reference = final_weights(whole)
    for name, tensor in final_weights(pieces).items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0)

    # The evaluation before the first step runs out of memory: it goes again in pieces, and so do the steps.
    monkeypatch.setenv("KDFLOW_FAULT", "cuda_oom@at=eval,stage=train,step=0,micro_batch_size=4")
    evaluated = fresh_run(student__name="evaluated", **common)
    with caplog.at_level(logging.WARNING, "kdflow.train"):
        assert train(open_run_root(evaluated), training_settings(evaluated))["micro_batch_parts"] == 2
    assert "the evaluation at step 0: out of the GPU's memory at 4 rows a micro-batch; the run goes on with each " \
           "micro-batch in 2 pieces" in caplog.text
    assert [r["kl"] for r in read_lines(student_path(evaluated, "eval.jsonl"))] == pytest.approx(evals, rel=1e-5)
    assert [r["loss"] for r in read_lines(student_path(evaluated, "metrics.jsonl"))] == pytest.approx(
        [r["loss"] for r in read_lines(student_path(whole, "metrics.jsonl"))], rel=1e-5)

    single = fresh_run(student__name="single", **common | {"student__grad_accum": 8})
    monkeypatch.setenv("KDFLOW_FAULT", "cuda_oom@stage=train,micro_batch_size=1,step=1")
    with pytest.raises(RuntimeError, match="CUDA out of memory"):  # a row a piece already: nothing smaller
        train(open_run_root(single), training_settings(single))


def test_out_of_memory_in_the_optimisers_update_ends_the_run(fresh_run, monkeypatch) -> None:
    """An update that ran out of memory may be half applied and cannot be taken back: no step goes again then."""
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    calls = []

    def update(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(torch.optim.AdamW, "step", update)
    config = fresh_run(student__name="update", student__steps=2, student__batch_size=8)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        train(open_run_root(config), training_settings(config))
    assert len(calls) == 1  # the step was not computed again in pieces and updated twice
