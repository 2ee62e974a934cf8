"""Models as every stage sees them: where their files come from, what identifies them, and their parts.

Sources: a hub id, a local folder, or a model shipped inside an installed package (`package:DIST`); they are
resolved and checked without torch in kdflow.tasks.common.model_files.

Identity: the teacher's fingerprint (its weights, dtype and quantisation) names the top-K store it makes;
the student side computes it too, to choose among stores, so it lives here and not with the teacher pass.
Parts: the body that returns final hidden states, and the output layer, which both the teacher's chunked
top-K and the student's fused loss apply themselves.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from kdflow.schemas.config import TeacherConfig
from kdflow.schemas.config_hash import section_hash
from kdflow.schemas.errors import ConfigError
from kdflow.tasks.common.devices import cuda_unavailable, no_cuda_message
from kdflow.tasks.common.float32_logits import SIXTEEN_BIT
from kdflow.tasks.common.model_files import WEIGHT_SUFFIXES, check_teacher_files

_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})/")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str, setting: str = "device") -> torch.device:
    """auto -> the first CUDA device if there is one, else the CPU; `cuda` means `cuda:0`. A CUDA device that is
    not here is a ConfigError naming `setting`."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda":
        device, found = torch.device("cuda", device.index or 0), torch.cuda.device_count()
        if device.index >= found:
            raise no_cuda_error(setting, spec, found)
    return device


def no_cuda_error(setting: str, spec: str, found: int) -> ConfigError:
    """`setting=spec` names a CUDA device beyond the `found` ones here: why (a CPU build of torch, ...), in one line."""
    why = (cuda_unavailable() if not found else None) or (
        f"torch {torch.__version__} finds {found} CUDA device{'s' if found != 1 else ''} here")
    return ConfigError(no_cuda_message(setting, spec, why))


def resolve_dtype(teacher: TeacherConfig, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on a CUDA device that supports it, else float32 (bf16 matmuls are slower on CPUs)."""
    if teacher.dtype != "auto":
        return _DTYPES[teacher.dtype]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


# --- identity ---------------------------------------------------------------------------------------------


def _file_sha256(path: str, limit: int | None = None) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        sha.update(handle.read(limit) if limit is not None else handle.read())
    return sha.hexdigest()


def _local_weights_hash(folder: str, gguf_file: str | None) -> str:
    """Cheap stand-in for hashing tens of GB: the config's bytes and the weight files' names and sizes."""
    if gguf_file:
        path = os.path.join(folder, gguf_file)
        return section_hash("gguf", gguf_file, os.path.getsize(path), _file_sha256(path, 1 << 20), length=32)
    weights = sorted((n, os.path.getsize(os.path.join(folder, n))) for n in os.listdir(folder)
                     if n.endswith(WEIGHT_SUFFIXES))
    return section_hash("folder", _file_sha256(os.path.join(folder, "config.json")), json.dumps(weights), length=32)


def _hub_revision(teacher: TeacherConfig) -> str | None:
    """The pinned revision, else the commit of the cached snapshot the weights load from."""
    if teacher.revision:
        return teacher.revision
    try:
        from transformers.utils import cached_file

        resolved = cached_file(teacher.model, "config.json", _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):
        return None
    match = _SNAPSHOT.search(str(resolved or "").replace(os.sep, "/"))
    return match.group(1) if match else None


def teacher_identity(teacher: TeacherConfig, model: nn.Module | None = None, *,
                     device: torch.device | None = None) -> dict[str, Any]:
    """What decides the teacher's numbers: its weights, dtype and quantisation (not where the folder lies)."""
    if device is None:
        device = next(model.parameters()).device if model is not None else resolve_device(teacher.device)
    local = check_teacher_files(teacher)
    dtype = resolve_dtype(teacher, device)
    identity: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."),
                                "quantisation": "bnb-nf4" if teacher.load_in_4bit else None,
                                "gguf_file": teacher.gguf_file}
    if teacher.lm_head_float32 and dtype in SIXTEEN_BIT:
        # Only where it changes the numbers (a 16-bit lm_head): a float32 teacher's fingerprint, and every
        # fingerprint made before the option, stay as they were.
        identity["lm_head"] = "float32"
    if local is not None:
        identity["weights"] = _local_weights_hash(local, teacher.gguf_file)
    else:
        identity |= {"model": teacher.model, "revision": _hub_revision(teacher)}
    # A checkpoint that ships quantised says so in its config.json, which the weights hash (local) or the
    # revision (hub) already covers: the identity is the same before and after loading.
    return identity


def teacher_fingerprint(teacher: TeacherConfig, model: nn.Module | None = None, *,
                        device: torch.device | None = None) -> str:
    """16 hex characters; the same weights, dtype and quantisation give the same value on any host."""
    return section_hash("teacher", teacher_identity(teacher, model, device=device))


# --- parts ------------------------------------------------------------------------------------------------


def output_layer(model: nn.Module) -> nn.Module:
    """The model's lm_head (output embeddings), as a module to call."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if get_output_embeddings is not None else None
    if not isinstance(head, nn.Module):
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head): not a causal LM")
    return head


def model_body(model: nn.Module) -> nn.Module:
    """The transformer body that returns final hidden states (after the last norm), without lm_head."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    if body is None or body is model:
        for name in ("model", "base_model", "transformer"):
            candidate = getattr(model, name, None)
            if isinstance(candidate, nn.Module) and candidate is not model:
                body = candidate
                break
    if body is None or body is model:
        raise ValueError(
            f"cannot find the body of {type(model).__name__} (tried get_decoder(), .model, .base_model, "
            ".transformer): the teacher pass needs hidden states without lm_head"
        )
    return body


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of blocks (`model.layers`), which pruning chooses from and narrows."""
    layers = getattr(model_body(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `model.layers` list of blocks to choose from")
    return layers


def layers_prefix(model: nn.Module) -> str:
    """How the model's state dict names its blocks, `model.layers.` for most: block N's weights start with it + N."""
    layers = decoder_layers(model)
    for name, module in model.named_modules():
        if module is layers:
            return f"{name}."
    raise ValueError(f"{type(model).__name__}: cannot find the name of its block list")


@torch.inference_mode()
def body_hidden_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """input_ids (B, T) -> final hidden states (B, T, H) from the model body, never the logits."""
    return _last_hidden(model_body(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False))


def text_config(config: Any) -> Any:
    """A model config's text part (a multimodal model's text model config), or the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _last_hidden(outputs: Any) -> Tensor:
    """The final hidden states of a body's outputs (a ModelOutput, or a tuple whose first item they are)."""
    hidden = getattr(outputs, "last_hidden_state", None)
    return hidden if hidden is not None else outputs[0]


def body_runner(model: nn.Module, compiled: bool = False, backend: str = "inductor") -> Callable[..., Tensor]:
    """`body_hidden_states` of `model` as a function (input_ids, attention_mask=None) -> (B, T, H); `compiled`: the
    body under torch.compile at one shape (`dynamic=False`), the first call's: a later call with fewer rows is
    padded to it (rows of id 0, their outputs dropped; the pass pads its micro-batches already, the store report's
    re-run does not), so nothing compiles twice. On CUDA with CUDA graphs under inductor (`mode="reduce-overhead"`:
    the graph's output buffer is reused by the next call, so what it returns is a copy). `precompute.compile_body`;
    `kdflow bench body`'s `compiled`."""
    if not compiled:
        return functools.partial(body_hidden_states, model)
    graphs = next(model.parameters()).device.type == "cuda" and backend == "inductor"
    body = torch.compile(model_body(model), dynamic=False, backend=backend, mode="reduce-overhead" if graphs else None)
    compiled_rows: list[int] = []  # the first call's rows

    def run(input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        rows = input_ids.shape[0]
        before = None if compiled_rows else _dynamo_counts()  # the first call compiles
        compiled_rows[:] = compiled_rows or [rows]
        pad = compiled_rows[0] - rows
        with torch.inference_mode():  # inputs made here, so that every call's have the same dispatch keys (a tensor
            # made outside inference mode and one made inside it differ, and the graph's guards would recompile)
            input_ids = torch.cat([input_ids, input_ids.new_zeros((max(pad, 0), *input_ids.shape[1:]))])
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask,
                                            attention_mask.new_ones((max(pad, 0), *attention_mask.shape[1:]))])
            hidden = _last_hidden(body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False))[:rows]
            hidden = hidden.clone() if graphs else hidden
        if before is not None:
            run.compile_stats = _compile_stats(before, _dynamo_counts())  # type: ignore[attr-defined]
        return hidden

    run.compile_stats = {}  # type: ignore[attr-defined]  # after the first call: graphs and graph breaks
    return run


def _dynamo_counts() -> tuple[int, dict[str, int]]:
    """torch.compile's running totals: graphs compiled, graph breaks by reason."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], dict(counters["graph_break"])


def _compile_stats(before: tuple[int, dict[str, int]], after: tuple[int, dict[str, int]]) -> dict[str, Any]:
    """What one compile made: {"graphs", "graph_breaks", "graph_break": the first new reason}; a break is logged,
    since the body then runs as several graphs (slower, and CUDA graphs hold only their parts)."""
    breaks = {reason: count - before[1].get(reason, 0) for reason, count in after[1].items()
              if count > before[1].get(reason, 0)}
    stats: dict[str, Any] = {"graphs": after[0] - before[0], "graph_breaks": sum(breaks.values())}
    if breaks:
        stats["graph_break"] = next(iter(breaks)).strip().splitlines()[0][:200]
        logging.getLogger("kdflow").warning("the compiled body broke into %d graphs (%d graph breaks; %s): slower "
                                            "than one graph", stats["graphs"], stats["graph_breaks"],
                                            stats["graph_break"])
    return stats


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to lm_head's output before softmax: `softcap * tanh(scale * logits / softcap)`."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply_(self, logits: Tensor) -> None:
        """Transform float32 logits in place (the chunk buffer is ours to overwrite)."""
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)


# Model types whose forward multiplies lm_head's output by a config field.
_LOGIT_MULTIPLIER_FIELDS = {
    "cohere": "logit_scale",
    "cohere2": "logit_scale",
    "cohere2_moe": "logit_scale",
    "hyperclovax": "logits_scaling",
}
# Model types whose forward divides lm_head's output by a config field (Granite's muP scaling).
_LOGIT_DIVISOR_FIELDS = {
    name: "logits_scaling"
    for name in ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa", "granitemoe_swa")
}
# Fields that, set on any other model type, change its final logits in a way we do not reproduce here.
_UNSUPPORTED_LOGIT_FIELDS = ("logit_scale", "logits_scaling", "output_multiplier", "unpadded_vocab_size")


def _changes_logits(field: str, value: object, text_config: object) -> bool:
    if value is None:
        return False
    if field == "unpadded_vocab_size":  # logits sliced to the first `value` ids
        return value != getattr(text_config, "vocab_size", None)
    return value != 1


def final_logit_transform(config: object) -> LogitTransform:
    """The scaling/softcapping a Hugging Face config declares for its final logits.

    Raises NotImplementedError naming the field when the model alters its logits in a way not covered.
    """
    text = text_config(config)
    model_type = getattr(text, "model_type", "")
    scale = 1.0
    if model_type in _LOGIT_MULTIPLIER_FIELDS:
        scale = float(getattr(text, _LOGIT_MULTIPLIER_FIELDS[model_type]) or 1.0)
    elif model_type in _LOGIT_DIVISOR_FIELDS:
        scale = 1.0 / float(getattr(text, _LOGIT_DIVISOR_FIELDS[model_type]) or 1.0)
    else:
        for field in _UNSUPPORTED_LOGIT_FIELDS:
            value = getattr(text, field, None)
            if _changes_logits(field, value, text):
                raise NotImplementedError(
                    f"model type {model_type!r} sets config.{field}={value!r}, a final-logit change not supported"
                )
    softcap = getattr(text, "final_logit_softcapping", None)
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap is not None else None)
