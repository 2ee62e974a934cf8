"""The fault tests' tiny run: one token store and one uninterrupted top-K store to copy, and checks that a
store ends byte-identical to it; the teacher worker and the config file of a run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdflow.schemas.commits import list_commits
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import dump_config
from kdflow.schemas.layout import commit_file_name, data_file_name
from kdflow.schemas.storage import RunRoot, sha256_of
from support.corpus import sample_documents, write_jsonl
from support.runs import prepare
from support.tiny import tiny_config

REPO = Path(__file__).resolve().parents[2]
# besides shard-N.arrow, .commit.json
STORE_FILES = {"_complete.json", "_store.json", "config.yaml", "_renumbering.bin"}
SECRET = "sekrit-value"


@dataclass(frozen=True)
class Prepared:
    base: Path  # base/tokens-only: corpus + tokens; base/reference: the same plus an uninterrupted top-K store
    corpus: Path
    teacher: Path
    tag: str
    shards: int
    reference: dict[str, str]  # data file name -> sha256 of the uninterrupted run's top-K shard


def fault_config(run_root: Path, teacher: Path, corpus: Path, **overrides: Any) -> KDFlowConfig:
    """The tiny run of conftest's make_config (seq_len 32, K 8, 8 sequences a shard), dotted overrides `a__b=v`."""
    base = {"precompute__max_attempts": 3, "precompute__retry_delay_s": 0, "student__steps": 6,
            "student__save_every": 2}
    return tiny_config(run_root, teacher, corpus, **base | overrides)


def data_hashes(store: Path) -> dict[str, str]:
    """sha256 of every top-K data file actually on disk (not what the records claim)."""
    return {p.name: sha256_of(RunRoot(str(store.parent)), str(p)) for p in sorted(store.glob("shard-*.arrow"))}


def build_prepared(base: Path, teacher: Path) -> Prepared:
    """base/tokens-only (corpus + tokens, >= 4 shards) and base/reference (the same plus an uninterrupted top-K)."""
    from kdflow.schemas.stage_settings import open_run_root, teacher_pass_settings
    from kdflow.tasks.teacher.precompute import precompute_shards

    corpus = write_jsonl(base / "docs.jsonl", sample_documents(16))
    prepare(fault_config(base / "tokens-only", teacher, corpus))
    shutil.copytree(base / "tokens-only", base / "reference")
    reference_config = fault_config(base / "reference", teacher, corpus)
    summary = precompute_shards(open_run_root(reference_config), teacher_pass_settings(reference_config))
    reference = data_hashes(base / "reference" / "topk" / summary["tag"])
    assert summary["complete"] and len(reference) == summary["shards"] >= 4
    return Prepared(base, corpus, teacher, summary["tag"], summary["shards"], reference)


def topk_store(config: KDFlowConfig, prepared: Prepared) -> Path:
    return Path(config.run_root) / "topk" / prepared.tag


def shard_files(ids: Iterable[int]) -> set[str]:
    return {name for i in ids for name in (data_file_name("topk", i), commit_file_name("topk", i))}


def assert_clean_and_identical(config: KDFlowConfig, prepared: Prepared) -> None:
    """Exactly one data file and one valid commit record per shard, nothing else (no temp file, lease or orphan),
    and every data file byte-identical to the uninterrupted run's."""
    store = topk_store(config, prepared)
    assert {p.name for p in store.iterdir()} == shard_files(range(prepared.shards)) | STORE_FILES
    records = list_commits(RunRoot(config.run_root), str(store), "topk", prepared.tag)
    assert sorted(records) == list(range(prepared.shards))
    on_disk = data_hashes(store)
    assert on_disk == prepared.reference
    assert {r.data_file: r.sha256 for r in records.values()} == on_disk


def lines_with(prefix: str, text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)]


def worker_env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KDFLOW_FAULT"} | extra


def start_worker(config_path: Path, **env: str) -> subprocess.Popen:
    """A teacher worker in its own process group (finish() waits for it and kills the group afterwards)."""
    return subprocess.Popen([sys.executable, "-m", "kdflow.tasks.teacher.precompute_worker", "--config",
                             str(config_path)], cwd=REPO, env=worker_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def write_config(config: KDFlowConfig, path: Path) -> Path:
    path.write_text(dump_config(config))
    return path
