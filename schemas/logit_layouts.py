"""Column layouts of teacher-target datasets: what `kdflow store import` reads and `kdflow store export` writes.

A layout is data, not code: which column holds each role (the token ids; the top-K ids and their values, or one
stacked column holding both; optionally the tail, a target mask, an attention mask and the text) and what the values
are (`kind`). The built-ins below are instances, each naming the public source its shape was taken from; a user
declares another in a small YAML file (keys = the field names) or with `--column ROLE=NAME` options, so a new
dataset needs no code. The reader that applies a layout is kdflow.tasks.teacher.logit_dataset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kdflow.schemas.errors import ConfigError

# distillkit: its packed bytes (distillkit.py); probabilities: p over the full vocabulary, read as log p
KINDS = ("logprobs", "probabilities", "renormalised", "logits", "distillkit")
TAIL_KINDS = ("logprobs", "probabilities")  # over the full vocabulary: the mass outside the K is known
STACKED_ORDERS = ("ids_first", "values_first")
# The roles a column can play; the other fields say what the values are, or name and document the layout.
ROLES = ("tokens", "ids", "values", "stacked", "tail", "target_mask", "attention_mask", "text")


@dataclass(frozen=True)
class LogitLayout:
    """Where a dataset keeps a row's token ids, top-K ids and values, masks, tail and text (column names)."""

    name: str
    description: str = ""
    tokens: str = ""  # [T] token ids
    ids: str | None = None  # [T][K] teacher token ids, by descending value
    values: str | None = None  # [T][K] their values, of kind `kind`
    stacked: str | None = None  # [T][2][K]: ids and values in one column (instead of ids + values)
    stacked_order: str = "ids_first"  # or "values_first": which of the pair comes first
    # logprobs (over the full vocabulary) | probabilities (over it too) | renormalised (log-probs over the K) | logits
    kind: str = "logprobs"
    tail: str | None = None  # [T] the teacher's mass outside the K ids (its log; kind probabilities: itself);
    # absent: 1 - sum(p) is used
    target_mask: str | None = None  # [T] or [T][K]: nonzero where the position has a teacher target
    attention_mask: str | None = None  # [T] 0 marks padding positions, dropped on import
    text: str | None = None  # the text the token ids encode, checked with the tokenizer when present
    source: str = ""  # where this layout's shape is documented (built-ins)

    def __post_init__(self) -> None:
        where = f"layout {self.name}"
        if not self.tokens:
            raise ConfigError(f"{where}: name the column of the token ids (tokens)")
        if self.stacked is not None and (self.ids is not None or self.values is not None):
            raise ConfigError(f"{where}: declare either `stacked` or `ids` and `values`, not both")
        if self.stacked is None and (self.ids is None or self.values is None):
            missing = "ids" if self.ids is None else "values"
            raise ConfigError(f"{where}: name the column of the {missing} (or one `stacked` column of both)")
        if self.stacked_order not in STACKED_ORDERS:
            raise ConfigError(f"{where}: stacked_order must be one of {', '.join(STACKED_ORDERS)}, "
                              f"not {self.stacked_order!r}")
        if self.kind not in KINDS:
            raise ConfigError(f"{where}: kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.tail is not None and not self.has_tail_kind:
            # A tail is the mass outside the K of a full-vocabulary distribution; renormalised values and raw
            # logits have no such distribution, so a tail column beside them cannot mean what the store says.
            raise ConfigError(f"{where}: a tail column needs kind logprobs or probabilities (kind {self.kind} has "
                              "no known tail)")
        named = [getattr(self, role) for role in ROLES if getattr(self, role) is not None]
        repeated = sorted({column for column in named if named.count(column) > 1})
        if repeated:
            raise ConfigError(f"{where}: column {repeated[0]!r} is named for two roles")

    @property
    def has_tail_kind(self) -> bool:
        return self.kind in TAIL_KINDS

    def target_fields(self) -> tuple[str, ...]:
        return (self.stacked,) if self.stacked is not None else (self.ids, self.values)

    def required(self) -> tuple[str, ...]:
        return (self.tokens, *self.target_fields())

    def declared(self) -> dict[str, Any]:
        """The layout as the YAML mapping that declares it (what an import records)."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value not in (None, "")}


LAYOUTS: dict[str, LogitLayout] = {layout.name: layout for layout in (
    LogitLayout("kdflow", "what `kdflow store export` writes: input_ids, topk_ids, topk_logprobs, tail_logprob",
                tokens="input_ids", ids="topk_ids", values="topk_logprobs", tail="tail_logprob", text="text",
                source="docs/formats.md, `kdflow store export`"),
    LogitLayout("stacked", "`inputs [T]` and `targets [T, 2, K]` with the log-probs first, then the ids",
                tokens="inputs", stacked="targets", stacked_order="values_first",
                source="the dataset card and viewer of huggingface.co/datasets/codys12/LlamaKD (top-32 log-probs "
                       "of Llama 3.1 405B on FineWeb-Edu: inputs [1024], targets [1024, 2, 32], log-probs first)"),
    LogitLayout("axolotl", "axolotl's prepared KD rows: input_ids, target_token_ids, target_logprobs renormalised "
                "over the K (-inf on prompt padding), target_mask [T][K]",
                tokens="input_ids", ids="target_token_ids", values="target_logprobs", kind="renormalised",
                target_mask="target_mask", attention_mask="attention_mask",
                source="axolotl src/axolotl/integrations/kd/chat_template.py (transform_logprobs) and "
                       "topk_logprob/forward_kl.py (the loss reads target_mask [B, T, K])"),
    LogitLayout("distillkit", "DistillKit's packed captures: input_ids, compressed_logprobs, bytepacked_indices "
                "(decoded with the capture's compression_config.yaml)",
                tokens="input_ids", ids="bytepacked_indices", values="compressed_logprobs", kind="distillkit",
                attention_mask="attention_mask",
                source="arcee-ai/DistillKit at commit a61c2e7 (its logprob compressor; docs/formats.md)"),
    LogitLayout("logits", "top-K raw logits: input_ids, attention_mask, token_ids, top_values (logits)",
                tokens="input_ids", ids="token_ids", values="top_values", kind="logits",
                attention_mask="attention_mask",
                source="the viewer of huggingface.co/datasets/arcee-ai/LLama-405B-Logits (input_ids, attention_mask, "
                       "token_ids [T][K], top_values [T][K] raw logits of Llama 3.1 405B)"),
)}


def logit_layout(name: str) -> LogitLayout:
    """The built-in layout called `name`; a ConfigError naming the known ones otherwise."""
    if name not in LAYOUTS:
        raise ConfigError(f"unknown logit layout {name!r}; known: {', '.join(sorted(LAYOUTS))} "
                          "(or a YAML file that declares one)")
    return LAYOUTS[name]


def layout_from_mapping(data: Any, name: str) -> LogitLayout:
    """A layout declared as a mapping of field names (a YAML file's or the command line's); unknown keys and a
    missing column role are one-line ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(f"layout {name}: a mapping of field names to columns, not {type(data).__name__}")
    fields = [field.name for field in dataclasses.fields(LogitLayout)]
    unknown = sorted(str(key) for key in data if key not in fields)
    if unknown:
        raise ConfigError(f"layout {name}: unknown key {unknown[0]!r}; known: {', '.join(fields)}")
    wrong = [key for key, value in data.items() if value is not None and not isinstance(value, str)]
    if wrong:
        raise ConfigError(f"layout {name}: {wrong[0]} must be a column name or word, not {data[wrong[0]]!r}")
    return LogitLayout(**{"name": name, **data})


def read_layout_file(path: str) -> LogitLayout:
    """The layout a YAML file declares (its name: the file's stem unless it says `name:`)."""
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read layout file {path!r}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"layout file {path!r} is not YAML: {str(error).splitlines()[0]}") from None
    if isinstance(data, dict) and "name" not in data:
        data = {"name": file.stem, **data}
    return layout_from_mapping(data, data.get("name", file.stem) if isinstance(data, dict) else file.stem)


def declare_layout(layout: str | None, columns: dict[str, str | None], **settings: str | None) -> LogitLayout:
    """The layout a command line declares: `layout` (a built-in's name or a YAML file, or None to declare it all)
    with `columns` (role -> column; None or "" removes the role) and `settings` (kind, stacked_order) over it."""
    unknown = sorted(role for role in columns if role not in ROLES)
    if unknown:
        raise ConfigError(f"--column {unknown[0]}=...: unknown role; roles: {', '.join(ROLES)}")
    base: dict[str, Any] = {}
    name = "declared"
    if layout is not None:
        looks_like_file = layout.lower().endswith((".yaml", ".yml")) or Path(layout).is_file()
        start = read_layout_file(layout) if looks_like_file else logit_layout(layout)
        base, name = start.declared(), start.name
        for field in ("name", "description", "source"):
            base.pop(field, None)
    changes = {role: column or None for role, column in columns.items()}
    changes.update({key: value for key, value in settings.items() if value is not None})
    if changes.get("kind", "logprobs") != "logprobs" and "tail" not in columns:
        base.pop("tail", None)  # a base's tail means nothing beside renormalised values or logits
    if layout is not None and not changes:
        return start
    return layout_from_mapping({**base, **changes}, name if layout is None else f"{name}+options")


def resolve_layout(layout: str | LogitLayout) -> LogitLayout:
    """A layout given by name (a built-in, or a YAML file's path) or already declared."""
    if isinstance(layout, LogitLayout):
        return layout
    return declare_layout(layout, {})
