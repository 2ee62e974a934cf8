"""The student model: built from `student.architecture` or loaded from `student.init_from`.

The student always speaks the run's tokenizer (`kdflow.tasks.corpus.tokenise.load_tokenizer`): its vocabulary is the
tokenizer's, and the token store it trains on must have been made with that same tokenizer (equal
fingerprints). Teacher ids beyond the student's vocabulary are the loss's business (folded into the
tail bucket with a warning); input ids beyond it would be out of range, so that is an error here.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from kdflow.schemas.config import StudentArchitecture, StudentConfig
from kdflow.schemas.errors import KDFlowError, first_line
from kdflow.tasks.common.model_configs import init_vocab_problem
from kdflow.tasks.common.model_files import hub_id, model_folder_problem


class StudentError(KDFlowError):
    """A student folder or model that cannot be used (not a model, wrong vocabulary, unsupported head)."""


def load_causal_lm(source: str, *, what: str, dtype: torch.dtype | None = None, device: str | None = None,
                   hub: bool = False, shown: str | None = None) -> nn.Module:
    """AutoModelForCausalLM.from_pretrained(source) with one-line errors that say what `source` was for.

    `source` is a model folder; with `hub`, also a hub id (from the local Hugging Face cache, or downloaded).
    `shown`: the name the errors give it (a checkpoint's run-root path, where `source` is its local copy)."""
    from transformers import AutoModelForCausalLM

    on_hub = hub and hub_id(source) is not None
    folder = source if on_hub else os.path.expanduser(source)
    problem = None if on_hub else model_folder_problem(folder)
    name = repr(shown or source)
    if problem is not None:
        raise StudentError(f"{what} {name} is not a model: {problem}")
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    from safetensors import SafetensorError  # a damaged or cut-short weights file

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as error:
        raise StudentError(f"{what} {name} is not a loadable causal LM: {first_line(error)}") from None
    return model.to(device) if device is not None else model


def build_student(student: StudentConfig, seq_len: int, tokenizer: Any) -> nn.Module:
    """A fresh float32 student: `init_from` if set, else a Llama of `student.architecture` for `seq_len`, seeded."""
    if student.init_from is not None:
        model = load_causal_lm(student.init_from, what="student.init_from", dtype=torch.float32, hub=True)
        check_init_tokenizer(student.init_from, tokenizer)
    else:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(student.seed)  # the initial weights depend on the seed only
        model = AutoModelForCausalLM.from_config(llama_config(student.architecture, seq_len, tokenizer),
                                                 dtype=torch.float32)
    check_student(model, tokenizer)
    return model


def llama_config(arch: StudentArchitecture, seq_len: int, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return LlamaConfig(
        vocab_size=len(tokenizer),  # includes added special tokens, so every input id has an embedding
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        intermediate_size=arch.intermediate_size,
        tie_word_embeddings=arch.tie_word_embeddings,
        rope_theta=arch.rope_theta,
        max_position_embeddings=seq_len,  # the length it is trained at; RoPE extrapolates beyond
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
    )


def check_student(model: nn.Module, tokenizer: Any) -> None:
    """The fused loss needs a plain lm_head (no logit scaling or softcapping) and every token id embedded."""
    from kdflow.tasks.common.models import final_logit_transform, output_layer

    try:
        head = output_layer(model)
        transform = final_logit_transform(model.config)
    except (ValueError, NotImplementedError) as error:
        raise StudentError(f"student {type(model).__name__}: {first_line(error)}") from None
    if not transform.is_identity:
        raise StudentError(f"student {type(model).__name__} scales or softcaps its logits ({transform}); "
                           "the fused top-K loss supports plain lm_head logits only")
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise StudentError(f"student {type(model).__name__}: lm_head has no (vocab, hidden) weight")
    if weight.shape[0] < len(tokenizer):
        raise StudentError(f"student vocabulary {weight.shape[0]} is smaller than the tokenizer's {len(tokenizer)}: "
                           "input ids would be out of range")


def check_init_tokenizer(source: str, tokenizer: Any) -> None:
    """An init_from model that ships a tokenizer must give every token of the run's tokenizer the same id (special
    tokens may differ: the student is trained and saved with the run's tokenizer)."""
    from transformers import AutoTokenizer

    folder = os.path.expanduser(source)
    if not hub_id(source) and not any(os.path.isfile(os.path.join(folder, name))
                                      for name in ("tokenizer.json", "tokenizer_config.json")):
        return
    try:
        own = AutoTokenizer.from_pretrained(source if hub_id(source) else folder)
    except (OSError, ValueError) as error:
        if hub_id(source):
            return  # a hub model without a tokenizer of its own
        raise StudentError(f"student.init_from {source!r}: cannot load its tokenizer: {first_line(error)}") from None
    problem = init_vocab_problem(source, tokenizer.get_vocab(), own.get_vocab())
    if problem:
        raise StudentError(problem)


def student_tokenizer(student: StudentConfig, tokenizer: Any) -> Any:
    """The tokenizer saved with the student. A base student (built from `architecture`) gets no chat
    template, so `kdflow chat` continues text; an `init_from` student keeps its own template, if any."""
    from transformers import AutoTokenizer

    template = None
    if student.init_from is not None:
        try:
            init_from = student.init_from
            template = AutoTokenizer.from_pretrained(hub_id(init_from) or os.path.expanduser(init_from)).chat_template
        except (OSError, ValueError):
            template = None
    tokenizer.chat_template = template
    return tokenizer
