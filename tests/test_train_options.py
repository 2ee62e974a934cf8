"""The student options that change how it computes, not what: gradient checkpointing, torch.compile and the
attention kernel. Each trains to the same losses and weights as the default (float tolerance), a run with it
stopped and resumed ends bit for bit like an uninterrupted one, switching it keeps the training fingerprint,
and an attention kernel this machine cannot run is a one-line error.

Tolerances, measured on this tiny student (7 AdamW steps at lr 1e-2): gradient checkpointing recomputes the
same operations and agreed exactly; eager attention and compiled layers sum in another order: losses within
5.5e-8 relative, weights within 2.5e-6 (eager) and 1.2e-5 (compiled) absolute. The bounds leave ~4x room.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.runs import final_weights, read_lines, student_path

from kdflow.schemas.errors import ConfigError

COMMON = {"student__steps": 7, "student__save_every": 2, "student__grad_accum": 2}
OPTIONS = {"gradient_checkpointing": {"student__gradient_checkpointing": True},
           "compile": {"student__compile": True},
           "eager_attention": {"student__attn_implementation": "eager"},
           "checkpointing_and_compile": {"student__gradient_checkpointing": True, "student__compile": True}}


def stop_at(step: int) -> Callable[[dict[str, Any]], bool]:
    return lambda record: record["step"] == step


@pytest.fixture(scope="module")
def default_run(prepared_run, sharp_teacher_dir, tmp_path_factory) -> dict[str, Any]:
    """The run every option is compared with: no option set."""
    import shutil

    from support.runs import run_config

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    run_root, corpus = prepared_run
    copy = tmp_path_factory.mktemp("default") / "run"
    shutil.copytree(run_root, copy)
    config = run_config(copy, sharp_teacher_dir, corpus, **COMMON)
    train(open_run_root(config), training_settings(config))
    return {"metrics": read_lines(student_path(config, "metrics.jsonl")),
            "evals": read_lines(student_path(config, "eval.jsonl")), "weights": final_weights(config)}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_trains_like_the_default_and_resumes_exactly(fresh_run, default_run, option: str) -> None:  # noqa: F811
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    settings = COMMON | OPTIONS[option]
    whole = fresh_run(student__name="whole", **settings)
    train(open_run_root(whole), training_settings(whole))
    metrics = read_lines(student_path(whole, "metrics.jsonl"))
    for key in ("loss", "kd", "ce", "grad_norm"):
        expected = [r[key] for r in default_run["metrics"]]
        assert [r[key] for r in metrics] == pytest.approx(expected, rel=1e-5, abs=1e-8), key
    evals = read_lines(student_path(whole, "eval.jsonl"))
    assert [r["kl"] for r in evals] == pytest.approx([r["kl"] for r in default_run["evals"]], rel=1e-5)
    weights = final_weights(whole)
    for name, tensor in default_run["weights"].items():
        torch.testing.assert_close(weights[name], tensor, atol=5e-5, rtol=0, msg=name)

    stopped = fresh_run(student__name="stopped", **settings)
    assert train(open_run_root(stopped), training_settings(stopped), on_step=stop_at(3))["steps"] == 3
    resumed = train(open_run_root(stopped), training_settings(stopped))
    assert resumed["start_step"] == 3 and resumed["resumed_from"].endswith("checkpoint-3")
    assert [r["loss"] for r in read_lines(student_path(stopped, "metrics.jsonl"))] == [r["loss"] for r in metrics]
    for name, tensor in weights.items():
        assert torch.equal(final_weights(stopped)[name], tensor), name


def test_switching_an_option_keeps_the_fingerprint_so_a_run_resumes_with_it(fresh_run) -> None:  # noqa: F811
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.data import open_stores
    from kdflow.tasks.student.steps import training_fingerprint
    from kdflow.tasks.student.train import train

    plain = fresh_run(**COMMON)
    stores = open_stores(open_run_root(plain), training_settings(plain), load_tokenizer(plain.teacher, plain.tokenizer))
    for settings in OPTIONS.values():
        other = fresh_run(**COMMON, **settings).student
        assert training_fingerprint(other, stores) == training_fingerprint(plain.student, stores)
    assert train(open_run_root(plain), training_settings(plain), on_step=stop_at(2))["steps"] == 2
    changed = fresh_run(**COMMON, student__gradient_checkpointing=True, student__attn_implementation="eager")
    resumed = train(open_run_root(changed), training_settings(changed))
    assert resumed["start_step"] == 2 and resumed["steps"] == 7


def test_flash_attention_that_cannot_run_here_is_a_one_line_error(fresh_run) -> None:  # noqa: F811
    import importlib.util

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    config = fresh_run(student__attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError) as caught:
        train(open_run_root(config), training_settings(config))
    message = str(caught.value)
    assert "\n" not in message and "student.attn_implementation=flash_attention_2" in message, message
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash-attn package, which is not installed" in message, message
    else:
        assert "CUDA device" in message, message  # this suite trains on the CPU


def test_option_fields_have_defaults_and_reject_unknown_kernels(fresh_run) -> None:  # noqa: F811
    config = fresh_run()
    assert (config.student.gradient_checkpointing, config.student.compile, config.student.attn_implementation) == \
        (False, False, "sdpa")
    for name in ("gradient_checkpointing", "compile", "attn_implementation"):
        assert type(config.student).model_fields[name].description
    with pytest.raises(ConfigError) as caught:
        fresh_run(student__attn_implementation="flash")
    assert "student.attn_implementation" in str(caught.value) and "\n" not in str(caught.value)


def test_a_gathered_state_saved_as_checkpoint_and_final_has_weights_in_both(fresh_run, tmp_path) -> None:  # noqa: F811
    """FSDP hands one gathered state dict to the checkpoint and then to final/; transformers' save_pretrained
    pops what it writes from the dict it is given (for a student built from a config), so final/ of a 2-rank
    run that was never resumed had no weights. Found by the FSDP gradient-checkpointing test."""
    from safetensors.torch import load_file

    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.student.checkpoint import TrainingState, save_checkpoint, save_final
    from kdflow.tasks.student.model import build_student
    from kdflow.tasks.student.steps import build_optimizer

    config = fresh_run()
    tokenizer = load_tokenizer(config.teacher, config.tokenizer)
    model = build_student(config.student, config.seq_len, tokenizer)
    optimizer, scheduler = build_optimizer(model, config.student)
    gathered = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    run_root, student_dir = RunRoot(str(tmp_path / "run")), str(tmp_path / "run" / "students" / "s")
    checkpoint = save_checkpoint(run_root, student_dir, model, tokenizer, optimizer, scheduler,
                                 TrainingState(1, 4, 0.1, "f"), model_state=gathered)
    final = save_final(run_root, student_dir, model, tokenizer, model_state=gathered)
    for folder in (checkpoint, final):
        saved = load_file(f"{folder}/model.safetensors")
        assert torch.equal(saved["model.norm.weight"], gathered["model.norm.weight"]), folder
