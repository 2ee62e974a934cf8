"""The text `kdflow bench fidelity` runs on (`--corpus`), and the demo teacher and token store it prepares.

  pydoc    Python's documentation topics (`pydoc_data`), the demo's text (prose about code); the default
  stdlib   the standard library's own `.py` sources (code), written by `kdflow.demo_assets.write_stdlib_corpus`
  PATH     any jsonl file with a `text` field

A default target is never to be chosen on one text, and both built-in corpora are on every machine offline. The
corpus is the config's `dataset.path`, which is in the corpus fingerprint: each corpus has its own corpus, token
and top-K stores under one run root, and its own folder of stored results (`kdflow.bench.fidelity_results`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILT_IN = ("pydoc", "stdlib")


@dataclass(frozen=True)
class Corpus:
    name: str  # pydoc, stdlib, or the jsonl file's absolute path
    source: str  # the jsonl file the corpus stage reads (under the run root for the built-in ones)


def jsonl_problem(path: str) -> str | None:
    """Why `path` cannot be a --corpus file (one line), or None: a .jsonl file (the corpus stage reads a file by
    its suffix) whose first record is a JSON object with a string `text` field."""
    if not path.endswith(".jsonl"):
        return f"--corpus {path}: not pydoc, stdlib or a .jsonl file"
    try:
        with open(path, encoding="utf-8") as handle:
            first = next((line for line in handle if line.strip()), None)
    except (OSError, UnicodeDecodeError) as error:
        return f"--corpus {path}: cannot read it as UTF-8 jsonl ({type(error).__name__}: {error})"
    if first is None:
        return f"--corpus {path}: the file is empty"
    try:
        record = json.loads(first)
    except ValueError:
        return f"--corpus {path}: its first line is not JSON (a jsonl file, one JSON object a line, is needed)"
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        return f"--corpus {path}: its first record has no string `text` field"
    return None


def choose_corpus(value: str, root: str) -> Corpus:
    """--corpus as given -> the corpus (raises ValueError, one line, for a file that cannot be one)."""
    from kdflow.demo_assets import SOURCE_FILE, STDLIB_FILE

    if value in BUILT_IN:
        return Corpus(value, os.path.join(root, SOURCE_FILE if value == "pydoc" else STDLIB_FILE))
    path = os.path.abspath(os.path.expanduser(value))
    problem = jsonl_problem(path)
    if problem:
        raise ValueError(problem)
    return Corpus(path, path)


def write_source(corpus: Corpus) -> dict[str, Any]:
    """The built-in corpus's jsonl file, written unless it holds exactly these bytes; -> a record to print."""
    from kdflow.demo_assets import write_corpus, write_stdlib_corpus

    record = {"kind": "corpus", "corpus": corpus.name, "source": corpus.source}
    if corpus.name == "pydoc":
        return record | write_corpus(Path(corpus.source))
    if corpus.name == "stdlib":
        return record | write_stdlib_corpus(Path(corpus.source))
    return record | {"written": False}


def prepare(base: Any, corpus: Corpus) -> dict[str, Any]:
    """The corpus's jsonl file, the demo teacher (dequantised once), corpus and token stores; -> the corpus record."""
    from kdflow.demo_assets import locate_teacher_gguf, prepare_teacher
    from kdflow.schemas.stage_settings import materialise_settings, open_run_root, tokenise_settings
    from kdflow.tasks.common.tokenizer import load_tokenizer
    from kdflow.tasks.corpus.materialise import materialise
    from kdflow.tasks.corpus.tokenise import tokenise

    record = write_source(corpus)
    prepare_teacher(locate_teacher_gguf(), Path(base.teacher.model))
    tokenizer = load_tokenizer(base.teacher, base.tokenizer)

    def count_tokens(texts: list[str]) -> list[int]:
        encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return [len(ids) + 1 for ids in encoded]

    summary = materialise(open_run_root(base), materialise_settings(base), count_tokens)
    tokenise(open_run_root(base), tokenise_settings(base), tokenizer)
    return record | {"corpus_documents": summary.documents, "corpus_tokens": summary.tokens}
