"""Contracts between whole stores: what made a top-K store (`_store.json`), which stores a config may read,
and the one check that top-K shard i was made from token shard i.

Precompute writes `_store.json` into every top-K store it makes; the student's data loader, the fan-out flow
and `kdflow validate` read it, and check alignment with `alignment_problem`, without loading a teacher.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kdflow.schemas.commits import CommitRecord, read_complete, stage_dir
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.layout import STORE_FILE, TOPK_DIR, is_store_name
from kdflow.schemas.storage import RunRoot


class TopkStoreInfo(BaseModel):
    """`topk/TAG/_store.json`: the inputs and settings that made the store (unknown keys are kept)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    tag: str
    teacher_fingerprint: str
    tokens_fingerprint: str
    teacher: dict[str, Any]  # the teacher config section, without `device` (which does not change the numbers)
    teacher_identity: dict[str, Any]  # weights, dtype, quantisation
    top_k: int
    logprobs_dtype: str
    seq_len: int


def teacher_section(config: KDFlowConfig) -> dict[str, Any]:
    """The teacher settings a store records and is matched by."""
    return config.teacher.model_dump(mode="json", exclude={"device"})


def write_store_info(run_root: RunRoot, store: str, info: TopkStoreInfo) -> None:
    run_root.write_bytes_atomic(f"{store}/{STORE_FILE}", info.model_dump_json(indent=1).encode())


def read_store_info(run_root: RunRoot, store: str) -> TopkStoreInfo | None:
    """The store's `_store.json`, or None when it has none (or an unreadable one: a store of another tool)."""
    try:
        return TopkStoreInfo.model_validate_json(run_root.read_bytes(f"{store}/{STORE_FILE}"))
    except (FileNotFoundError, ValidationError, ValueError):
        return None


def topk_tags(run_root: RunRoot) -> list[str]:
    """The names under topk/ that are stores (not hidden or bookkeeping entries)."""
    return [tag for tag in run_root.listdir(run_root.path(TOPK_DIR)) if is_store_name(tag)]


def find_topk_stores(run_root: RunRoot, config: KDFlowConfig) -> list[str]:
    """Tags of the top-K stores made for this config's teacher, K and token store, read from their _store.json
    (no teacher loaded; with teacher.dtype auto, a CPU and a GPU host make two)."""
    tokens_done = read_complete(run_root, stage_dir(run_root, "tokens"))
    if tokens_done is None:
        return []
    teacher = teacher_section(config)
    tags = []
    for tag in topk_tags(run_root):
        info = read_store_info(run_root, stage_dir(run_root, "topk", tag))
        if (info is not None and info.tokens_fingerprint == tokens_done.fingerprint and info.teacher == teacher
                and info.top_k == config.precompute.top_k and info.logprobs_dtype == config.precompute.logprobs_dtype):
            tags.append(tag)
    return tags


def alignment_problem(token: CommitRecord | None, topk: CommitRecord) -> str | None:
    """Why top-K shard i is not the teacher's output on token shard i (same input bytes, same rows), or None.

    The reason reads after "the top-K shard": "... was made from another token shard (...)"."""
    if token is None:
        return f"has no valid token shard {topk.shard_id} to align with"
    if topk.input_sha256 != token.sha256:
        return (f"was made from another token shard (input sha256 {str(topk.input_sha256)[:12]}, token shard {token.shard_id} "
                f"has {token.sha256[:12]})")
    if topk.rows != token.rows:
        return f"has {topk.rows} rows, token shard {token.shard_id} has {token.rows}"
    return None
