"""Column layouts of public top-K logit datasets: what `kdflow store import` reads and `kdflow store export` writes.

A layout is declared, not coded: the column of the token ids, and either one column of ids and one of log-probs
(each `[T][K]`) or one stacked column `[T][2][K]` (ids in row 0, stored as numbers, log-probs in row 1), plus an
optional tail column (`[T]`, log of the mass outside the K ids) and an optional text column (checked against the
tokenizer). The importer and exporter (kdflow.tasks.teacher.logit_import / logit_export) read only this table.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdflow.schemas.errors import ConfigError


@dataclass(frozen=True)
class LogitLayout:
    """Where a dataset keeps a row's token ids, top-K ids, log-probs, tail and text (column names)."""

    name: str
    description: str
    tokens: str  # [T] token ids
    ids: str | None = None  # [T][K] teacher token ids, by descending value
    values: str | None = None  # [T][K] their values, of kind `kind`
    stacked: str | None = None  # [T][2][K]: ids and values in one column (instead of ids + values)
    stacked_order: str = "ids_first"  # or "values_first": which of the pair comes first
    kind: str = "logprobs"  # logprobs (over the full vocabulary) | renormalised (log-probs over the K) | logits
    tail: str | None = None  # [T] log of the teacher's mass outside the K ids; absent: 1 - sum(p) is used
    target_mask: str | None = None  # [T] 1 where the position has a teacher target (0: prompt, masked)
    attention_mask: str | None = None  # [T] 0 marks padding positions, dropped on import
    text: str | None = None  # the text the token ids encode, checked with the tokenizer when present
    source: str = ""  # where this layout is documented (built-ins)

    def __post_init__(self) -> None:
        if (self.stacked is None) == (self.ids is None or self.values is None):
            raise ValueError(f"layout {self.name}: declare `stacked` or both `ids` and `values`")
        if self.stacked_order not in ("ids_first", "values_first"):
            raise ValueError(f"layout {self.name}: stacked_order must be ids_first or values_first")
        if self.kind not in ("logprobs", "renormalised", "logits"):
            raise ValueError(f"layout {self.name}: kind must be logprobs, renormalised or logits")

    def target_fields(self) -> tuple[str, ...]:
        return (self.stacked,) if self.stacked is not None else (self.ids, self.values)

    def required(self) -> tuple[str, ...]:
        return (self.tokens, *self.target_fields())


LAYOUTS: dict[str, LogitLayout] = {layout.name: layout for layout in (
    LogitLayout("kdflow", "what `kdflow store export` writes: input_ids, topk_ids, topk_logprobs, tail_logprob",
                tokens="input_ids", ids="topk_ids", values="topk_logprobs", tail="tail_logprob", text="text"),
    LogitLayout("stacked", "public logit datasets with `inputs [T]` and `targets [T, 2, K]` (ids, log-probs)",
                tokens="inputs", stacked="targets"),
    LogitLayout("axolotl", "the KD plugin layout of axolotl: input_ids, target_token_ids, target_logprobs",
                tokens="input_ids", ids="target_token_ids", values="target_logprobs"),
)}


def logit_layout(name: str) -> LogitLayout:
    """The declared layout called `name`; a ConfigError naming the known ones otherwise."""
    if name not in LAYOUTS:
        raise ConfigError(f"unknown logit layout {name!r}; known: {', '.join(sorted(LAYOUTS))}")
    return LAYOUTS[name]
