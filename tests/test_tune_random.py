"""`kdflow tune precompute --random-weights [--memory-gib N]`: a teacher made from its config alone, as the loader
would hold it (kdflow.tasks.common.random_teacher), and a CUDA process held to a smaller card's memory
(kdflow.tasks.common.device_memory)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")
REPO = Path(__file__).resolve().parents[1]


def _config_only(teacher: Path, into: Path) -> Path:
    """The teacher's folder without its weights: config.json and the tokenizer's files."""
    into.mkdir(parents=True)
    for path in teacher.iterdir():
        if not path.name.endswith((".safetensors", ".bin")) and path.is_file():
            shutil.copy(path, into / path.name)
    return into


@pytest.mark.unit
@pytest.mark.parametrize("four_bit", [False, True])
def test_a_random_teacher_holds_what_the_loader_would_load(tiny_tokenizer_dir: Path, tmp_path: Path,
                                                           four_bit: bool) -> None:
    """A tied Llama with random weights, made from its config: the module kinds and weight bytes of the same model
    saved and loaded by `load_teacher` (4-bit too), the head still the embedding, its rotary tables computed, its
    float32-logits head, finite logits; nothing left on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from kdflow.schemas.config import TeacherConfig
    from kdflow.tasks.common.fused_experts import weight_bytes
    from kdflow.tasks.common.random_teacher import build_random_teacher
    from kdflow.tasks.common.teacher_loading import load_teacher

    config = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=0, bos_token_id=0, pad_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "saved")
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(tmp_path / "saved")
    loaded = load_teacher(TeacherConfig(model=str(tmp_path / "saved"), device="cpu", dtype="bfloat16",
                                        load_in_4bit=four_bit))
    model = build_random_teacher(config, "cpu", torch.bfloat16, four_bit=four_bit, lm_head_float32=True)
    assert {n: type(m).__name__ for n, m in model.named_modules()} == {
        n: type(m).__name__ for n, m in loaded.named_modules()}
    assert weight_bytes(model) == weight_bytes(loaded) and not model.training
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as configured
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq)
    with torch.inference_mode():
        logits = model(input_ids=torch.arange(2, 12).unsqueeze(0)).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.unit
def test_a_cap_holds_only_a_cuda_device_and_judges_headroom_against_the_card() -> None:
    from kdflow.schemas.errors import ConfigError
    from kdflow.tasks.common.device_memory import cap_device_memory, capped_memory_record, check_capped_device

    with pytest.raises(ConfigError, match=r"--memory-gib holds a CUDA device .*teacher.device='cpu' runs on cpu"):
        check_capped_device("cpu", 24)
    with pytest.raises(ConfigError, match="--memory-gib must be a positive number of GiB, got -1"):
        check_capped_device("cpu", -1)
    with pytest.raises(ValueError, match="a memory cap holds a CUDA device, not cpu"):
        cap_device_memory("cpu", 24)
    record = {"peak_reserved_mib": 20 * 1024.0, "total_mib": 81559.0, "headroom": 0.7}
    cap = {"cap_gib": 24.0, "context_gib": 0.5, "allocator_cap_gib": 23.5}
    judged = capped_memory_record(record, cap)  # 23.5 GiB for the allocator, 20 of them reserved at the peak
    assert judged["total_mib"] == 24 * 1024 and judged["headroom_mib"] == 3.5 * 1024
    assert judged["headroom"] == round(3.5 / 24, 4) and judged["memory_cap"] == cap


@pytest.mark.usefixtures("children")
def test_tune_with_random_weights_needs_no_weight_files(tiny_moe_teacher_dir: Path, corpus_file: Path,
                                                        tmp_path: Path) -> None:
    """A MoE teacher's folder without its weights: refused in one line without --random-weights; with it, the
    candidate and the experts trial run on the teacher made from its config, and the header says so. A cap on a
    CPU device is refused before any candidate starts."""
    from support.tiny import tiny_config

    from kdflow.schemas.config_io import dump_config

    folder = _config_only(tiny_moe_teacher_dir, tmp_path / "config-only")
    path = tmp_path / "moe.yaml"
    path.write_text(dump_config(tiny_config(tmp_path / "run", folder, corpus_file, teacher__dtype="float32")))
    command = [sys.executable, "-m", "kdflow", "tune", "precompute", str(path), "--micro-batches", "2", "--batches",
               "1", "--skip-heads", "--json"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert refused.returncode != 0 and "holds no model weights" in refused.stderr, refused.stderr[-2000:]
    done = subprocess.run([*command, "--random-weights"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert [c["status"] for c in summary["candidates"]] == ["ok"] and summary["recommended_micro_batch"] == 2
    assert summary["experts"]["status"] == "ok" and summary["experts"]["recommended_experts"] is not None
    assert "(random weights) on cpu" in done.stdout.splitlines()[0]
    capped = subprocess.run([*command, "--random-weights", "--memory-gib", "24"], capture_output=True, text=True,
                            timeout=600, cwd=REPO)
    assert capped.returncode != 0 and "--memory-gib holds a CUDA device" in capped.stderr
    assert "micro-batch 2:" not in capped.stdout  # refused before any candidate


def test_the_flow_takes_random_weights_and_refuses_a_cap_off_cuda(prefect_harness: object, tiny_teacher_dir: Path,
                                                                  corpus_file: Path, tmp_path: Path) -> None:
    """The deployment's parameters as the command's options: a dense teacher without weights tuned from its config
    (candidates and heads), a cap on a CPU device refused in one line before any task run."""
    from support.tiny import tiny_config

    from kdflow.flows.tune_precompute import tune_precompute_flow
    from kdflow.schemas.errors import ConfigError

    folder = _config_only(tiny_teacher_dir, tmp_path / "config-only")
    config = tiny_config(tmp_path / "run", folder, corpus_file).model_dump(mode="json")
    result = tune_precompute_flow(config, micro_batches="2", batches=1, random_weights=True)
    assert [c["status"] for c in result["candidates"]] == ["ok"] and result["heads"]["status"] == "ok"
    with pytest.raises(ConfigError, match="^memory_gib holds a CUDA device"):
        tune_precompute_flow(config, micro_batches="2", batches=1, random_weights=True, memory_gib=24)
