"""A student pruned from the teacher (kdflow.tasks.student.prune): it computes exactly what the teacher computes with
the other blocks cut out of its own module list, and block importance finds the block that does nothing."""

from __future__ import annotations

import pytest
import torch
from support.pruning import SHAPES, cut_reference, tiny

from kdflow.schemas.errors import ConfigError
from kdflow.tasks.student.prune import block_importance, choose_blocks, prune_teacher, pruned_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("kept", [(0, 2, 3), (1,), (0, 1, 2, 3, 4)])
def test_a_pruned_student_computes_what_the_kept_blocks_compute(kind: str, kept: tuple[int, ...]) -> None:
    teacher = tiny(kind)
    student = prune_teacher(teacher, kept)
    assert student.config.num_hidden_layers == len(kept) and type(student) is type(teacher)
    input_ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(len(kept)))
    with torch.no_grad():
        got = student(input_ids=input_ids, use_cache=False).logits
        want = cut_reference(teacher, kept)(input_ids=input_ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if kind == "qwen3_moe":
        assert student.config.mlp_only_layers == [new for new, old in enumerate(kept) if old == 1]


def test_the_pruned_config_follows_per_layer_lists() -> None:
    import transformers

    config = transformers.Qwen3MoeConfig(**SHAPES, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2)
    pruned = pruned_config(config, (0, 1, 3))  # sparse blocks are 1 and 3 ((index + 1) % 2 == 0)
    assert pruned.mlp_only_layers == [0] and pruned.decoder_sparse_step == 1 and pruned.num_hidden_layers == 3
    assert config.num_hidden_layers == 5  # the teacher's own config is untouched


def test_a_student_pruned_from_a_quantised_teacher_saves_and_loads_as_plain_weights(tmp_path) -> None:
    """A teacher loaded from a GGUF file (or in 4-bit) carries transformers' quantization_config: carried into the
    student, every load of its folder came back "quantized with gguf" and could not be saved again (resume, init_from
    failed at their first checkpoint)."""
    from transformers import AutoModelForCausalLM

    teacher = tiny("llama")
    teacher.config.quantization_config = {"quant_method": "gguf", "gguf_file": "teacher.gguf", "dequantize": False}
    teacher.config.kdflow_source = {"package": "a-teacher==1.0"}
    teacher.config._name_or_path = "/models/teacher"
    student = prune_teacher(teacher, (0, 2))
    saved = student.config.to_dict()
    assert "quantization_config" not in saved and "kdflow_source" not in saved and not student.config.name_or_path
    assert "quantization_config" in teacher.config.to_dict()  # the teacher's own config is untouched
    student.save_pretrained(tmp_path / "first")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "first")
    assert not getattr(loaded, "is_quantized", False) and getattr(loaded, "hf_quantizer", None) is None
    loaded.save_pretrained(tmp_path / "again")  # raised "The model is quantized with gguf and is not serializable"


@pytest.mark.parametrize("importance", ["cosine", "skip_loss"])
def test_importance_finds_the_block_that_does_nothing(importance: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="kdflow.tasks.student.prune")
    teacher = tiny("llama")
    with torch.no_grad():  # block 3 adds nothing to its input: both residual branches output zeros
        teacher.model.layers[3].self_attn.o_proj.weight.zero_()
        teacher.model.layers[3].mlp.down_proj.weight.zero_()
    input_ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))
    scores = block_importance(teacher, input_ids, importance)
    assert len(scores) == 5
    others = scores[:3] + scores[4:]
    assert scores[3] == pytest.approx(0.0, abs=1e-5) and min(abs(score) for score in others) > 1e-4
    if importance == "cosine":  # (a random model's loss may fall without a block: skip_loss can be negative)
        assert 3 not in choose_blocks(scores, 4)
    assert teacher.config.num_hidden_layers == 5 and len(teacher.model.layers) == 5  # the teacher is left whole
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pruning: skip_loss scored")]
    assert len(said) == (importance == "skip_loss")
    assert not said or said[0].startswith("pruning: skip_loss scored 5 of 5 blocks")


def test_choosing_blocks_keeps_the_best_in_order_and_refuses_bad_counts() -> None:
    assert choose_blocks([0.3, 0.1, 0.5, 0.2], 2) == (0, 2)
    assert choose_blocks([0.1, 0.1, 0.1], 2) == (0, 1)
    with pytest.raises(ValueError, match="keep between 1 and the teacher's 3 blocks, got 4"):
        choose_blocks([0.1, 0.2, 0.3], 4)
    with pytest.raises(ValueError, match="distinct, ascending"):
        prune_teacher(tiny("llama"), (2, 1))


def test_training_a_student_pruned_from_the_teacher(fresh_run, sharp_teacher_dir) -> None:
    """`student.prune`: the student starts as the teacher's most important blocks, nearer the teacher than a random
    student, records what it kept in its saved config, and resumes without measuring again."""
    import json

    from support.runs import student_path

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.preflight import run_preflight
    from kdflow.tasks.student.train import train

    teacher_layers = json.loads((sharp_teacher_dir / "config.json").read_text())["num_hidden_layers"]
    pruned = fresh_run(student__steps=2, student__name="pruned", student__prune={"layers": teacher_layers - 1})
    random = fresh_run(student__steps=2, student__name="random")
    summary = train(open_run_root(pruned), training_settings(pruned))
    baseline = train(open_run_root(random), training_settings(random))
    assert summary["eval_before"]["kl"] < baseline["eval_before"]["kl"]
    saved = json.loads(student_path(pruned, "final", "config.json").read_text())
    assert saved["num_hidden_layers"] == teacher_layers - 1
    assert saved["kdflow_prune"]["teacher_layers"] == teacher_layers and len(saved["kdflow_prune"]["kept"]) == \
        teacher_layers - 1
    assert saved["kdflow_prune"]["teacher"] == sharp_teacher_dir.name  # a saved model travels: no local path
    card = student_path(pruned, "final", "README.md").read_text()
    kept = ", ".join(map(str, saved["kdflow_prune"]["kept"]))
    assert f"initialised from the teacher: blocks {kept} of {teacher_layers}" in card and "random weights" not in card
    hot = fresh_run(student__steps=2, student__name="hot", student__lr=3e-3, student__prune={"layers": 1})
    assert any(w.startswith("student.lr=0.003 with student.prune") for w in run_preflight(hot, ["train"]))
    too_many = fresh_run(student__name="many", student__prune={"layers": teacher_layers + 1})
    with pytest.raises(ConfigError, match=rf"^student.prune.layers={teacher_layers + 1}: the teacher has "
                                          rf"{teacher_layers} blocks to keep from \(read from .*config.json\)$"):
        run_preflight(too_many, ["train"])
    too_wide = fresh_run(student__name="wide", student__prune={"layers": 1, "key_value_heads": 99})
    with pytest.raises(ConfigError, match=r"^student.prune.key_value_heads 99 is more than the teacher's \d+ key/value "
                                          r"heads \(read from .*config.json\)$"):
        run_preflight(too_wide, ["train"])  # before any weight loads, not after
    again = fresh_run(student__steps=3, student__name="pruned", student__prune={"layers": teacher_layers - 1})
    assert train(open_run_root(again), training_settings(again))["start_step"] == 2
