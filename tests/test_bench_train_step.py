"""`kdflow bench train-step` on a tiny run: every variant measured in its own process, the ratio lines, an
option against the fused step, no scratch student left behind; a synthetic top-K batch where the stores hold
another seq_len, and the stage skipped there; a config without its stores or tokenizer fails in one line,
measuring nothing. What it asserts is the shape of the output, never a speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kdflow.schemas.config_io import dump_config


def bench(*args: str) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "kdflow", "bench", "train-step", *args, "--steps", "2", "--warmup", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.usefixtures("children")
def test_bench_measures_plain_fused_and_stage_and_prints_ratios(fresh_run, tmp_path: Path) -> None:  # noqa: F811
    config = fresh_run(student__prune={"layers": 1})  # every variant times the student pruned from the teacher
    path = tmp_path / "bench.yaml"
    path.write_text(dump_config(config))

    lines = bench(str(path), "--batch", "2", "--options", "gradient_checkpointing")
    records = {line["variant"]: line for line in lines if "variant" in line}
    assert set(records) == {"plain", "fused", "stage", "fused+gradient_checkpointing"}, lines
    for record in records.values():
        assert record["batch"] == 2 and record["seq_len"] == 32 and record["tokens_per_step"] == 64, record
        assert record["tok_s"] > 0 and record["peak_total_bytes"] > record["peak_bytes"] > 0, record
        assert len(record["load_avg"]) == 2 and record["topk"] == "stores", record
    assert len({record["params"] for record in records.values()}) == 1, records  # one model in every variant
    assert records["fused+gradient_checkpointing"]["options"]["gradient_checkpointing"] is True
    assert records["fused"]["options"]["gradient_checkpointing"] is False
    ratios = {line["ratio"]: line for line in lines if "ratio" in line}
    assert set(ratios) == {"b/a", "c/b", "fused+gradient_checkpointing/fused"}, lines
    value, faster = ratios["b/a"]["value"], records["fused"]["tok_s"] > records["plain"]["tok_s"]
    assert value > 0 and not (value > 1 and not faster) and not (value < 1 and faster), (ratios, records)  # b over a
    assert ratios["b/a"]["target"] == ratios["c/b"]["target"] == 0.95
    assert not (Path(config.run_root) / "students").exists() or not list((Path(config.run_root) / "students").iterdir())

    # In this process (the CLI path is the one above): stores of seq_len 32 cannot feed a step of 16 tokens.
    from kdflow.bench.train_step_measure import measure as _measure

    short = fresh_run(seq_len=16, student__batch_size=2).model_dump(mode="json")
    fused = _measure({"config": short, "variant": "fused", "label": "fused", "warmup": 1, "steps": 1,
                      "check_float32": True})
    assert fused["seq_len"] == 16 and fused["topk"].startswith("synthetic") and fused["tok_s"] > 0, fused
    check = fused["float32_check"]  # no autocast on the CPU: the step is its own float32 reference
    assert check["ok"] and not check["autocast"] and check["loss_rel_diff"] == check["grad_rel_diff"] == 0.0
    stage = _measure({"config": short, "variant": "stage", "label": "stage", "warmup": 1, "steps": 1})
    assert "tok_s" not in stage and "seq_len" in stage["skipped"], stage


def test_against_float32_compares_the_step_under_autocast_with_the_float32_step() -> None:
    """bf16 autocast (on the CPU here, as on CUDA in the GPU check) moves loss and gradients a little, within
    the tolerances; a step that differs beyond them is reported as not ok. Both start from the same weights
    and leave no gradient behind."""
    import torch

    from kdflow.bench.train_step_measure import FLOAT32_GRAD_RTOL, against_float32

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))
    inputs = torch.randn(256, 64)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    def loss_of(context: Any, shift: float = 0.0) -> torch.Tensor:
        with context:
            loss = torch.log_softmax(model(inputs), dim=-1)[:, 0].mean().neg()
        return loss.float() + (shift if context is autocast else 0.0)

    close = against_float32(model, loss_of, autocast)
    assert close["ok"] and close["autocast"] and 0 < close["grad_rel_diff"] < FLOAT32_GRAD_RTOL, close
    assert 0 < close["loss_rel_diff"] < 1e-2 and close["grad_worst_param_rel_diff"] >= close["grad_rel_diff"] / 4
    assert all(p.grad is None for p in model.parameters())
    far = against_float32(model, lambda context: loss_of(context, shift=0.5), autocast)
    assert not far["ok"] and far["loss_rel_diff"] > 0.1 and far["grad_rel_diff"] == close["grad_rel_diff"]


def test_tensor_peak_counts_the_most_bytes_alive_at_once() -> None:
    import torch

    from kdflow.bench.train_step_measure import _TensorPeak

    kept = torch.ones(1 << 20)  # alive before: not counted
    watch = _TensorPeak(torch.device("cpu"))
    watch.start()
    first = torch.empty(1 << 20)  # 4 MiB
    second = torch.empty(1 << 19)  # 2 MiB while the first is alive: the peak, 6 MiB
    del first, second
    third = torch.empty(1 << 20)  # 4 MiB after both were freed
    del third
    assert watch.stop() == 6 << 20
    assert kept.sum() == 1 << 20


@pytest.mark.parametrize("missing", ["stores", "tokenizer"])
def test_bench_without_its_inputs_fails_in_one_line(make_config: Any, tmp_path: Path, missing: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Before any measurement: a config whose stores were never computed, or whose tokenizer is not there."""
    from kdflow.cli import main

    overrides = {"teacher__model": str(tmp_path / "no-teacher")} if missing == "tokenizer" else {}
    path = tmp_path / "bench.yaml"
    path.write_text(dump_config(make_config(**overrides)))
    assert main(["bench", "train-step", str(path), "--steps", "1", "--warmup", "0"]) != 0
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    expected = "model path does not exist" if missing == "tokenizer" else "the stage variant trains on the config's"
    assert err.startswith("kdflow: error: ") and expected in err, err
