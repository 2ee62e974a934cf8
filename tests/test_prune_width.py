"""Width pruning (kdflow.tasks.student.prune_width): a narrowed student computes exactly what the teacher computes with
the dropped MLP channels and attention heads zeroed by hooks on the teacher itself, alone and after depth pruning;
importance finds the channel and the head group that do nothing; bad widths are one-line errors."""

from __future__ import annotations

import copy

import pytest
import torch
from support.pruning import SHAPES, cut_reference, tiny
from torch import nn

from kdflow.schemas.config import StudentConfig
from kdflow.schemas.fingerprints import student_resume_fields
from kdflow.tasks.student.prune import prune_teacher, width_entry, width_summary
from kdflow.tasks.student.prune_width import WidthPlan, check_width, width_importance, width_pruned

pytestmark = pytest.mark.unit


def zeroed_reference(teacher: nn.Module, plan: WidthPlan) -> nn.Module:
    """A copy of the teacher whose dropped channels and heads contribute nothing: a pre-hook on each dense
    down_proj and o_proj zeroes their inputs' dropped slices; fused experts, which have no down_proj module, get
    their dropped channels' down_proj columns zeroed instead."""
    reference = copy.deepcopy(teacher)
    heads, kv_heads = teacher.config.num_attention_heads, teacher.config.num_key_value_heads
    head_dim = reference.model.layers[0].self_attn.head_dim

    def zero_all_but(keep: list[int], width: int, unit: int = 1):
        mask = torch.zeros(width * unit)
        for index in keep:
            mask[index * unit:(index + 1) * unit] = 1.0
        return lambda module, args: (args[0] * mask,)

    for block, layer in enumerate(reference.model.layers):
        if plan.channels is not None:
            kept = plan.channels[block]
            if hasattr(layer.mlp, "experts"):
                with torch.no_grad():
                    for expert, channels in enumerate(kept):
                        dropped = [c for c in range(layer.mlp.experts.down_proj.shape[2]) if c not in channels]
                        layer.mlp.experts.down_proj[expert][:, dropped] = 0.0
            else:
                layer.mlp.down_proj.register_forward_pre_hook(zero_all_but(list(kept[0]),
                                                                           layer.mlp.down_proj.in_features))
        if plan.groups is not None:
            per_group = heads // kv_heads
            query_heads = [group * per_group + offset for group in plan.groups[block] for offset in range(per_group)]
            layer.self_attn.o_proj.register_forward_pre_hook(zero_all_but(query_heads, heads, head_dim))
    return reference


def calibration(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(seed))


def logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize(("narrower", "key_value_heads"), [(True, None), (False, 1), (True, 1)])
def test_a_narrowed_student_computes_what_the_teacher_computes_with_the_rest_zeroed(
        kind: str, narrower: bool, key_value_heads: int | None) -> None:
    teacher = tiny(kind)
    intermediate_size = (5 if kind == "llama" else 8) if narrower else None  # experts: multiples of 8
    student, plan = width_pruned(teacher, calibration(1), intermediate_size, key_value_heads)
    config = student.config
    head_dim = teacher.model.layers[0].self_attn.head_dim  # (Qwen3-MoE's config derives it: 32 // 4)
    assert type(student) is type(teacher) and student.model.layers[0].self_attn.head_dim == head_dim
    if key_value_heads is not None:
        assert (config.num_key_value_heads, config.num_attention_heads, config.head_dim) == (1, 2, head_dim)
        assert student.model.layers[0].self_attn.q_proj.out_features == 2 * head_dim
    if intermediate_size is not None:
        width = config.moe_intermediate_size if kind == "qwen3_moe" else config.intermediate_size
        assert width == intermediate_size and all(len(kept) == intermediate_size
                                                  for block in plan.channels for kept in block)
    input_ids = calibration(2)  # other rows than the ones importance was measured on
    got = logits(student, input_ids)
    torch.testing.assert_close(got, logits(zeroed_reference(teacher, plan), input_ids), rtol=1e-5, atol=1e-5)
    assert (got - logits(teacher, input_ids)).abs().max() > 1e-3  # something was dropped


def test_biases_are_narrowed_with_their_weights() -> None:
    import transformers

    torch.manual_seed(1)  # q/k/v/o and gate/up/down with biases (as Qwen2's attention has)
    teacher = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SHAPES, attention_bias=True, mlp_bias=True)).eval()
    with torch.no_grad():
        for name, parameter in teacher.named_parameters():
            if name.endswith("bias"):
                parameter.normal_()  # (they start at zero)
    student, plan = width_pruned(teacher, calibration(8), 7, 1)
    block = student.model.layers[0]
    assert block.self_attn.k_proj.bias.shape == (8,) and block.mlp.up_proj.bias.shape == (7,)
    input_ids = calibration(9)
    torch.testing.assert_close(logits(student, input_ids), logits(zeroed_reference(teacher, plan), input_ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_depth_and_width_together(kind: str) -> None:
    teacher = tiny(kind)
    kept = (0, 1, 3)
    width = 6 if kind == "llama" else 8
    student, plan = width_pruned(prune_teacher(teacher, kept), calibration(3), width, 1)
    assert student.config.num_hidden_layers == 3 and len(plan.groups) == 3
    reference = zeroed_reference(cut_reference(teacher, kept), plan)
    input_ids = calibration(4)
    torch.testing.assert_close(logits(student, input_ids), logits(reference, input_ids), rtol=1e-5, atol=1e-5)
    if kind == "qwen3_moe":  # block 1 is the dense one: it narrows its MLP, the others their experts
        assert student.config.mlp_only_layers == [1] and student.config.intermediate_size == 8
        assert student.model.layers[1].mlp.down_proj.in_features == 8


def test_importance_finds_the_channel_and_the_heads_that_do_nothing() -> None:
    teacher = tiny("llama")
    with torch.no_grad():
        teacher.model.layers[2].mlp.up_proj.weight[5].zero_()  # channel 5 of block 2: act(gate) * 0
        # key/value group 1 of block 0: its values are 0, so are its query heads' outputs
        head_dim = teacher.model.layers[0].self_attn.head_dim
        teacher.model.layers[0].self_attn.v_proj.weight[head_dim:2 * head_dim].zero_()
    channel_scores, group_scores = width_importance(teacher, calibration(5))
    assert channel_scores[2][5] == 0.0 and channel_scores[2].min() == 0.0 and (channel_scores[2] > 0).sum() == 63
    assert group_scores[0][1] == 0.0 and group_scores[0][0] > 0.0 and (group_scores[1] > 0).all()
    student, plan = width_pruned(teacher, calibration(5), 63, 1)
    assert plan.channels[2] == (tuple(c for c in range(64) if c != 5),) and plan.groups[0] == (0,)


def test_experts_are_scored_on_the_tokens_routed_to_them() -> None:
    teacher = tiny("qwen3_moe")
    experts = teacher.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj[2, 16 + 3].zero_()  # the up row of channel 3 of expert 2 (gate rows come first)
    channel_scores, _ = width_importance(teacher, calibration(6))
    assert channel_scores[0].shape == (4, 16) and channel_scores[1].shape == (64,)  # block 1 is dense
    assert channel_scores[0][2, 3] == 0.0 and (channel_scores[0][2] > 0).sum() == 15
    _, plan = width_pruned(teacher, calibration(6), 8, None)
    assert 3 not in plan.channels[0][2] and 3 in plan.channels[0][0]


def test_bad_widths_are_one_line_errors() -> None:
    llama, moe = tiny("llama"), tiny("qwen3_moe")
    with pytest.raises(ValueError, match=r"^student.prune.intermediate_size 65 is more than the 64 MLP channels of "
                                         r"the teacher's block 0$"):
        check_width(llama, 65, None)
    with pytest.raises(ValueError, match=r"^student.prune.intermediate_size 17 .* 16 MLP channels of the teacher's "
                                         r"block 0$"):
        check_width(moe, 17, None)
    with pytest.raises(ValueError, match=r"^student.prune.intermediate_size 12 is not a multiple of 8, which a MoE"):
        check_width(moe, 12, None)
    with pytest.raises(ValueError, match=r"^student.prune.key_value_heads 3 is more than the teacher's 2 key/value"):
        check_width(llama, None, 3)
    llama.config.num_attention_heads, llama.config.num_key_value_heads = 6, 4  # as if: 6 query heads, 4 groups
    for layer in llama.model.layers:
        layer.self_attn.head_dim = 4  # 6 x 4 query rows would not match q_proj's 32: say so
    with pytest.raises(ValueError, match="q_proj/k_proj widths do not match 6 query heads"):
        check_width(llama, None, 1)


def test_an_unknown_mlp_or_attention_is_a_one_line_error() -> None:
    import transformers

    config = transformers.Phi3Config(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64, pad_token_id=0)
    phi = transformers.AutoModelForCausalLM.from_config(config)  # gate and up fused in one Linear
    with pytest.raises(ValueError, match=r"^width pruning narrows MLPs .* not Phi3MLP$"):
        check_width(phi, 8, None)
    with pytest.raises(ValueError, match=r"^width pruning narrows attention with q_proj/k_proj/v_proj/o_proj, not "
                                         r"Phi3Attention$"):  # q, k and v fused in one Linear
        check_width(phi, None, 1)


def test_widths_count_in_the_resume_fingerprint_only_when_set() -> None:
    depth_only = student_resume_fields(StudentConfig(prune={"layers": 3}))["prune"]
    assert depth_only == {"layers": 3, "importance": "cosine", "calibration_rows": 16}  # as before width pruning
    narrowed = student_resume_fields(StudentConfig(prune={"layers": 3, "key_value_heads": 1}))["prune"]
    assert narrowed == depth_only | {"key_value_heads": 1}
    other_shape = StudentConfig(prune={"layers": 3}, architecture={"hidden_size": 64, "num_attention_heads": 2,
                                                                     "num_key_value_heads": 1})
    assert student_resume_fields(other_shape) == student_resume_fields(StudentConfig(prune={"layers": 3}))  # unused


def test_the_card_line_says_what_was_kept() -> None:
    _, plan = width_pruned(tiny("llama"), calibration(7), 16, 1)
    entry = {"kept": [0, 2], "teacher_layers": 5, "importance": "cosine"} | width_entry(plan)
    assert entry["intermediate_size"] == 16 and entry["teacher_intermediate_size"] == [64]
    assert width_summary(entry) == "16 of 64 MLP channels, 1 of 2 key/value heads (2 of 4 query heads)"
    assert width_summary(entry | {"teacher_intermediate_size": [16, 64]}).startswith("16 of 16/64 MLP channels, ")
    _, heads_only = width_pruned(tiny("qwen3_moe"), calibration(7), None, 1)
    assert width_summary(width_entry(heads_only)) == "1 of 2 key/value heads (2 of 4 query heads)"
    assert width_summary({"kept": [0], "teacher_layers": 5, "importance": "cosine"}) is None


def test_training_a_student_pruned_in_depth_and_width(fresh_run, sharp_teacher_dir) -> None:
    """`student.prune` with widths: the saved student is narrower, its config and card say what it kept, it starts
    nearer the teacher than a random student with as many blocks, channels and heads, and resumes without measuring
    again."""
    import json

    from support.runs import student_path

    from kdflow.schemas.stage_settings import open_run_root, training_settings
    from kdflow.tasks.student.train import train

    teacher = json.loads((sharp_teacher_dir / "config.json").read_text())
    prune = {"layers": teacher["num_hidden_layers"], "intermediate_size": teacher["intermediate_size"] // 2,
             "key_value_heads": 1}
    pruned = fresh_run(student__steps=2, student__name="narrow", student__prune=prune)
    summary = train(open_run_root(pruned), training_settings(pruned))
    saved = json.loads(student_path(pruned, "final", "config.json").read_text())
    assert (saved["intermediate_size"], saved["num_key_value_heads"]) == (teacher["intermediate_size"] // 2, 1)
    assert saved["num_attention_heads"] == teacher["num_attention_heads"] // teacher["num_key_value_heads"]
    entry = saved["kdflow_prune"]
    assert entry["intermediate_size"] == prune["intermediate_size"] and entry["teacher_key_value_heads"] == 2
    card = student_path(pruned, "final", "README.md").read_text()
    assert f"| student width | each block keeps {prune['intermediate_size']} of {teacher['intermediate_size']} MLP " \
        "channels, 1 of 2 key/value heads" in card
    architecture = {"hidden_size": teacher["hidden_size"], "num_hidden_layers": teacher["num_hidden_layers"],
                    "num_attention_heads": saved["num_attention_heads"], "num_key_value_heads": 1,
                    "intermediate_size": saved["intermediate_size"]}
    random = fresh_run(student__steps=2, student__name="random", student__architecture=architecture)
    assert summary["eval_before"]["kl"] < train(open_run_root(random), training_settings(random))["eval_before"]["kl"]
    again = fresh_run(student__steps=3, student__name="narrow", student__prune=prune)
    assert train(open_run_root(again), training_settings(again))["start_step"] == 2


def test_pre_flight_reads_the_widths_from_the_teachers_config(tiny_moe_teacher_dir, tiny_teacher_dir) -> None:
    """The widths `width_problem` checks before any weight loads, from config.json (a MoE: each expert's width)."""
    from kdflow.schemas.config import TeacherConfig
    from kdflow.tasks.common.model_configs import teacher_shape
    from kdflow.tasks.student.prune_width import width_problem

    moe = teacher_shape(TeacherConfig(model=str(tiny_moe_teacher_dir)))
    assert (moe.mlp_width, moe.heads, moe.key_value_heads, moe.experts) == (32, 4, 2, True)
    dense = teacher_shape(TeacherConfig(model=str(tiny_teacher_dir)))
    assert dense.experts is False and dense.mlp_width is not None and dense.key_value_heads is not None
    widths = {"mlp": moe.mlp_width, "heads": moe.heads, "kv_heads": moe.key_value_heads, "experts": moe.experts}
    assert width_problem(16, 1, **widths) is None
    assert width_problem(12, None, **widths).startswith("student.prune.intermediate_size 12 is not a multiple of 8")
    assert width_problem(40, None, **widths) == ("student.prune.intermediate_size 40 is more than the 32 MLP "
                                                 "channels of the teacher's blocks")
    assert width_problem(40, 3, mlp=None, heads=None, kv_heads=None, experts=False) is None  # unknown: at load
