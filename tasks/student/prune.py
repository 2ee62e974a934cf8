"""A student made from the teacher: its embedding, final norm and head, and a chosen subset of its blocks.

The field makes small models from big ones by pruning the teacher and then distilling it on its own logits; a
student that starts as part of the teacher starts near it. Which blocks to keep is measured, not guessed: on
calibration rows (token ids from the run's token store) each block is scored by how much it changes its input
(`importance="cosine"`: the mean over tokens of 1 - cos(block input, block output); a block that barely turns the
hidden state is the cheapest to drop) or by how much the teacher's loss on those rows rises when that block alone is
skipped (`importance="skip_loss"`, one forward per block). The `layers` highest-scoring blocks are kept, in their
order.

The pruned model is built from the teacher's own config with fewer layers, and the kept blocks' weights are copied
in under their new numbers, so it computes exactly what the teacher computes with the other blocks removed (the
test builds that reference by cutting the teacher's own module list). Per-layer config lists (`layer_types`, a
MoE's `mlp_only_layers`) follow the kept blocks. Any decoder transformers builds as `model.layers` works: dense
(Llama) and MoE (Qwen3-MoE) are tested.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from kdflow.tasks.common.model_files import shown_name
from kdflow.tasks.common.models import decoder_layers, layers_prefix, model_body
from kdflow.tasks.student.prune_width import WidthPlan, check_width, top_in_order, width_pruned

logger = logging.getLogger(__name__)

IMPORTANCE = ("cosine", "skip_loss")


@dataclass(frozen=True)
class PrunePlan:
    """What a pruned student keeps of the teacher, for its card and its config."""

    kept: tuple[int, ...]  # the teacher's block numbers, in order
    scores: tuple[float, ...]  # every teacher block's importance (higher: more important)
    importance: str
    teacher_layers: int
    width: WidthPlan | None = None  # the kept blocks' channels and heads, when they were narrowed too


@torch.no_grad()
def block_importance(model: nn.Module, input_ids: Tensor, importance: str = "cosine") -> list[float]:
    """One score per block of `model` on calibration rows `input_ids` (n, T): higher means the block matters more."""
    if importance not in IMPORTANCE:
        raise ValueError(f"importance must be one of {IMPORTANCE}, got {importance!r}")
    layers = decoder_layers(model)
    if importance == "skip_loss":  # the rise of the loss when the block alone is skipped
        return _skip_loss_scores(model, input_ids, len(layers))
    changes: list[Tensor] = []

    def measure(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        before = args[0] if args else kwargs["hidden_states"]
        after = output[0] if isinstance(output, tuple) else output
        cosine = nn.functional.cosine_similarity(before.float(), after.float(), dim=-1)  # (n, T)
        changes.append((1.0 - cosine).mean())

    hooks = [layer.register_forward_hook(measure, with_kwargs=True) for layer in layers]
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [float(change) for change in changes]


def _skip_loss_scores(model: nn.Module, input_ids: Tensor, blocks: int, every_s: float = 10.0) -> list[float]:
    """One forward per block, minutes for a large teacher on a slow device: said as it goes, every `every_s`."""
    started = last = time.monotonic()
    full = float(model(input_ids=input_ids, labels=input_ids, use_cache=False).loss)
    scores = []
    for skip in range(blocks):
        scores.append(_loss_without(model, input_ids, skip) - full)
        now = time.monotonic()
        if now - last >= every_s or skip == blocks - 1:
            logger.info("pruning: skip_loss scored %d of %d blocks (%.0f s; one forward of %d rows each)", skip + 1,
                        blocks, now - started, input_ids.shape[0])
            last = now
    return scores


def _loss_without(model: nn.Module, input_ids: Tensor, skip: int) -> float:
    """The model's next-token loss on input_ids with block `skip` left out (its input passed on unchanged)."""
    body = model_body(model)
    layers = decoder_layers(model)
    saved = (body.layers, model.config.num_hidden_layers)
    body.layers = nn.ModuleList([layer for index, layer in enumerate(layers) if index != skip])
    model.config.num_hidden_layers = len(body.layers)
    try:
        return float(model(input_ids=input_ids, labels=input_ids, use_cache=False).loss)
    finally:
        body.layers, model.config.num_hidden_layers = saved


def choose_blocks(scores: list[float], layers: int) -> tuple[int, ...]:
    """The `layers` highest-scoring blocks, in the teacher's order (ties: the earlier block)."""
    if not 1 <= layers <= len(scores):
        raise ValueError(f"keep between 1 and the teacher's {len(scores)} blocks, got {layers}")
    return top_in_order(scores, layers)


# What a teacher's config says of how the teacher was stored, not of the model: a teacher loaded from a GGUF file or
# in 4-bit carries transformers' quantization_config, which on a student of plain weights made every later load
# quantised (a resume, init_from: "The model is quantized with gguf and is not serializable").
_STORAGE_ONLY = ("quantization_config", "kdflow_source")


def pruned_config(config: object, kept: tuple[int, ...]) -> object:
    """The teacher's config with only the kept blocks; per-layer lists follow them. What says how the teacher's own
    files were stored (its quantisation, its source, its path) is not carried over."""
    pruned = copy.deepcopy(config)
    for name in _STORAGE_ONLY:
        if name in vars(pruned):
            delattr(pruned, name)
    pruned._name_or_path = ""
    teacher_layers = config.num_hidden_layers
    pruned.num_hidden_layers = len(kept)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == teacher_layers:
        pruned.layer_types = [layer_types[index] for index in kept]
    if hasattr(config, "mlp_only_layers"):  # MoE: which blocks have a dense MLP instead of experts
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = {index for index in range(teacher_layers)
                 if index in set(config.mlp_only_layers or []) or (index + 1) % step != 0}
        pruned.mlp_only_layers = [new for new, old in enumerate(kept) if old in dense]
        pruned.decoder_sparse_step = 1
    return pruned


def prune_teacher(teacher: nn.Module, kept: tuple[int, ...], dtype: torch.dtype = torch.float32) -> nn.Module:
    """A new model of the teacher's kind holding the teacher's weights except the blocks not in `kept`."""
    from transformers import AutoModelForCausalLM

    layers = decoder_layers(teacher)
    if not kept or list(kept) != sorted(set(kept)) or kept[-1] >= len(layers):
        raise ValueError(f"kept blocks must be distinct, ascending and below {len(layers)}, got {list(kept)}")
    config = pruned_config(teacher.config, kept)
    student = AutoModelForCausalLM.from_config(config, dtype=dtype)
    renumber = {old: new for new, old in enumerate(kept)}
    prefix = layers_prefix(teacher)
    state = {}
    for name, tensor in teacher.state_dict().items():
        if name.startswith(prefix):
            index, rest = name[len(prefix):].split(".", 1)
            if int(index) not in renumber:
                continue
            name = f"{prefix}{renumber[int(index)]}.{rest}"
        state[name] = tensor.to(dtype)
    student.load_state_dict(state, strict=True)
    return student.eval()


def pruned_student(teacher_section: object, layers: int, importance: str, calibration_ids: Tensor,
                   tokenizer: object, *, intermediate_size: int | None = None,
                   key_value_heads: int | None = None) -> tuple[nn.Module, PrunePlan]:
    """`student.prune`: the teacher (loaded unquantised on the CPU: 4-bit weights cannot be copied into a float32
    student) scored on `calibration_ids` (n, T), cut to its `layers` most important blocks, as a float32 student,
    and, when `intermediate_size` or `key_value_heads` is set, narrowed by kdflow.tasks.student.prune_width on the
    same rows. What was kept goes into the student's config (`kdflow_prune`), so that it is saved with the model
    and its card can say it."""
    from kdflow.tasks.common.teacher_loading import load_teacher

    section = teacher_section.model_copy(update={"load_in_4bit": False, "device": "cpu"})
    teacher = load_teacher(section, device="cpu")
    narrowed = intermediate_size is not None or key_value_heads is not None
    if narrowed:  # before anything is measured: a width the teacher cannot give is a config error
        check_width(teacher, intermediate_size, key_value_heads)
    scores = block_importance(teacher, calibration_ids.to("cpu"), importance)
    kept = choose_blocks(scores, layers)
    student = prune_teacher(teacher, kept)
    vocab = len(tokenizer)
    if student.get_output_embeddings().weight.shape[0] < vocab:
        raise ValueError(f"the teacher's vocabulary is smaller than the tokenizer's {vocab}")
    plan = PrunePlan(kept=kept, scores=tuple(round(score, 6) for score in scores), importance=importance,
                     teacher_layers=len(scores))
    student.config.kdflow_prune = {"teacher": shown_name(teacher_section.model), "kept": list(plan.kept),
                                   "teacher_layers": plan.teacher_layers, "importance": importance,
                                   "scores": list(plan.scores)}
    del teacher
    if narrowed:  # the kept blocks narrowed on the same rows (the new model's config carries kdflow_prune over)
        student, width = width_pruned(student, calibration_ids.to("cpu"), intermediate_size, key_value_heads)
        plan = replace(plan, width=width)
        student.config.kdflow_prune = student.config.kdflow_prune | width_entry(width)
    return student, plan


def pruned_as_configured(teacher_section: object, prune: object, data: object,
                         tokenizer: object) -> tuple[nn.Module, PrunePlan, int]:
    """`student.prune` (a PruneConfig) as training applies it, on `data` (DistillData): blocks measured on the first
    `prune.calibration_rows` training rows in the order of seed 0, not of the student's seed (which blocks are
    kept, and so the initial weights, do not change with `student.seed`; the same on every rank); -> (student,
    plan, rows used), checked against the run's tokenizer. The training step's benchmark builds its student here
    too, so it times the trained model."""
    from kdflow.tasks.student.data import epoch_permutation
    from kdflow.tasks.student.model import check_student

    rows = epoch_permutation(data.train_rows, 0, 0)[:prune.calibration_rows]
    if len(rows) < prune.calibration_rows:
        logger.warning("student.prune.calibration_rows=%d, but the token store has %d training rows: the blocks are "
                       "measured on those", prune.calibration_rows, len(rows))
    model, plan = pruned_student(teacher_section, prune.layers, prune.importance, data.train_batch(rows).input_ids,
                                 tokenizer, intermediate_size=prune.intermediate_size,
                                 key_value_heads=prune.key_value_heads)
    check_student(model, tokenizer)
    return model, plan, len(rows)


def width_entry(width: WidthPlan) -> dict[str, object]:
    """The widths a narrowed student kept and its teacher had, for `kdflow_prune`."""
    entry: dict[str, object] = {}
    if width.intermediate_size is not None:
        entry |= {"intermediate_size": width.intermediate_size,
                  "teacher_intermediate_size": list(width.teacher_intermediate_size)}
    if width.key_value_heads is not None:
        entry |= {"key_value_heads": width.key_value_heads, "teacher_key_value_heads": width.teacher_key_value_heads,
                  "attention_heads": width.attention_heads, "teacher_attention_heads": width.teacher_attention_heads}
    return entry


def pruned_line(entry: dict[str, object] | None) -> str | None:
    """The blocks a pruned student kept, in words, from its `kdflow_prune` entry: "blocks 0, 1, 8 of 30 (importance
    cosine)" (None: not pruned)."""
    if not entry:
        return None
    return (f"blocks {', '.join(map(str, entry['kept']))} of {entry['teacher_layers']} "
            f"(importance {entry['importance']})")


def width_summary(entry: dict[str, object] | None) -> str | None:
    """The widths a narrowed student's blocks kept, in words, from its `kdflow_prune` entry (None: not narrowed)."""
    parts = []
    if entry and "intermediate_size" in entry:
        widths = "/".join(str(width) for width in entry["teacher_intermediate_size"])
        parts.append(f"{entry['intermediate_size']} of {widths} MLP channels")
    if entry and "key_value_heads" in entry:
        parts.append(f"{entry['key_value_heads']} of {entry['teacher_key_value_heads']} key/value heads "
                     f"({entry['attention_heads']} of {entry['teacher_attention_heads']} query heads)")
    return ", ".join(parts) or None
