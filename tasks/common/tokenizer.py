"""The run's tokenizer: the config's `tokenizer`, else the teacher's own (also from a GGUF file)."""

from __future__ import annotations

from typing import Any

from kdflow.schemas.config import TeacherConfig
from kdflow.schemas.errors import ConfigError, first_line
from kdflow.tasks.common.model_files import resolve_model_files


def load_tokenizer(teacher: TeacherConfig, tokenizer: str | None) -> Any:
    """The run's fast tokenizer: the config's `tokenizer` if set, else the teacher's (also from a GGUF file)."""
    from transformers import AutoTokenizer

    path, gguf_file = (tokenizer, None) if tokenizer is not None else (teacher.model, teacher.gguf_file)
    path = resolve_model_files(path, gguf_file)
    kwargs: dict[str, Any] = {"trust_remote_code": teacher.trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        loaded = AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot load a tokenizer from {path!r}: {first_line(error)}") from None
    if not loaded.is_fast:
        raise ConfigError(f"tokenizer {path!r} has no fast (Rust) implementation; kdflow needs one for batched packing")
    if loaded.eos_token_id is None:
        raise ConfigError(f"tokenizer {path!r} has no EOS token to separate documents")
    return loaded
