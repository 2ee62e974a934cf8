"""The run's tokenizer: the config's `tokenizer`, else the teacher's own (also from a GGUF file)."""

from __future__ import annotations

from typing import Any

from kdflow.schemas.config import KDFlowConfig
from kdflow.schemas.errors import ConfigError, first_line
from kdflow.tasks.common.model_files import resolve_model_files


def load_tokenizer(config: KDFlowConfig) -> Any:
    """The run's fast tokenizer: `tokenizer` if set, else the teacher's (also from a GGUF file)."""
    from transformers import AutoTokenizer

    path, gguf_file = config.tokenizer_source
    path = resolve_model_files(path, gguf_file)
    kwargs: dict[str, Any] = {"trust_remote_code": config.teacher.trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot load a tokenizer from {path!r}: {first_line(error)}") from None
    if not tokenizer.is_fast:
        raise ConfigError(f"tokenizer {path!r} has no fast (Rust) implementation; kdflow needs one for batched packing")
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {path!r} has no EOS token to separate documents")
    return tokenizer
