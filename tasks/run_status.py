"""Where a run root stands, one line per store and per student: committed/expected shards, rows, tokens,
fingerprints, whether a store is stale, and the dataset's files against what materialise read.

`kdflow status` (kdflow.commands.status) prints these lines; `kdflow bench scale` times them at scale.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import yaml

from kdflow.schemas.commits import CommitRecord, StageComplete, list_commits, read_complete
from kdflow.schemas.layout import (CONFIG_FILE, CORPUS_DIR, EVAL_FILE, FINAL_DIR, IMPORTS_DIR, SOURCES_FILE,
                                   STUDENTS_DIR, TOKENS_DIR, TOPK_DIR, checkpoint_name, is_store_name)
from kdflow.schemas.storage import RunRoot, complete_checkpoint_steps
from kdflow.schemas.store_info import tokens_made_from, topk_tags
from kdflow.tasks.common.model_files import final_problems
from kdflow.tasks.common.progress import count_of
from kdflow.tasks.teacher.micro_batch import stepped_down_lines


def _store_line(run_root: RunRoot, label: str, store: str, stage: str, expected: int | None,
                token_store: StageComplete | None = None, stale: bool = False
                ) -> tuple[str, int | None, dict[int, CommitRecord]]:
    done = read_complete(run_root, store)
    fingerprint = done.fingerprint if done else None
    records = list_commits(run_root, store, stage, fingerprint)
    made_from = tokens_made_from(records.values()) if stage == "topk" else set()
    stale = stale or (token_store is not None and bool(made_from) and token_store.fingerprint not in made_from)
    if (expected is None or stale) and done is not None:
        expected = done.shards  # a stale store is measured against its own token store, not today's
    tokens = sum(r.tokens for r in records.values())
    rows = sum(r.rows for r in records.values())
    fingerprints = sorted({r.fingerprint for r in records.values()}) or ["-"]
    state = "complete" if done is not None and len(records) == done.shards else "in progress" if records else "empty"
    state = f"stale ({state})" if stale else state
    # Corpus parts count tokens only under a token budget (dataset.max_tokens); 0 there means "not counted".
    counted = f"{tokens:>14,} tokens" if tokens or stage != "corpus" or not rows else f"{'tokens not counted':>21}"
    line = (f"{label:<22} {len(records):>6}/{expected if expected is not None else '?':<6} shards  {rows:>10,} rows  "
            f"{counted}  {state:<16}  fingerprint {','.join(fingerprints)}")
    return line, done.shards if done else None, records


def _of_another_corpus(run_root: RunRoot, folder: str, corpus: StageComplete | None) -> bool:
    """Whether the config beside `folder` (the token store, a student) names a dataset whose fingerprint is not that
    of the finished corpus store `corpus` (a run of another dataset replaced the corpus after it); False where
    either cannot be told (an imported store)."""
    from kdflow.schemas.config_io import saved_config
    from kdflow.schemas.fingerprints import corpus_fingerprint

    if corpus is None:
        return False
    try:
        return corpus_fingerprint(saved_config(run_root, folder)) != corpus.fingerprint
    except Exception:  # noqa: BLE001 - no config beside it (an imported store), or one of another kdflow
        return False


def status_lines(run_root: RunRoot) -> Iterator[str]:
    """The status of an existing run root, line by line (each as soon as its store is read)."""
    yield f"run root: {run_root.display(run_root.root)}"
    line, _, _ = _store_line(run_root, "corpus", run_root.path(CORPUS_DIR), "corpus", None)
    yield line
    sources = _sources_line(run_root)
    if sources:
        yield sources
    corpus = read_complete(run_root, run_root.path(CORPUS_DIR))  # read once: the token store and each student
    another_corpus = _of_another_corpus(run_root, run_root.path(TOKENS_DIR), corpus)
    line, token_shards, _ = _store_line(run_root, "tokens", run_root.path(TOKENS_DIR), "tokens", None,
                                        stale=another_corpus)
    yield line
    if another_corpus:
        yield "  stale: tokenised from another corpus than corpus/ holds now; the next run's tokenise makes it again"
    token_store = read_complete(run_root, run_root.path(TOKENS_DIR))
    imported = getattr(token_store.extra, "imported_from", None) if token_store is not None else None
    if imported:  # no corpus/ to have come from: say where it did
        yield f"  imported by kdflow store import from {imported}"
    stale = 0
    for tag in topk_tags(run_root):
        line, _, records = _store_line(run_root, f"topk/{tag}", run_root.path(TOPK_DIR, tag), "topk", token_shards,
                                       token_store)
        stale += "stale (" in line
        yield line
        yield from (f"  {note}" for note in stepped_down_lines(records.values()))  # after an out-of-memory
    if stale:
        it = "it" if stale == 1 else "them"
        yield (f"  stale: computed from token shards since replaced by tokenise; training skips {it} (delete to free "
               "space)")
    yield from staged_import_lines(run_root)
    for name in [n for n in run_root.listdir(run_root.path(STUDENTS_DIR)) if is_store_name(n)]:
        yield _student_line(run_root, name)
        if _of_another_corpus(run_root, run_root.path(STUDENTS_DIR, name), corpus):
            yield "  trained on another corpus than corpus/ holds now: a rerun of it is refused (another student.name)"


def staged_import_lines(run_root: RunRoot) -> Iterator[str]:
    """The work a stopped `kdflow store import` staged (`_imports/KEY/`), which `tokens 0/?` did not show."""
    imports = run_root.path(IMPORTS_DIR)
    for key in run_root.listdir(imports):
        sizes = run_root.list_sizes(f"{imports}/{key}")
        staged = sum(name.endswith(".npz") for name in sizes)
        mib = sum(sizes.values()) / 2**20
        yield (f"{IMPORTS_DIR + '/' + key:<22} {count_of(staged, 'staged shard')} ({mib:,.1f} MiB) of an import not "
               "finished: rerunning it resumes there (an import of another source removes them)")


def _sources_line(run_root: RunRoot) -> str | None:
    """The dataset's files against what materialise read (`corpus/_sources.json`), from the record alone: a file
    since edited or removed is named, as the next run would name it; None where there is no record."""
    from kdflow.tasks.corpus.dataset_changes import sources_state

    state = sources_state(run_root)
    return None if state is None else f"{CORPUS_DIR + '/' + SOURCES_FILE:<22} {state}"


def _student_line(run_root: RunRoot, name: str) -> str:
    """Where a student's training stands: the step of its latest complete checkpoint (the one a rerun resumes
    from) of the steps its config asks for, whether the final model is there, and its last held-out KL."""
    folder = run_root.path(STUDENTS_DIR, name)
    steps = complete_checkpoint_steps(run_root, folder)
    config = yaml.safe_load(_read(run_root, f"{folder}/{CONFIG_FILE}") or b"{}") or {}
    target = config.get("student", {}).get("steps")
    saved = (f"{len(steps)} checkpoint{'' if len(steps) == 1 else 's'} (latest {checkpoint_name(steps[-1])})"
             if steps else "no checkpoint yet")
    final = "final model saved" if run_root.exists(f"{folder}/{FINAL_DIR}/config.json") else "no final model yet"
    if final == "final model saved" and final_problems(run_root, folder, steps[-1] if steps else None):
        final = "final model damaged (kdflow validate names it; a rerun of train writes it again)"
    line = (f"{'students/' + name:<22} step {steps[-1] if steps else 0:,} of "
            f"{f'{target:,}' if isinstance(target, int) else '?'}: {saved}, {final}")
    evaluations = (_read(run_root, f"{folder}/{EVAL_FILE}") or b"").splitlines()
    last = json.loads(evaluations[-1]) if evaluations else {}
    if last.get("kl") is not None:  # `kl`: to the stored top-K targets; `kl_full`: to the teacher's full vocabulary
        full = f", full-vocabulary {last['kl_full']:.4f}" if last.get("kl_full") is not None else ""
        line += f"; held-out KL to the stored targets {last['kl']:.4f}{full} at step {last['step']:,}"
    return line


def _read(run_root: RunRoot, path: str) -> bytes | None:
    return run_root.read_bytes(path) if run_root.exists(path) else None
