"""The held-out evaluation's full-vocabulary KL to the teacher (eval.jsonl's kl_full, beside kl_stored), against a
dense reference written here: both models' plain forwards over the held-out rows, softmax and KL in float64 numpy.
And the demo's summary, which names each KL for what it is.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from support.runs import read_lines, student_path

from kdflow.tasks.common.tokenizer import load_tokenizer


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def dense_kl(teacher_logits: np.ndarray, student_logits: np.ndarray) -> np.ndarray:
    """(..., V_t), (..., V_s) -> (...,) KL(teacher || student): ids below min(V_t, V_s) one by one, the ids only one
    side has as one bucket per side, written out by hand."""
    log_p, log_q = log_softmax64(teacher_logits), log_softmax64(student_logits)
    p, q = np.exp(log_p), np.exp(log_q)
    common = min(p.shape[-1], q.shape[-1])
    p_rest, q_rest = p[..., common:].sum(axis=-1), q[..., common:].sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        each = np.where(p[..., :common] > 0, p[..., :common] * (log_p[..., :common] - log_q[..., :common]), 0.0)
        rest = np.where(p_rest > 0, p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)
    return each.sum(axis=-1) + rest


@pytest.mark.parametrize(("teacher_vocab", "student_vocab"), [(50, 50), (56, 50), (50, 53)])
def test_full_kl_sum_matches_a_dense_reference(teacher_vocab: int, student_vocab: int) -> None:
    from kdflow.tasks.student.heldout_teacher import full_kl_sum

    generator = torch.Generator().manual_seed(teacher_vocab + student_vocab)
    teacher = torch.randn(7, teacher_vocab, generator=generator) * 4
    student = torch.randn(7, student_vocab, generator=generator) * 2
    teacher[0, 3] = -torch.inf  # an id the teacher never predicts: 0 log 0 counts 0
    got = full_kl_sum(teacher, student)
    want = dense_kl(teacher.numpy(), student.numpy()).sum()
    assert got.dtype == torch.float64 and float(got) == pytest.approx(want, rel=1e-5)
    assert float(full_kl_sum(student, student)) == pytest.approx(0.0, abs=1e-9)  # a model's KL to itself


def _reference(config, teacher_dir: Path) -> tuple[float, float]:
    """(full KL, K+1-bucket KL to the stored top-K) per position over the held-out rows, from plain forwards."""
    from transformers import AutoModelForCausalLM

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.data import open_distill_data

    data = open_distill_data(open_run_root(config), training_settings(config),
                             load_tokenizer(config.teacher, config.tokenizer))
    batch = data.load(data.eval_rows)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    student = AutoModelForCausalLM.from_pretrained(student_path(config, "final")).eval()
    with torch.no_grad():
        teacher_logits = teacher(batch.input_ids).logits.numpy()
        student_logits = student(batch.input_ids).logits.numpy()
    full = float(dense_kl(teacher_logits, student_logits).mean())
    # the stored targets: the top-K as stored (float16), the rest as one bucket of mass 1 - sum p_i
    log_q = log_softmax64(student_logits)
    ids, stored = batch.topk_ids.numpy().astype(np.int64), batch.topk_logprobs.numpy().astype(np.float64)
    p = np.exp(stored)
    q_top = np.take_along_axis(log_q, ids, axis=-1)
    p_rest = np.clip(1 - p.sum(-1), 0, None)
    q_rest = 1 - np.exp(q_top).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where(p_rest > 0, p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)
    return full, float(((p * (stored - q_top)).sum(-1) + rest).mean())


def test_evaluation_reports_the_full_kl_beside_the_stored_one(fresh_run, sharp_teacher_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student import heldout_teacher
    from kdflow.tasks.student.train import train

    loads = []
    real_load = heldout_teacher.load_teacher
    monkeypatch.setattr(heldout_teacher, "load_teacher", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    config = fresh_run(student__steps=4, student__eval_every=2, student__eval_full_kl=True)
    summary = train(open_run_root(config), training_settings(config))
    evals = read_lines(student_path(config, "eval.jsonl"))
    assert [e["step"] for e in evals] == [0, 2, 4] and len(loads) == 1  # the teacher loaded once per run
    after = summary["eval_after"]
    assert after["kl"] == after["kl_stored"] and all("kl_full" in e for e in evals)
    full, stored = _reference(config, sharp_teacher_dir)
    assert after["kl_full"] == pytest.approx(full, rel=1e-4)
    assert after["kl_stored"] == pytest.approx(stored, rel=1e-3)
    # merging the tail into one bucket can only lower the KL: the stored-top-K figure understates the true one
    assert after["kl_full"] > after["kl_stored"] + 1e-3, after
    assert evals[-1]["kl_full"] < evals[0]["kl_full"]  # the student learnt the teacher's distribution


def test_full_kl_off_loads_no_teacher_and_auto_follows_the_teachers_size(fresh_run,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student import heldout_teacher
    from kdflow.tasks.student.train import train

    def refuse(*args, **kwargs):
        raise AssertionError("the teacher was loaded with student.eval_full_kl off")

    config = fresh_run(student__steps=2, student__eval_full_kl=False)
    assert not heldout_teacher.full_kl_wanted(config.student.eval_full_kl, config.teacher)
    monkeypatch.setattr(heldout_teacher, "load_teacher", refuse)
    summary = train(open_run_root(config), training_settings(config))
    assert "kl_full" not in summary["eval_after"] and math.isfinite(summary["eval_after"]["kl_stored"])

    auto = fresh_run()
    assert auto.student.eval_full_kl == "auto"
    assert heldout_teacher.full_kl_wanted(auto.student.eval_full_kl, auto.teacher)  # a tiny local teacher
    size = heldout_teacher.teacher_weight_bytes(auto.teacher)
    assert size is not None and size > 0
    monkeypatch.setattr(heldout_teacher, "EVAL_FULL_KL_AUTO_BYTES", size - 1)
    assert not heldout_teacher.full_kl_wanted(auto.student.eval_full_kl, auto.teacher)  # one byte over the limit: off
    hub = fresh_run(teacher__model="some-org/some-32b-teacher")
    assert heldout_teacher.teacher_weight_bytes(hub.teacher) is None
    assert not heldout_teacher.full_kl_wanted(hub.student.eval_full_kl, hub.teacher)


def test_demo_summary_names_each_kl_for_what_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow import demo_assets
    from kdflow.commands import demo

    config = demo_assets.demo_config(str(tmp_path / "demo"), quick=True)
    assert config.student.eval_full_kl is True
    before = {"kl": 2.5, "kl_stored": 2.5, "kl_full": 3.25, "perplexity": 900.0, "top1_agreement": 0.1,
              "sequences": 16}
    old_record = {"kl": 1.5, "perplexity": 300.0, "top1_agreement": 0.2, "sequences": 16}  # before kl_stored existed
    train = {"eval_before": before, "eval_after": old_record, "steps": 20, "train_rows": 48}
    results = {"precompute": {"store": "/abs/topk/x", "tag": "x"}, "train": train}
    demo.print_summary(str(tmp_path / "demo"), config, results, {}, "sample", 1.0)
    lines = capsys.readouterr().out.splitlines()
    full = next(line for line in lines if "KL to the teacher, full vocabulary" in line)
    stored = next(line for line in lines if f"KL to the stored top-{config.precompute.top_k} + 1 rest bucket" in line)
    assert full.split()[-2:] == ["3.250", "-"] and stored.split()[-2:] == ["2.500", "1.500"]
    assert not [line for line in lines if "KL to the teacher (nats/token)" in line]  # the old, misleading label
    assert any("understates" in line for line in lines)


def test_demo_summary_commands_paste_into_a_shell_whatever_the_run_root(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    from kdflow import demo_assets
    from kdflow.commands import demo

    root = str(tmp_path / "my runs" / "it's here")
    config = demo_assets.demo_config(root, quick=True)
    train = {"eval_before": {}, "eval_after": {}, "steps": 1, "train_rows": 1}
    results = {"precompute": {"store": "/abs/topk/x", "tag": "x"}, "train": train}
    demo.print_summary(root, config, results, {}, "sample", 1.0)
    out = capsys.readouterr().out
    chat = shlex.split(out.split("try: ", 1)[1].splitlines()[0])
    assert chat == ["kdflow", "chat", f"{root}/students/{config.student.name}/final", "--prompt", demo.SAMPLE_PROMPT,
                    "--repetition-penalty", f"{demo.SAMPLE_PENALTY:g}"]
    status = shlex.split(out.split("(kdflow status ", 1)[1].split(";", 1)[0])
    assert status == [root]
    assert f"  top-K store   {root}/topk/x   (K=" in out  # under the run root as given, like the lines around it
    rerun = shlex.split(out.split("to train it further: ", 1)[1].split(")", 1)[0])
    assert rerun[:3] == ["kdflow", "run", f"{root}/{demo.RESOLVED_CONFIG}"]
