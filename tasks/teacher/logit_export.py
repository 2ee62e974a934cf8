"""`kdflow store export`: a top-K store -> Parquet shards in a declared logit layout (kdflow.schemas.logit_layouts)
that `datasets.load_dataset("parquet", data_files=...)` reads, one file per store shard (no Prefect).

What each column holds follows the layout's fields, not its name, so that the trainer the layout comes from reads
the rows as its own:
- `kind` logprobs: the store's log-probs over the full vocabulary as they decode (a v2 sqrt store exports its
  levels' values), and the tail column where the layout has one;
- `kind` probabilities: their exponentials (0 where a log-prob is -inf), the tail as a probability mass too;
- `kind` renormalised: log-probs renormalised over the K ids (their probabilities sum to 1), as axolotl's prepared
  rows hold them;
- `kind` logits: values whose log-softmax over the K is that renormalised distribution (the log-probs themselves:
  a log-prob is a logit less a per-position constant, which a log-softmax removes);
- `stacked`: ids and values in one `[T][2][K]` column, in the layout's `stacked_order`;
- `target_mask`: one 0/1 flag per id, `[T][K]`, the shape axolotl's collator pads and its loss indexes with: 0
  where the position has no teacher target (its values are -inf there) and on adaptive K's padded entries;
- `attention_mask`: all ones (a store row has no padding positions).
Where a layout has a mask column, ids it masks hold valid placeholders (0..K-1 on a position without target, 0 on
padded entries), because a trainer gathers the student's logits at every id before it applies the mask; elsewhere
padding is id -1, value -inf. A store whose positions lack targets exports only to a layout with a mask column,
and a store renormalised over the K (no tail) only to the renormalised and logits kinds: nothing is presented as
what it is not. Files appear whole (written under a temporary name, then renamed); `kdflow_export.json` beside
them says what store they came from.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kdflow.schemas.commits import list_commits, read_complete, stage_dir
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.logit_layouts import LogitLayout, resolve_layout
from kdflow.schemas.shards import TopkShard, read_token_shard
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_info import alignment_problem, filled_by, read_store_info, topk_tags
from kdflow.tasks.common.model_files import shown_name
from kdflow.tasks.teacher.distillkit import distillkit_table
from kdflow.tasks.teacher.distillkit_settings import (SETTINGS_FILE, lossless_settings, read_distillkit_settings,
                                                      write_distillkit_settings)

EXPORT_INFO = "kdflow_export.json"
FULL = "full"  # the store's log-probs are over the whole vocabulary, its tail known
TOP_K = "top_k"  # the store's log-probs are renormalised over the K kept ids; it has no tail
EXACT_IDS = 2 ** 24  # float32 holds every whole number below this exactly: the stacked column's ids


def _nested(values: np.ndarray) -> pa.Array:
    """(n, d1, ..., dk) -> n rows of nested lists (fixed sizes, so no offsets are stored per row)."""
    array = pa.array(np.ascontiguousarray(values).ravel())
    for size in reversed(values.shape[1:]):
        array = pa.FixedSizeListArray.from_arrays(array, size)
    return array


def renormalised(logprobs: np.ndarray) -> np.ndarray:
    """(..., K) log-probs -> log-probs over the K alone (-inf entries stay -inf; a position all -inf stays so)."""
    logprobs = logprobs.astype(np.float64)
    top = np.max(logprobs, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # a position all -inf: log(0), then -inf - -inf
        log_mass = np.log(np.exp(logprobs - top).sum(axis=-1, keepdims=True)) + top
        return np.where(np.isfinite(log_mass), logprobs - log_mass, -np.inf).astype(np.float32)


def export_problem(layout: LogitLayout, normalisation: str, masked: bool) -> str | None:
    """Why a store of `normalisation` (with positions lacking targets when `masked`) cannot be written in
    `layout` without presenting its values as what they are not; None when it can."""
    if normalisation == TOP_K and (layout.has_tail_kind or layout.kind == "distillkit" or layout.tail is not None):
        return (f"its log-probs are renormalised over the K ids (no tail), layout {layout.name} declares log-probs "
                "over the full vocabulary" + (" and a tail" if layout.tail is not None else "")
                + "; export to a renormalised or logits layout")
    if masked and layout.target_mask is None and layout.kind != "distillkit":  # DistillKit's rows mask by labels
        return (f"it has positions without a teacher target (prompt or masked) and layout {layout.name} has no "
                "target_mask column to say so; export to a layout with one")
    return None


def layout_table(layout: LogitLayout, input_ids: np.ndarray, ids: np.ndarray, logprobs: np.ndarray,
                 tail: np.ndarray | None, target: np.ndarray | None = None) -> pa.Table:
    """One shard's decoded arrays as a table in `layout`: input_ids (n, T), ids (n, T, K) with -1 padding,
    logprobs (n, T, K) with -inf padding (over the full vocabulary, or over the K for a top_k store), tail (n, T)
    or None, target (n, T) bool or None (every position has a target). Checks are export_problem's."""
    present = ids >= 0  # (n, T, K): real entries
    if target is not None:
        present &= target[..., None]
    values = np.where(present, logprobs.astype(np.float32), -np.inf).astype(np.float32)
    if layout.kind == "renormalised":
        values = renormalised(values)
    elif layout.kind == "probabilities":  # -inf padding becomes 0
        values = np.exp(values)
        tail = None if tail is None else np.exp(np.asarray(tail, dtype=np.float32))
    if layout.target_mask is not None:  # placeholders a trainer can gather at; the mask hides them
        placeholder = np.broadcast_to(np.arange(ids.shape[-1], dtype=np.int32), ids.shape)
        has_target = present.any(axis=-1, keepdims=True)
        ids = np.where(present, ids, np.where(has_target, 0, placeholder))
    else:
        ids = np.where(present, ids, -1)
    columns: dict[str, pa.Array] = {layout.tokens: _nested(input_ids.astype(np.int32))}
    if layout.stacked is not None:
        if ids.size and int(ids.max()) >= EXACT_IDS:
            raise ConfigError(f"layout {layout.name} stores ids as float32, exact only below {EXACT_IDS}")
        pair = (ids.astype(np.float32), values)
        columns[layout.stacked] = _nested(np.stack(pair if layout.stacked_order == "ids_first" else pair[::-1],
                                                   axis=2))
    else:
        columns[layout.ids] = _nested(ids.astype(np.int32))
        columns[layout.values] = _nested(values)
    if layout.tail is not None:
        columns[layout.tail] = _nested(np.asarray(tail, dtype=np.float32))
    if layout.target_mask is not None:
        columns[layout.target_mask] = _nested(present.astype(np.int8))
    if layout.attention_mask is not None:
        columns[layout.attention_mask] = _nested(np.ones(input_ids.shape, np.int8))
    return pa.table(columns)


def _store_normalisation(shard: TopkShard) -> str:
    """The store's normalisation, from its codec (a store without one, v1 or v2 before masks, is full)."""
    return getattr(shard.codec, "normalisation", FULL)


def _shown_teacher(teacher: dict[str, Any]) -> dict[str, Any]:
    """The store's teacher for `kdflow_export.json`, which travels with the export: a local folder by its name only."""
    model = teacher.get("model")
    return teacher | ({"model": shown_name(model)} if isinstance(model, str) else {})


def _target(decoded: Any) -> np.ndarray | None:
    """The decoded rows' target mask (n, T) bool, or None where the store keeps none (every position has one)."""
    return getattr(decoded, "target", None)


def _pick_tag(run_root: RunRoot, tag: str | None) -> str:
    if not run_root.exists(run_root.root):  # it said "the precompute stage has not written one yet"
        raise StoreError(f"run root {run_root.display(run_root.root)} does not exist")
    tags = topk_tags(run_root)
    if tag is not None:
        if tag not in tags:
            raise StoreError(f"no top-K store {tag} under {run_root.display(run_root.path('topk'))}")
        return tag
    if not tags:
        raise StoreError(f"no top-K store under {run_root.display(run_root.path('topk'))}: the precompute stage has "
                         "not written one yet")
    if len(tags) != 1:
        raise ConfigError(f"{run_root.display(run_root.path('topk'))} holds {len(tags)} top-K stores "
                          f"({', '.join(tags) or 'none'}); name one with --tag")
    return tags[0]


def export_store(url: str, out_dir: str, tag: str | None = None, layout: LogitLayout | str = "kdflow", *,
                 distillkit_settings: str | None = None) -> dict[str, Any]:
    """Write store `tag` of run root `url` (default: its only store) to `out_dir` in `layout` (a declared layout or
    a built-in's name); -> a summary. DistillKit's packed layout is written with the compressor settings of the file
    `distillkit_settings` (default: lossless, kdflow.tasks.teacher.distillkit_settings), saved beside the data."""
    layout = resolve_layout(layout)  # a built-in's name, a YAML file's path, or declared
    if distillkit_settings and layout.kind != "distillkit":
        raise ConfigError(f"--distillkit-settings applies to DistillKit's packed layout (--layout distillkit), not "
                          f"{layout.name}: remove it")
    run_root = RunRoot(url)
    tag = _pick_tag(run_root, tag)
    store, tokens_store = stage_dir(run_root, "topk", tag), stage_dir(run_root, "tokens")
    info = read_store_info(run_root, store)
    if info is not None and info.targets != "topk":
        raise ConfigError(f"top-K store {tag} holds {info.targets} targets; export writes top-K stores only")
    done = read_complete(run_root, store)
    if done is None:
        raise StoreError(f"top-K store {run_root.display(store)} is not complete; finish "
                         f"{filled_by(info)} first")
    tokens_done = read_complete(run_root, tokens_store)
    token_records = list_commits(run_root, tokens_store, "tokens", tokens_done.fingerprint if tokens_done else None)
    records = list_commits(run_root, store, "topk", done.fingerprint)
    pairs = []
    for shard_id in range(done.shards):  # every shard checked before anything is written
        record, token = records.get(shard_id), token_records.get(shard_id)
        problem = "is not committed" if record is None else alignment_problem(token, record)
        if problem is not None:
            raise StoreError(f"top-K shard {shard_id} of {run_root.display(store)} {problem}; export writes a store "
                             "whose shards are the teacher's output on today's token shards (kdflow validate)")
        pairs.append((shard_id, record, token))
    first = TopkShard(run_root, f"{store}/{pairs[0][1].data_file}") if pairs else None
    normalisation = FULL if first is None else _store_normalisation(first)
    masked = first is not None and bool(getattr(first.codec, "masked", False))
    problem = export_problem(layout, normalisation, masked)
    if problem is not None:
        raise ConfigError(f"top-K store {tag} cannot be exported in layout {layout.name}: {problem}")
    packed = None
    if layout.kind == "distillkit":
        vocab = (pairs[0][1].extra.vocab_size or getattr(first.codec, "vocab_size", None)
                 or getattr(getattr(tokens_done, "extra", None), "vocab_size", None))
        if not distillkit_settings and vocab is None:
            raise ConfigError(f"top-K store {tag} does not record the teacher's vocabulary size, which DistillKit's "
                              "lossless settings need; give --distillkit-settings FILE")
        packed = (read_distillkit_settings(distillkit_settings) if distillkit_settings
                  else lossless_settings(vocab, first.read([0]).ids.shape[-1]))
    _check_out_dir(out_dir, tag, layout.name, done.shards)
    os.makedirs(os.path.join(out_dir, "data"), exist_ok=True)
    files = []
    for shard_id, record, token in pairs:
        decoded = TopkShard(run_root, f"{store}/{record.data_file}").read()
        input_ids = read_token_shard(run_root, f"{tokens_store}/{token.data_file}")
        name = os.path.join("data", f"train-{shard_id:05d}-of-{done.shards:05d}.parquet")
        target = os.path.join(out_dir, name)
        temporary = os.path.join(out_dir, "data", f".{os.path.basename(name)}.tmp-{os.getpid()}")
        tail = decoded.tail if normalisation == FULL else None
        if packed is None:
            table = layout_table(layout, input_ids, decoded.ids, decoded.logprobs, tail, _target(decoded))
        else:
            table = distillkit_table(input_ids, decoded.ids, decoded.logprobs, packed, target=_target(decoded))
        pq.write_table(table, temporary, compression="zstd")
        os.replace(temporary, target)
        files.append(name)
    summary = {"tag": tag, "layout": layout.name, "kind": layout.kind, "files": files, "rows": done.rows,
               "shards": done.shards, "seq_len": info.seq_len if info else None,
               "top_k": info.top_k if info else None, "store": info.store_format() if info else None,
               "normalisation": normalisation, "teacher": _shown_teacher(info.teacher) if info else None,
               "tail": "stored" if layout.tail else "not exported",
               "target_mask": "exported" if layout.target_mask else "not exported"}
    if packed is not None:
        write_distillkit_settings(packed, out_dir)
    with open(os.path.join(out_dir, EXPORT_INFO), "w") as handle:
        json.dump(summary, handle, indent=1)
    return summary


def _check_out_dir(out_dir: str, tag: str, layout: str, shards: int) -> None:
    """An export goes into an empty folder, or over an earlier (or killed) export of the same store and layout:
    never beside other files, which a reader of the folder would take for rows of this store."""
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    own = re.compile(rf"^(train-\d{{5}}-of-{shards:05d}\.parquet|\.train-\d{{5}}-of-{shards:05d}\.parquet\.tmp-\d+)$")
    data = os.path.join(out_dir, "data")
    strays = sorted(set(os.listdir(out_dir)) - {"data", EXPORT_INFO, SETTINGS_FILE})
    strays += [] if not os.path.isdir(data) else [f"data/{n}" for n in sorted(os.listdir(data)) if not own.match(n)]
    earlier = os.path.join(out_dir, EXPORT_INFO)
    if not strays and os.path.exists(earlier):
        with open(earlier) as handle:
            record = json.load(handle)
        if (record.get("tag"), record.get("layout")) != (tag, layout):
            strays = [f"an export of store {record.get('tag')} in layout {record.get('layout')}"]
    if strays:
        raise ConfigError(f"export folder {out_dir} holds {strays[0]}" + (f" and {len(strays) - 1} more" if len(
            strays) > 1 else "") + ", which is not this export's: export into an empty or new folder")
