"""The micro-batch a teacher pass starts at: a store's shards that stepped down after an out-of-memory make a later
pass on the same kind of device start there; another device, or another configured micro-batch, starts from the
config (the flow's halving itself: tests/test_precompute_flow.py)."""

from __future__ import annotations

import logging

import pytest
from support.runs import prepare

from kdflow.schemas.commits import list_commits, stage_dir
from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
from kdflow.schemas.storage import RunRoot
from kdflow.tasks.teacher.micro_batch import device_label, start_micro_batch, stepped_down
from kdflow.tasks.teacher.precompute import precompute_shards


def test_a_later_pass_starts_where_an_out_of_memory_stepped_down_on_this_device(make_config, caplog) -> None:
    import torch

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
