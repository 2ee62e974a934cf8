"""Fixtures of tiny runs, registered by tests/conftest.py (`pytest_plugins`).

The sharpened teacher and the prepared run roots are built once per session; each test copies a run root.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.corpus import sample_documents, write_jsonl
from support.faults import Prepared, build_prepared, fault_config
from support.runs import SHARPEN, make_tokens, run_config, write_dense_topk

from kdflow.schemas.config import KDFlowConfig


@pytest.fixture(scope="session")
def sharp_teacher_dir(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> Path:
    """The tiny teacher with its lm_head scaled up: distributions peaked enough to learn from in a few steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    folder = tmp_path_factory.mktemp("sharp-teacher")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_teacher_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def prepared_run(tmp_path_factory: pytest.TempPathFactory, sharp_teacher_dir: Path) -> tuple[Path, Path]:
    """(run root with corpus, tokens and a dense top-K store, corpus file): copied by each test."""
    base = tmp_path_factory.mktemp("prepared")
    corpus = write_jsonl(base / "docs.jsonl", sample_documents(60))
    config = run_config(base / "run", sharp_teacher_dir, corpus)
    make_tokens(config)
    write_dense_topk(config, sharp_teacher_dir)
    return base / "run", corpus


@pytest.fixture
def fresh_run(prepared_run: tuple[Path, Path], sharp_teacher_dir: Path, tmp_path: Path) -> Callable[..., KDFlowConfig]:
    """A private copy of the prepared run root; -> a config builder for it (dotted overrides)."""
    run_root, corpus = prepared_run
    shutil.copytree(run_root, tmp_path / "run")
    return lambda **overrides: run_config(tmp_path / "run", sharp_teacher_dir, corpus, **overrides)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> Prepared:
    """The fault tests' token store and uninterrupted top-K store (support.faults.build_prepared)."""
    return build_prepared(tmp_path_factory.mktemp("faults"), tiny_teacher_dir)


@pytest.fixture
def run_copy(prepared: Prepared, tmp_path: Path) -> Callable[..., KDFlowConfig]:
    """-> copy(source='tokens-only'|'reference', run_root=None, **overrides): a private copy of a prepared run
    root."""

    def copy(source: str = "tokens-only", run_root: Path | None = None, **overrides: Any) -> KDFlowConfig:
        target = run_root or tmp_path / "run"
        shutil.copytree(prepared.base / source, target, dirs_exist_ok=True)
        return fault_config(target, prepared.teacher, prepared.corpus, **overrides)

    return copy
