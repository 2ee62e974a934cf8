"""What a model's config files say, read without weights, transformers or torch: the vocabulary size and the
context length of the teacher, and the vocabulary of a tokenizer (token -> id).

Pre-flight checks use these to fail in a second on a `top_k` or `seq_len` the teacher cannot take, or on a
`tokenizer:` whose ids mean other tokens to the teacher. Sources: a local Hugging Face folder (config.json,
tokenizer.json), a GGUF file (its metadata; kdflow.tasks.common.gguf_header), a hub id already in the local
Hugging Face cache. What cannot be read cheaply is None: the stage checks it again when it loads the model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kdflow.schemas.config import TeacherConfig
from kdflow.schemas.errors import ConfigError, first_line
from kdflow.tasks.common.gguf_header import GGUFError, gguf_summary, read_gguf_metadata
from kdflow.tasks.common.model_files import check_teacher_files, resolve_model_files

_VOCAB_KEYS = ("vocab_size", "n_vocab", "padded_vocab_size")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_MLP_KEYS = ("intermediate_size", "n_inner", "ffn_hidden_size")


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int | None
    context_length: int | None
    source: str  # where the numbers were read, for messages
    layers: int | None = None  # its blocks (what `student.prune` keeps some of)
    mlp_width: int | None = None  # MLP channels per block (a MoE's: each expert's); what prune.intermediate_size cuts
    heads: int | None = None  # query heads
    key_value_heads: int | None = None  # what prune.key_value_heads keeps some of
    experts: bool = False  # a MoE: its experts' widths must stay a multiple of 8
    hidden: int | None = None  # the residual stream's width
    head_dim: int | None = None  # None: hidden // heads
    expert_count: int | None = None  # routed experts per block (a MoE's)
    shared_width: int | None = None  # a MoE block's shared expert's MLP channels (0 or None: none)
    tied: bool | None = None  # the head shares the embedding's weights (None: unknown, counted as not; a GGUF's is
    #                           known from its tensors: no `output.weight`, the head is the embedding)

    def parameters(self, layers: int | None = None, mlp_width: int | None = None,
                   key_value_heads: int | None = None) -> int | None:
        """About how many parameters the model has, or a copy of it that keeps `layers` blocks, `mlp_width` MLP
        channels (each expert's) and `key_value_heads` (with their query heads): attention, MLP or experts with
        their router, norms, embedding and head. None when the config does not say enough."""
        layers, width = layers or self.layers, mlp_width or self.mlp_width
        kv_heads = key_value_heads or self.key_value_heads
        if None in (self.vocab_size, self.hidden, layers, width, self.heads, kv_heads, self.key_value_heads):
            return None
        hidden, head_dim = self.hidden, self.head_dim or self.hidden // self.heads
        heads = self.heads * kv_heads // self.key_value_heads  # query heads per key/value head kept
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        if self.experts and self.expert_count:
            mlp = self.expert_count * (3 * hidden * width + hidden)
            mlp += 3 * hidden * self.shared_width + hidden if self.shared_width else 0
        else:
            mlp = 3 * hidden * width
        embeddings = self.vocab_size * hidden * (1 if self.tied else 2)
        return layers * (attention + mlp + 2 * hidden) + embeddings + hidden


def teacher_limits_problem(vocab: int | None, context: int | None, *, top_k: int, seq_len: int) -> str | None:
    """top_k within the vocabulary, seq_len within the context the teacher was trained for; -> why not, or None."""
    if vocab is not None and not 1 <= top_k <= vocab:
        return f"precompute.top_k={top_k} must be between 1 and the teacher's vocabulary size {vocab}"
    if context is not None and seq_len > context:
        return f"seq_len={seq_len} exceeds the teacher's context length (max_position_embeddings={context})"
    return None


def _cached_hub_file(repo: str, name: str, revision: str | None) -> str | None:
    """A file of a hub repository from the local Hugging Face cache (never the network), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo, name, revision=revision)
    except ValueError:  # not a hub id at all (HFValidationError): nothing of it can be cached
        return None
    return found if isinstance(found, str) else None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    return next((int(config[key]) for key in keys if isinstance(config.get(key), int)), None)


def read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{what}: cannot read {path}: {first_line(error)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} does not hold a JSON object")
    return data


def _gguf(path: str, what: str) -> dict[str, Any]:
    try:
        return gguf_summary(read_gguf_metadata(path, tensor_names=True))
    except (OSError, GGUFError) as error:
        raise ConfigError(f"{what}: cannot read the GGUF file {path}: {first_line(error)}") from None


def teacher_shape(teacher: TeacherConfig) -> ModelShape:
    """The teacher's vocabulary size and context length from its config (no weights); None where unknown."""
    local = check_teacher_files(teacher)
    if local is not None and teacher.gguf_file:
        path = os.path.join(local, teacher.gguf_file)
        summary = _gguf(path, "teacher.gguf_file")
        experts = (summary["expert_count"] or 0) > 1
        return ModelShape(summary["vocab_size"], summary["context_length"], path, summary["block_count"],
                          (summary["expert_feed_forward_length"] if experts else None)
                          or summary["feed_forward_length"], summary["head_count"],
                          summary["head_count_kv"] or summary["head_count"], experts, summary["embedding_length"],
                          summary["key_length"], summary["expert_count"] if experts else None,
                          summary["expert_shared_feed_forward_length"], summary["tied"])
    path = os.path.join(local, "config.json") if local is not None else _cached_hub_file(teacher.model, "config.json",
                                                                                        teacher.revision)
    if path is None or teacher.gguf_file:
        return ModelShape(None, None, teacher.model)  # not cached yet (or a GGUF on the hub): checked at load time
    config = read_json(path, "teacher.model")
    if "model_type" not in config and local is not None:
        raise ConfigError(f"teacher.model {teacher.model!r}: its config.json names no model_type: "
                          "not a transformers model")
    return config_shape(config, path)


def config_shape(config: dict[str, Any], source: str) -> ModelShape:
    """A transformers config.json's shape (a multimodal model's: its text model's)."""
    text = _text_config(config)
    count = _first(text, ("num_experts", "num_local_experts", "n_routed_experts"))
    experts = (count or 0) > 1
    width = _first(text, ("moe_intermediate_size",)) if experts else None
    heads = _first(text, _HEAD_KEYS)
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    return ModelShape(_first(text, _VOCAB_KEYS), _first(text, _CONTEXT_KEYS), source, _first(text, _LAYER_KEYS),
                      width or _first(text, _MLP_KEYS), heads, _first(text, ("num_key_value_heads",)) or heads,
                      experts, _first(text, ("hidden_size", "n_embd", "d_model")), _first(text, ("head_dim",)),
                      count if experts else None, _first(text, ("shared_expert_intermediate_size",)),
                      tied if isinstance(tied, bool) else None)


def model_folder_shape(source: str) -> ModelShape | None:
    """The shape of the model at `source` (a folder with config.json, or a hub id in the local cache), or None."""
    path = resolve_model_files(source)
    path = os.path.join(path, "config.json") if os.path.isdir(path) else _cached_hub_file(source, "config.json", None)
    if path is None or not os.path.isfile(path):
        return None
    return config_shape(read_json(path, source), path)


def tokenizer_vocab(source: str, gguf_file: str | None = None, revision: str | None = None) -> dict[str, int] | None:
    """token -> id of the tokenizer at `source` (a folder with tokenizer.json, a GGUF file in a folder, a cached
    hub id), read with the `tokenizers` library or from the GGUF metadata; None when it cannot be read cheaply."""
    path = resolve_model_files(source, gguf_file)
    if gguf_file:
        file = os.path.join(path, gguf_file)
        if not os.path.isfile(file):
            return None
        tokens = _gguf(file, "tokenizer").get("tokens")
        return {token: index for index, token in enumerate(tokens)} if tokens else None
    file = (os.path.join(path, "tokenizer.json") if os.path.isdir(path)
            else _cached_hub_file(source, "tokenizer.json", revision))
    if file is None or not os.path.isfile(file):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(file).get_vocab(with_added_tokens=True)
    except Exception as error:  # noqa: BLE001 - the Rust library raises its own exception type
        raise ConfigError(f"tokenizer {source!r}: cannot read {file}: {first_line(error)}") from None


def moved_tokens(mine: dict[str, int], theirs: dict[str, int]) -> int:
    """How many of `mine`'s tokens have another id (or none) in `theirs`: 0 when one vocabulary extends the other."""
    return sum(1 for token, index in mine.items() if theirs.get(token) != index)


def init_vocab_problem(init_from: str, run_vocab: dict[str, int], own: dict[str, int] | None) -> str | None:
    """Why a student whose tokenizer has vocabulary `own` cannot read the run's token ids, or None."""
    moved = moved_tokens(run_vocab, own) if own is not None else 0
    if not moved:
        return None
    return (f"student.init_from={init_from!r} has another vocabulary: {moved:,} of the run tokenizer's "
            f"{len(run_vocab):,} tokens have another id (or none) in its tokenizer ({len(own or {}):,} tokens); "
            "the student must read the teacher's token ids: start from a model of the teacher's tokenizer family, "
            "or leave init_from unset to build one from student.architecture")


def student_vocab_problem(init_from: str, run_vocab: dict[str, int] | None) -> str | None:
    """Why the model at `student.init_from` (a folder or a cached hub id) cannot read the run's token ids, or None
    (also when its files are not at hand: the training stage checks again when it loads the model).

    Its tokenizer must give every one of the run tokenizer's tokens the same id (special-token settings may differ:
    a base student of an instruction-tuned teacher's family), and its embedding must have a row for every id."""
    if run_vocab is None:
        return None
    setting = f"student.init_from={init_from!r}"
    problem = init_vocab_problem(init_from, run_vocab, tokenizer_vocab(init_from))
    if problem:
        return problem
    path = resolve_model_files(init_from)
    path = os.path.join(path, "config.json") if os.path.isdir(path) else _cached_hub_file(init_from, "config.json",
                                                                                          None)
    size = _first(_text_config(read_json(path, "student.init_from")), _VOCAB_KEYS) if path else None
    if size is not None and size < len(run_vocab):
        return (f"{setting} has vocab_size {size:,}, fewer than the run tokenizer's {len(run_vocab):,} ids: "
                "the student would have no embedding for the others")
    return None


def tokenizer_mismatch(tokenizer: str | None, teacher: TeacherConfig, load_vocab: Any = None) -> str | None:
    """Why an explicit `tokenizer:` cannot be used with this teacher (its ids would name other tokens), or None.

    Only the vocabularies (token -> id) are compared: they decide what an id means to the teacher; special-token
    settings differ harmlessly between saved copies of one tokenizer. `load_vocab(source, gguf_file)` is the
    fallback for a tokenizer without a tokenizer.json (loaded with transformers: slower)."""
    if tokenizer is None:
        return None
    mine = tokenizer_vocab(tokenizer)
    theirs = tokenizer_vocab(teacher.model, teacher.gguf_file, teacher.revision)
    if load_vocab is not None:
        mine = mine if mine is not None else load_vocab(tokenizer, None)
        theirs = theirs if theirs is not None else load_vocab(teacher.model, teacher.gguf_file)
    if mine is None or theirs is None or mine == theirs:
        return None
    moved = moved_tokens(mine, theirs)
    return (f"tokenizer {tokenizer!r} is not the teacher's own: {moved} of its {len(mine)} tokens "
            f"have another id (or none) in teacher.model {teacher.model!r} ({len(theirs)} tokens), "
            "so the teacher would read ids of another vocabulary; remove `tokenizer:` to use the teacher's tokenizer")
