"""The tiny run every test builds on, written once: conftest's `make_config`, the fault and kill tests and the shared
runs of tests/support/runs.py all start from `tiny_config` and pass only what differs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.config_io import config_from_dict, set_dotted

# 1 layer of width 32 over the tiny tokenizer's vocabulary: trains a few steps in well under a second on a CPU.
TINY_STUDENT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                "intermediate_size": 64}


def tiny_config(run_root: Path, teacher: Path, corpus: Path, /, **overrides: Any) -> KDFlowConfig:
    """seq_len 32, K 8, micro-batches of 4 and shards of 8 sequences, a 4-step student on the CPU; keyword
    arguments are dotted overrides with `__` for the dots (`student__steps=6`, `precompute__max_attempts=1`)."""
    data: dict[str, Any] = {
        "run_root": str(run_root),
        "dataset": {"path": str(corpus), "documents_per_part": 16},
        "seq_len": 32,
        "teacher": {"model": str(teacher), "device": "cpu", "dtype": "float32"},
        "precompute": {"top_k": 8, "micro_batch": 4, "sequences_per_shard": 8},
        "student": {"steps": 4, "batch_size": 4, "eval_sequences": 8, "warmup_steps": 1, "device": "cpu",
                    "architecture": dict(TINY_STUDENT)},
    }
    for key, value in overrides.items():
        set_dotted(data, key.replace("__", "."), value)
    return config_from_dict(data)
