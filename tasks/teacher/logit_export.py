"""`kdflow store export`: a top-K store -> Parquet shards in a declared logit layout (kdflow.schemas.logit_layouts)
that `datasets.load_dataset("parquet", data_files=...)` reads, one file per store shard (no Prefect).

Each row holds the token ids, the decoded top-K ids and log-probs (v2 sqrt-coded values as they decode; adaptive K
pads with id -1 and log-prob -inf) and, where the layout has a tail column, the log of the mass outside them.
Files appear whole (written under a temporary name, then renamed); `kdflow_export.json` beside them says what
store they came from.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kdflow.schemas.commits import list_commits, read_complete, stage_dir
from kdflow.schemas.errors import ConfigError, StoreError
from kdflow.schemas.logit_layouts import LogitLayout, logit_layout
from kdflow.schemas.shards import TopkShard, read_token_shard
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.store_info import alignment_problem, read_store_info, topk_tags

EXPORT_INFO = "kdflow_export.json"


def _nested(values: np.ndarray) -> pa.Array:
    """(n, d1, ..., dk) -> n rows of nested lists (fixed sizes, so no offsets are stored per row)."""
    array = pa.array(np.ascontiguousarray(values).ravel())
    for size in reversed(values.shape[1:]):
        array = pa.FixedSizeListArray.from_arrays(array, size)
    return array


def layout_table(layout: LogitLayout, input_ids: np.ndarray, ids: np.ndarray, logprobs: np.ndarray,
                 tail: np.ndarray) -> pa.Table:
    """One shard's arrays as a table in `layout`."""
    columns: dict[str, pa.Array] = {layout.tokens: _nested(input_ids.astype(np.int32))}
    if layout.stacked is not None:
        pair = [ids.astype(np.float32), logprobs.astype(np.float32)]
        columns[layout.stacked] = _nested(np.stack(pair if layout.stacked_order == "ids_first" else pair[::-1], axis=2))
    else:
        columns[layout.ids] = _nested(ids.astype(np.int32))
        columns[layout.values] = _nested(logprobs.astype(np.float32))
    if layout.tail is not None:
        columns[layout.tail] = _nested(tail.astype(np.float32))
    return pa.table(columns)


def _pick_tag(run_root: RunRoot, tag: str | None) -> str:
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


def export_store(url: str, out_dir: str, tag: str | None = None, layout_name: str = "kdflow") -> dict[str, Any]:
    """Write store `tag` of run root `url` (default: its only store) to `out_dir`; -> a summary."""
    layout = logit_layout(layout_name)
    run_root = RunRoot(url)
    tag = _pick_tag(run_root, tag)
    store, tokens_store = stage_dir(run_root, "topk", tag), stage_dir(run_root, "tokens")
    info = read_store_info(run_root, store)
    if info is not None and info.targets != "topk":
        raise ConfigError(f"top-K store {tag} holds {info.targets} targets; export writes top-K stores only")
    done = read_complete(run_root, store)
    if done is None:
        raise StoreError(f"top-K store {run_root.display(store)} is not complete; finish precompute first")
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
    os.makedirs(os.path.join(out_dir, "data"), exist_ok=True)
    files = []
    for shard_id, record, token in pairs:
        decoded = TopkShard(run_root, f"{store}/{record.data_file}").read()
        input_ids = read_token_shard(run_root, f"{tokens_store}/{token.data_file}")
        name = os.path.join("data", f"train-{shard_id:05d}-of-{done.shards:05d}.parquet")
        target = os.path.join(out_dir, name)
        temporary = os.path.join(out_dir, "data", f".{os.path.basename(name)}.tmp-{os.getpid()}")
        pq.write_table(layout_table(layout, input_ids, decoded.ids, decoded.logprobs, decoded.tail), temporary,
                       compression="zstd")
        os.replace(temporary, target)
        files.append(name)
    summary = {"tag": tag, "layout": layout.name, "files": files, "rows": done.rows, "shards": done.shards,
               "seq_len": info.seq_len if info else None, "top_k": info.top_k if info else None,
               "store": info.store_format() if info else None,
               "teacher": info.teacher if info else None, "tail": "stored" if layout.tail else "not exported"}
    with open(os.path.join(out_dir, EXPORT_INFO), "w") as handle:
        json.dump(summary, handle, indent=1)
    return summary
