"""Width pruning: a pruned student's blocks made narrower, with fewer MLP channels and fewer attention heads.

Depth pruning (kdflow.tasks.student.prune) drops whole blocks; this keeps every block but drops the parts of each that
matter least on the calibration rows (Minitron-style activation importance). An MLP channel is scored by the mean
over tokens of |act(gate(x)) * up(x)|, the value down_proj multiplies into the residual stream; a key/value head
group by the mean L2 norm of its query heads' attention outputs, the slices o_proj reads. Each block keeps its own
top channels and groups, in their original order, so the narrower block computes exactly what the teacher's block
computes with the other channels' and heads' contributions set to zero (the tests build that reference with hooks).

A key/value group goes with all of its query heads, so grouped-query attention keeps its ratio and head_dim stays
the teacher's (written into the config, since some models derive it from hidden_size // num_attention_heads).
Per-head norms (Qwen3's q_norm, k_norm) act on head_dim and are copied whole. A MoE block's experts are stored fused
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]); each expert keeps the same number of channels, chosen by their
importance over the calibration tokens routed to that expert. The router is untouched, so tokens go where they went.

Importance is measured on the model being narrowed (the depth-pruned student), whose blocks see the inputs they
will see in training, not the teacher's.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kdflow.tasks.common.models import decoder_layers, layers_prefix

# Fused experts run as grouped matmuls whose operands' rows must start at multiples of 16 bytes: in bf16 an expert's
# width is a multiple of 8 channels (transformers' grouped_mm path refuses others: "strides should be multiple of 16")
EXPERT_WIDTH_STEP = 8


@dataclass(frozen=True)
class WidthPlan:
    """What each block of a narrowed model keeps, in the order of its blocks (None: that part was not narrowed)."""

    channels: tuple[tuple[tuple[int, ...], ...], ...] | None  # per block, per MLP (one, or one per expert)
    groups: tuple[tuple[int, ...], ...] | None  # per block, the key/value groups kept
    intermediate_size: int | None  # MLP channels each block (each expert) keeps
    key_value_heads: int | None
    attention_heads: int | None  # key_value_heads times the query heads per group
    teacher_intermediate_size: tuple[int, ...]  # the widths of the MLPs it was narrowed from (dense, experts)
    teacher_key_value_heads: int
    teacher_attention_heads: int


def block_mlp(layer: nn.Module) -> tuple[str, nn.Module]:
    """("dense", the MLP) for gate_proj/up_proj/down_proj, ("experts", the experts) for fused experts."""
    mlp = getattr(layer, "mlp", None)
    if all(isinstance(getattr(mlp, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj")):
        return "dense", mlp
    experts = getattr(mlp, "experts", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if (isinstance(gate_up, Tensor) and isinstance(down, Tensor) and gate_up.dim() == down.dim() == 3
            and not getattr(experts, "is_transposed", False) and gate_up.shape[1] == 2 * down.shape[2]):
        return "experts", experts
    raise ValueError(f"width pruning narrows MLPs with gate_proj/up_proj/down_proj or fused experts "
                     f"(gate_up_proj [E, 2I, H], down_proj [E, H, I]), not {type(mlp).__name__}")


def mlp_width(layer: nn.Module) -> int:
    kind, mlp = block_mlp(layer)
    return mlp.down_proj.in_features if kind == "dense" else mlp.down_proj.shape[2]


def head_counts(config: object) -> tuple[int, int]:
    """(query heads, key/value heads) as the config says (no num_key_value_heads: one per query head)."""
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of the model's attention, checked against every block."""
    heads, kv_heads = head_counts(model.config)
    shapes = set()
    for attention in (getattr(layer, "self_attn", None) for layer in decoder_layers(model)):
        if not all(isinstance(getattr(attention, name, None), nn.Linear) for name in ("q_proj", "k_proj", "v_proj",
                                                                                        "o_proj")):
            raise ValueError(f"width pruning narrows attention with q_proj/k_proj/v_proj/o_proj, not "
                             f"{type(attention).__name__}")
        head_dim = getattr(attention, "head_dim", None) or attention.q_proj.out_features // heads
        if attention.q_proj.out_features != heads * head_dim or attention.k_proj.out_features != kv_heads * head_dim:
            raise ValueError(f"{type(attention).__name__}: q_proj/k_proj widths do not match {heads} query heads, "
                             f"{kv_heads} key/value heads of {head_dim}")
        shapes.add(head_dim)
    if len(shapes) > 1:
        raise ValueError(f"width pruning needs one head_dim in every block, not {sorted(shapes)}")
    return heads, kv_heads, shapes.pop()


def check_width(model: nn.Module, intermediate_size: int | None, key_value_heads: int | None) -> None:
    """One-line errors for widths the model cannot be narrowed to (before anything is measured)."""
    layers = decoder_layers(model)
    widths = [mlp_width(layer) for layer in layers] if intermediate_size is not None else [0]
    heads, kv_heads, _ = attention_shape(model) if key_value_heads is not None else (None, None, None)
    problem = width_problem(intermediate_size, key_value_heads, mlp=min(widths), heads=heads, kv_heads=kv_heads,
                            experts=any(block_mlp(layer)[0] == "experts" for layer in layers),
                            block=f"block {widths.index(min(widths))}")
    if problem:
        raise ValueError(problem)


def width_problem(intermediate_size: int | None, key_value_heads: int | None, *, mlp: int | None,
                  heads: int | None, kv_heads: int | None, experts: bool, block: str = "blocks") -> str | None:
    """Why a teacher of these widths (None: unknown, not checked) cannot be narrowed to the asked ones, in one
    line, or None: the rule `check_width` applies to a loaded model and pre-flight to its config."""
    if intermediate_size is not None and mlp is not None:
        if intermediate_size > mlp:
            return (f"student.prune.intermediate_size {intermediate_size} is more than the {mlp} MLP channels of "
                    f"the teacher's {block}")
        if intermediate_size % EXPERT_WIDTH_STEP and experts:
            return (f"student.prune.intermediate_size {intermediate_size} is not a multiple of "
                    f"{EXPERT_WIDTH_STEP}, which a MoE teacher's experts need (fused grouped matmuls)")
    if key_value_heads is not None and kv_heads is not None:
        if key_value_heads > kv_heads:
            return (f"student.prune.key_value_heads {key_value_heads} is more than the teacher's {kv_heads} "
                    "key/value heads")
        if heads is not None and heads % kv_heads:
            return (f"the teacher's {heads} query heads are not a whole number per each of its {kv_heads} "
                    "key/value heads: its heads cannot be pruned by group")
    return None


@torch.no_grad()
def width_importance(model: nn.Module, input_ids: Tensor, *, channels: bool = True,
                     groups: bool = True) -> tuple[list[Tensor], list[Tensor]]:
    """Per block: the MLP channels' importance, (I,) for a dense MLP or (E, I) for experts, and the key/value
    groups' importance (KV,), from one forward over input_ids (n, T); a part not asked for gives an empty list.
    Higher: the part matters more."""
    layers = decoder_layers(model)
    heads, kv_heads, head_dim = attention_shape(model) if groups else (*head_counts(model.config), 0)
    channel_sums: list[Tensor | float] = [0.0] * len(layers)
    channel_counts: list[Tensor | float] = [0.0] * len(layers)  # tokens seen (per expert: those routed to it)
    head_sums: list[Tensor | float] = [0.0] * len(layers)
    tokens_seen = [0] * len(layers)

    def dense_hook(index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            activation = args[0].float().reshape(-1, args[0].shape[-1])  # (tokens, I): down_proj's input
            channel_sums[index] = channel_sums[index] + activation.abs().sum(0)
            channel_counts[index] = channel_counts[index] + activation.shape[0]
        return hook

    def experts_hook(index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]  # (tokens, H)
            routed = args[1] if len(args) > 1 else kwargs["top_k_index"]  # (tokens, top_k): the experts chosen
            sums, counts = routed_activation(module, hidden, routed)
            channel_sums[index] = channel_sums[index] + sums
            channel_counts[index] = channel_counts[index] + counts
        return hook

    def head_hook(index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            outputs = args[0].float().reshape(-1, heads, head_dim)  # (tokens, heads, head_dim): o_proj's input
            head_sums[index] = head_sums[index] + outputs.norm(dim=-1).sum(0)
            tokens_seen[index] += outputs.shape[0]
        return hook

    hooks = []
    for index, layer in enumerate(layers):
        kind, mlp = block_mlp(layer) if channels else ("", None)
        if kind == "dense":
            hooks.append(mlp.down_proj.register_forward_pre_hook(dense_hook(index)))
        elif kind == "experts":
            hooks.append(mlp.register_forward_pre_hook(experts_hook(index), with_kwargs=True))
        if groups:
            hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(head_hook(index)))
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    channel_scores = [torch.as_tensor(total) / torch.as_tensor(count).clamp_min(1)
                      for total, count in zip(channel_sums, channel_counts)] if channels else []
    group_scores = [(torch.as_tensor(total) / max(count, 1)).reshape(kv_heads, heads // kv_heads).mean(-1)
                    for total, count in zip(head_sums, tokens_seen)] if groups else []
    return channel_scores, group_scores


def routed_activation(experts: nn.Module, hidden: Tensor, routed: Tensor) -> tuple[Tensor, Tensor]:
    """For fused experts called on hidden (tokens, H) with routed (tokens, top_k) expert ids: per expert the sum
    over the tokens routed to it of |act(gate(x)) * up(x)| (E, I), and how many tokens that was (E, 1)."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    sums = torch.zeros(gate_up.shape[0], down.shape[2])
    counts = torch.zeros(gate_up.shape[0], 1)
    for expert in range(gate_up.shape[0]):
        mine = (routed == expert).any(dim=-1)  # (tokens,)
        if not mine.any():  # an expert no calibration token reached: its channels tie, the first ones are kept
            continue
        gate, up = nn.functional.linear(hidden[mine], gate_up[expert]).chunk(2, dim=-1)
        sums[expert] = (experts.act_fn(gate) * up).float().abs().sum(0)
        counts[expert] = int(mine.sum())
    return sums, counts


def top_in_order(scores: Tensor | Sequence[float], keep: int) -> tuple[int, ...]:
    """The `keep` highest scores' indices in ascending order (ties: the earlier index): the blocks, channels or
    head groups a pruned model keeps."""
    values = scores.tolist() if isinstance(scores, Tensor) else list(scores)
    ranked = sorted(range(len(values)), key=lambda index: (-values[index], index))
    return tuple(sorted(ranked[:keep]))


def narrowed_config(model: nn.Module, plan: WidthPlan, head_dim: int) -> object:
    """The model's config with the plan's widths; the kind of each kept block decides which width field changes."""
    config = copy.deepcopy(model.config)
    if plan.intermediate_size is not None:
        kinds = {block_mlp(layer)[0] for layer in decoder_layers(model)}
        if "dense" in kinds:
            config.intermediate_size = plan.intermediate_size
        if "experts" in kinds:
            config.moe_intermediate_size = plan.intermediate_size
    if plan.key_value_heads is not None:
        config.num_key_value_heads = plan.key_value_heads
        config.num_attention_heads = plan.attention_heads
        config.head_dim = head_dim  # models that derive it from hidden_size would change it
    return config


def narrow(model: nn.Module, plan: WidthPlan) -> nn.Module:
    """A new model of the same kind holding `model`'s weights with only the plan's channels and heads."""
    from transformers import AutoModelForCausalLM

    heads, kv_heads, head_dim = attention_shape(model) if plan.groups is not None else (*head_counts(model.config), 0)
    per_group = heads // kv_heads
    dtype = next(model.parameters()).dtype
    student = AutoModelForCausalLM.from_config(narrowed_config(model, plan, head_dim), dtype=dtype)
    prefix = layers_prefix(model)
    wanted = student.state_dict()
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith(prefix):
            index, rest = name[len(prefix):].split(".", 1)
            block = int(index)
            if plan.channels is not None:
                tensor = narrow_mlp(rest, tensor, plan.channels[block])
            if plan.groups is not None:
                groups = plan.groups[block]
                query_heads = [group * per_group + offset for group in groups for offset in range(per_group)]
                tensor = narrow_attention(rest, tensor, rows(groups, head_dim), rows(query_heads, head_dim))
        if tensor.shape != wanted[name].shape:
            raise ValueError(f"width pruning does not know how to narrow {name} {tuple(tensor.shape)} to "
                             f"{tuple(wanted[name].shape)}")
        state[name] = tensor
    student.load_state_dict(state, strict=True)
    return student.eval()


def rows(units: tuple[int, ...] | list[int], size: int) -> Tensor:
    """The rows of the units (heads) kept, each `size` rows wide: unit u holds rows u*size .. u*size+size-1."""
    return torch.cat([torch.arange(unit * size, (unit + 1) * size) for unit in units])


def narrow_mlp(name: str, tensor: Tensor, channels: tuple[tuple[int, ...], ...]) -> Tensor:
    """One block-relative weight with only the kept MLP channels (down_proj's bias stays whole: it adds to H)."""
    if name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.bias"):
        return tensor[list(channels[0])]
    if name == "mlp.down_proj.weight":
        return tensor[:, list(channels[0])]
    if name == "mlp.experts.gate_up_proj":  # (E, 2I, H): gate rows first, then up rows
        width = tensor.shape[1] // 2
        return torch.stack([torch.cat([tensor[expert, list(kept)], tensor[expert, [width + c for c in kept]]])
                            for expert, kept in enumerate(channels)])
    if name == "mlp.experts.down_proj":  # (E, H, I)
        return torch.stack([tensor[expert][:, list(kept)] for expert, kept in enumerate(channels)])
    return tensor


def narrow_attention(name: str, tensor: Tensor, kv_rows: Tensor, query_rows: Tensor) -> Tensor:
    """One block-relative weight with only the kept heads (o_proj's bias stays whole)."""
    if name in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
        return tensor[query_rows]
    if name in ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                "self_attn.v_proj.bias"):
        return tensor[kv_rows]
    if name == "self_attn.o_proj.weight":
        return tensor[:, query_rows]
    return tensor


def width_pruned(model: nn.Module, input_ids: Tensor, intermediate_size: int | None,
                 key_value_heads: int | None) -> tuple[nn.Module, WidthPlan]:
    """`model` narrowed to `intermediate_size` MLP channels (per expert) and `key_value_heads` key/value groups per
    block, each block keeping its most important ones on `input_ids` (n, T); None leaves that part whole."""
    check_width(model, intermediate_size, key_value_heads)
    layers = decoder_layers(model)
    heads, kv_heads = head_counts(model.config)
    channel_scores, group_scores = width_importance(model, input_ids, channels=intermediate_size is not None,
                                                    groups=key_value_heads is not None)
    channels = groups = None
    if intermediate_size is not None:
        channels = tuple(tuple(top_in_order(row, intermediate_size) for row in scores.reshape(-1, scores.shape[-1]))
                         for scores in channel_scores)
    if key_value_heads is not None:
        groups = tuple(top_in_order(scores, key_value_heads) for scores in group_scores)
    plan = WidthPlan(channels=channels, groups=groups, intermediate_size=intermediate_size,
                     key_value_heads=key_value_heads,
                     attention_heads=None if key_value_heads is None else key_value_heads * (heads // kv_heads),
                     teacher_intermediate_size=tuple(sorted({mlp_width(layer) for layer in layers})),
                     teacher_key_value_heads=kv_heads, teacher_attention_heads=heads)
    return narrow(model, plan), plan
