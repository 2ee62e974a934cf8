"""A student checkpoint whose weights file is damaged (a disk error, a copy cut short): the resume passes over it
for the checkpoint before it and ends with the weights of a run that was never damaged; with none loadable, one
line names the newest and what to delete. `kdflow chat` on it says the same in one line (it raised safetensors'
own SafetensorError)."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from support.runs import final_weights, read_lines, student_path

from kdflow.tasks.student.model import StudentError

COMMON = {"student__steps": 6, "student__save_every": 2}


def _damage(config: Any, checkpoint: str) -> None:
    weights = student_path(config, checkpoint, "model.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(fresh_run, caplog, capsys) -> None:
    from kdflow.commands.validate import validate_run_root
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.model import load_causal_lm
    from kdflow.tasks.student.train import train

    whole = fresh_run(student__name="whole", **COMMON)
    train(open_run_root(whole), training_settings(whole))
    damaged = fresh_run(student__name="damaged", **COMMON)
    assert train(open_run_root(damaged), training_settings(damaged), on_step=lambda r: r["step"] == 4)["stopped"]
    _damage(damaged, "checkpoint-4")
    with pytest.raises(StudentError) as caught:  # what `kdflow chat` on that folder says
        load_causal_lm(str(student_path(damaged, "checkpoint-4")), what="student")
    assert "checkpoint-4' is not a loadable causal LM: " in str(caught.value) and "\n" not in str(caught.value)
    capsys.readouterr()
    assert validate_run_root(damaged.run_root) == 1  # validate looks at students/ too (checkpoints have no hashes)
    said = capsys.readouterr().out
    assert "  PROBLEM students/damaged/checkpoint-4/model.safetensors: cut short: 1,000 bytes" in said, said
    assert "delete students/damaged/checkpoint-4: a resume passes over it" in said and "checkpoint-2/" not in said

    with caplog.at_level(logging.INFO, logger="kdflow.train"):
        resumed = train(open_run_root(damaged), training_settings(damaged))
    assert resumed["start_step"] == 2 and resumed["resumed_from"].endswith("checkpoint-2")
    assert any("checkpoint-4' is not a loadable causal LM" in r.getMessage() and "the checkpoint before it" in
               r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith("train damaged: resuming from ") and r.getMessage().endswith(
        "checkpoint-2 (step 2 of 6)") for r in caplog.records)  # said as the run starts, not only in its summary
    reference = final_weights(whole)
    for name, tensor in final_weights(damaged).items():
        assert torch.equal(tensor, reference[name]), name
    assert [r["step"] for r in read_lines(student_path(damaged, "metrics.jsonl"))] == list(range(1, 7))
    assert validate_run_root(damaged.run_root) == 0, capsys.readouterr().out  # checkpoint-4 saved again, whole
    assert re.search(r"^students/damaged +final \+ 2 checkpoints +ok$", capsys.readouterr().out, re.MULTILINE)


def test_no_loadable_checkpoint_is_one_line_naming_the_newest(fresh_run) -> None:
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    config = fresh_run(student__name="broken", **COMMON)
    assert train(open_run_root(config), training_settings(config), on_step=lambda r: r["step"] == 4)["stopped"]
    for checkpoint in ("checkpoint-2", "checkpoint-4"):
        _damage(config, checkpoint)
    with pytest.raises(StudentError) as caught:
        train(open_run_root(config), training_settings(config))
    message = str(caught.value)
    assert "checkpoint-4' is not a loadable causal LM: " in message and "\n" not in message
    assert message.endswith("nor does any older checkpoint: delete " + str(student_path(config))
                            + "'s checkpoint-* folders to start this student again")


def test_a_damaged_checkpoint_that_no_save_replaces_goes_once_a_newer_one_is_written(fresh_run) -> None:
    """Resumed past a damaged checkpoint-4 with saves at 3 and 6: checkpoint-4 counted among the two kept would
    have outlived the good checkpoint-3 (the rotation deleted the good ones and kept the damaged one)."""
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    damaged = fresh_run(student__name="rotated", **COMMON)
    assert train(open_run_root(damaged), training_settings(damaged), on_step=lambda r: r["step"] == 4)["stopped"]
    _damage(damaged, "checkpoint-4")
    every_third = fresh_run(student__name="rotated", **COMMON | {"student__save_every": 3})
    resumed = train(open_run_root(every_third), training_settings(every_third))
    assert resumed["start_step"] == 2
    kept = sorted(p.name for p in student_path(damaged, "").iterdir() if p.name.startswith("checkpoint-"))
    assert kept == ["checkpoint-3", "checkpoint-6"], kept


def test_a_rerun_writes_a_final_model_cut_short_again(fresh_run, caplog) -> None:
    """A finished student whose final/model.safetensors was cut (a full disk, a killed copy): the rerun said "steps
    already done, nothing to do" and left it; now it writes final/ again from the last checkpoint, the same weights."""
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    config = fresh_run(student__name="cut-final", **COMMON)
    train(open_run_root(config), training_settings(config))
    whole = {name: tensor.clone() for name, tensor in final_weights(config).items()}  # not mapped: cut below
    _damage(config, "final")
    with caplog.at_level(logging.WARNING, logger="kdflow.train"):
        again = train(open_run_root(config), training_settings(config))
    assert again["start_step"] == 6
    assert any("final/model.safetensors: cut short" in r.getMessage() and "writing it again from step 6" in
               r.getMessage() for r in caplog.records), caplog.text
    for name, tensor in final_weights(config).items():
        assert torch.equal(tensor, whole[name]), name


def _edit_config(config: Any, folder: str, **changes: Any) -> None:
    import json

    path = student_path(config, folder, "config.json")
    path.write_text(json.dumps(json.loads(path.read_text()) | changes, indent=2))


@pytest.mark.parametrize("changes", [{"hidden_act": "relu"}, {"num_hidden_layers": 1}])
def test_a_checkpoint_or_final_model_whose_config_was_edited_is_passed_over_and_written_again(
        fresh_run, caplog, capsys, changes) -> None:
    """A hand-edited config.json builds another model around the same weights: one activation silently trained
    another model, fewer layers failed every rerun inside the optimizer's state. The checkpoint's marker records
    its config.json; final/'s must equal the checkpoint's it was written from."""
    from kdflow.commands.validate import validate_run_root
    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    whole = fresh_run(student__name="whole", **COMMON)
    train(open_run_root(whole), training_settings(whole))
    edited = fresh_run(student__name="edited", **COMMON)
    assert train(open_run_root(edited), training_settings(edited), on_step=lambda r: r["step"] == 4)["stopped"]
    _edit_config(edited, "checkpoint-4", **changes)
    with caplog.at_level(logging.WARNING, logger="kdflow.train"):
        resumed = train(open_run_root(edited), training_settings(edited))
    assert resumed["start_step"] == 2, caplog.text
    assert "checkpoint-4/config.json is not the one written with the checkpoint (edited?); resuming from the " \
           "checkpoint before it" in caplog.text
    for name, tensor in final_weights(edited).items():
        assert torch.equal(tensor, final_weights(whole)[name]), name

    _edit_config(edited, "final", **changes)
    capsys.readouterr()
    assert validate_run_root(edited.run_root) == 1
    assert "final/config.json differs from checkpoint-6's, which final/ was written from (edited?); delete " \
           "students/edited/final and rerun train" in capsys.readouterr().out
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kdflow.train"):
        again = train(open_run_root(edited), training_settings(edited))
    assert again["start_step"] == 6 and "writing it again from step 6" in caplog.text
    assert validate_run_root(edited.run_root) == 0, capsys.readouterr().out
