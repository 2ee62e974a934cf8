"""A model's parameters estimated from its config.json alone (`ModelShape.parameters`, what pre-flight's disk estimate
of a pruned or `init_from` student uses) against the parameters of the transformers model that config builds,
whole and with fewer blocks, MLP channels and key/value heads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kdflow.tasks.common.model_configs import config_shape, model_folder_shape

pytestmark = pytest.mark.unit

SMALL = {"vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8,
         "num_key_value_heads": 4, "intermediate_size": 256, "max_position_embeddings": 256}


def configs() -> dict[str, Any]:
    from transformers import LlamaConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    return {
        "llama, tied": LlamaConfig(**SMALL, tie_word_embeddings=True),
        "qwen3, own head_dim": Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=False),
        "qwen3-moe": Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                    tie_word_embeddings=False),
        "qwen2-moe, shared expert": Qwen2MoeConfig(**SMALL, num_experts=6, num_experts_per_tok=2,
                                                   moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                                   tie_word_embeddings=False),
    }


def built(config: Any) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(configs()))
def test_the_estimate_is_the_built_models_count_whole_and_pruned(name: str, tmp_path: Path) -> None:
    config = configs()[name]
    config.save_pretrained(tmp_path)
    shape = model_folder_shape(str(tmp_path))
    assert shape is not None and shape.source.endswith("config.json")
    whole = built(config)
    assert abs(shape.parameters() - whole) / whole < 0.01  # biases and per-head norms are left out

    moe = shape.experts
    pruned = config_shape(json.loads((tmp_path / "config.json").read_text()), "copy")
    fields = {k: v for k, v in config.to_dict().items() if k not in ("layer_types", "mlp_only_layers")}
    smaller = type(config)(**{**fields, "num_hidden_layers": 1, "num_key_value_heads": 2,
                              "num_attention_heads": 4, "head_dim": shape.head_dim or 16,
                              ("moe_intermediate_size" if moe else "intermediate_size"): 32})
    expected = built(smaller)
    estimate = pruned.parameters(layers=1, mlp_width=32, key_value_heads=2)
    assert abs(estimate - expected) / expected < 0.01
    assert estimate < shape.parameters()


def test_a_config_that_does_not_say_enough_has_no_estimate() -> None:
    shape = config_shape({"model_type": "x", "vocab_size": 10}, "config.json")
    assert shape.parameters() is None
