"""The stored results of `kdflow bench fidelity`: one JSON file per variant x seed, named by everything that
determines the run, so that a rerun skips what is stored and a long comparison is built up across runs; the
summary JSON and the plot of held-out KL against steps written beside them.

A result's key is a hash of: the format version here, the variant, the seed, the tag of the store it trains on
(which names the teacher, the token store and every store setting), the whole student config but its name
(architecture, steps, batch, schedule, seed, loss), `seq_len`, the held-out rows and the evaluation steps.
Files are written to a temporary name and renamed: a killed run leaves no half-written result.

Each corpus (`--corpus`) has its own folder, so results and summaries of different texts never mix:
fidelity-results (pydoc, the folder of every result stored before there was a choice, which therefore reads as
pydoc), fidelity-results-stdlib, and fidelity-results-STEM-HASH for a jsonl file (HASH: of its absolute path).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

RESULTS_VERSION = 1
RESULTS_DIR = "fidelity-results"
SUMMARY_FILE, PLOT_FILE = "summary.json", "heldout_kl.png"


def result_key(variant: str, seed: int, store_tag: str, config: Any, eval_steps: list[int]) -> str:
    """Hex digest naming one run's result (see the module docstring for what goes in)."""
    student = config.student.model_dump(mode="json")
    student.pop("name", None)
    what = {"version": RESULTS_VERSION, "variant": variant, "seed": seed, "store": store_tag, "student": student,
            "seq_len": config.seq_len, "eval_steps": sorted(eval_steps)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def teacher_key(store_tag: str, config: Any) -> str:
    """Hex digest naming the teacher's own held-out CE: the token store (in the tag) and the held-out shards."""
    what = {"version": RESULTS_VERSION, "teacher": store_tag, "seq_len": config.seq_len,
            "eval_shards": config.student.eval_shards}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def results_folder(corpus: str) -> str:
    """The folder name of one corpus's results (see the module docstring)."""
    if corpus == "pydoc":
        return RESULTS_DIR
    if corpus == "stdlib":
        return f"{RESULTS_DIR}-stdlib"
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(corpus).stem)[:40]
    return f"{RESULTS_DIR}-{stem}-{hashlib.sha256(corpus.encode()).hexdigest()[:8]}"


class Results:
    """The folder of one corpus's stored results under the benchmark's run root."""

    def __init__(self, root: str | Path, corpus: str = "pydoc") -> None:
        self.corpus = corpus
        self.folder = Path(root) / results_folder(corpus)

    def path(self, variant: str, seed: int, key: str) -> Path:
        return self.folder / f"{variant}-seed{seed}-{key}.json"

    def load(self, variant: str, seed: int, key: str) -> dict[str, Any] | None:
        """The stored result of that run, or None (absent, or unreadable: it is then run again)."""
        try:
            record = json.loads(self.path(variant, seed, key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("key") != key:
            return None
        return {"corpus": self.corpus} | record  # a result stored before the corpus was named: its folder's

    def save_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """Store a result (it names its variant, seed and key); -> the record."""
        self._write(self.path(record["variant"], record["seed"], record["key"]), record)
        return record

    def _write(self, path: Path, payload: Any) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(payload, indent=1) + "\n")
        os.replace(partial, path)
        return path

    def write_summary(self, summary: list[dict[str, Any]]) -> dict[str, Any]:
        """summary.json, and the plot of held-out KL against steps beside it (matplotlib if installed, else
        skipped); -> a record saying what was written."""
        written = {"kind": "written", "summary": str(self._write(self.folder / SUMMARY_FILE, summary)), "plot": None}
        curves = next((r["heldout_kl_by_step"] for r in summary if r["kind"] == "curves"), {})
        try:
            import matplotlib
        except ImportError:
            return written | {"note": "matplotlib is not installed: no plot (the curves are in summary.json)"}
        matplotlib.use("Agg")
        from matplotlib import pyplot

        figure, axes = pyplot.subplots(figsize=(7, 4.5))
        for variant, points in curves.items():
            if points:
                axes.plot([p["step"] for p in points], [p["heldout_kl"] for p in points], marker="o", label=variant)
        axes.set_xlabel("optimiser step")
        axes.set_ylabel("held-out KL(teacher || student), nats/position")
        axes.set_title(f"kdflow bench fidelity ({Path(self.corpus).name}): mean over seeds")
        axes.legend()
        path = self.folder / PLOT_FILE
        partial = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
        figure.savefig(partial, dpi=120, bbox_inches="tight")
        pyplot.close(figure)
        os.replace(partial, path)
        return written | {"plot": str(path)}
