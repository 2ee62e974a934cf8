"""`kdflow status RUN_ROOT`: per stage, committed/expected shards, tokens and fingerprints."""

from __future__ import annotations

from kdflow.schemas.commits import list_commits, read_complete
from kdflow.schemas.layout import (CORPUS_DIR, FINAL_DIR, STUDENTS_DIR, TOKENS_DIR, TOPK_DIR, checkpoint_name,
                                   checkpoint_step, is_store_name)
from kdflow.schemas.storage import RunRoot
from kdflow.schemas.stores import topk_tags


def _store_line(run_root: RunRoot, label: str, store: str, stage: str, expected: int | None) -> tuple[str, int | None]:
    done = read_complete(run_root, store)
    fingerprint = done.fingerprint if done else None
    records = list_commits(run_root, store, stage, fingerprint)
    if expected is None and done is not None:
        expected = done.shards
    tokens = sum(r.tokens for r in records.values())
    rows = sum(r.rows for r in records.values())
    fingerprints = sorted({r.fingerprint for r in records.values()}) or ["-"]
    state = "complete" if done is not None and len(records) == done.shards else "in progress" if records else "empty"
    # Corpus parts count tokens only under a token budget (dataset.max_tokens); 0 there means "not counted".
    counted = f"{tokens:>14,} tokens" if tokens or stage != "corpus" or not rows else f"{'tokens not counted':>21}"
    line = (f"{label:<22} {len(records):>6}/{expected if expected is not None else '?':<6} shards  {rows:>10,} rows  "
            f"{counted}  {state:<11}  fingerprint {','.join(fingerprints)}")
    return line, done.shards if done else None


def print_status(url: str) -> int:
    run_root = RunRoot(url)
    if not run_root.exists(run_root.root):
        print(f"run root {url} does not exist (nothing run yet)")
        return 1
    print(f"run root: {run_root.display(run_root.root)}")
    line, _ = _store_line(run_root, "corpus", run_root.path(CORPUS_DIR), "corpus", None)
    print(line)
    line, token_shards = _store_line(run_root, "tokens", run_root.path(TOKENS_DIR), "tokens", None)
    print(line)
    for tag in topk_tags(run_root):
        line, _ = _store_line(run_root, f"topk/{tag}", run_root.path(TOPK_DIR, tag), "topk", token_shards)
        print(line)
    for name in [n for n in run_root.listdir(run_root.path(STUDENTS_DIR)) if is_store_name(n)]:
        folder = run_root.path(STUDENTS_DIR, name)
        steps = sorted(step for c in run_root.listdir(folder) if (step := checkpoint_step(c)) is not None)
        final = "final model saved" if run_root.exists(f"{folder}/{FINAL_DIR}/config.json") else "no final model yet"
        latest = checkpoint_name(steps[-1]) if steps else "-"
        print(f"{'students/' + name:<22} {len(steps)} checkpoint(s), latest {latest}, {final}")
    return 0
