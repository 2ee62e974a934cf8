"""Loading the teacher: whole-model placement and the checks that fail fast with one line.

The cheap checks (paths, vocabulary, context length, tokenizer) run before the weights load, not after. Loading
itself, with whole-model placement (anything left on another device is an error naming the modules), lives in
kdflow.tasks.common.teacher_loading (`load_teacher`), because the student's held-out evaluation loads the teacher
too; callers import it from there.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kdflow.schemas.config import TeacherConfig
from kdflow.schemas.errors import ConfigError
from kdflow.tasks.common.model_configs import teacher_limits_problem
from kdflow.tasks.common.model_files import check_teacher_files
from kdflow.tasks.common.models import text_config
from kdflow.tasks.common.teacher_loading import source_kwargs


def load_teacher_config(teacher: TeacherConfig, weights: bool = True) -> Any:
    """The teacher's Hugging Face config, without its weights (for the checks that come first); `weights` False:
    a local folder need hold no weight file (a teacher with random weights is made from the config alone)."""
    from transformers import AutoConfig

    local = check_teacher_files(teacher, weights)
    return AutoConfig.from_pretrained(local or teacher.model, **source_kwargs(teacher))


def check_teacher_limits(model_config: Any, *, top_k: int, seq_len: int) -> None:
    """top_k within the vocabulary, seq_len within the context the teacher was trained for."""
    text = text_config(model_config)
    problem = teacher_limits_problem(getattr(text, "vocab_size", None), getattr(text, "max_position_embeddings", None),
                                     top_k=top_k, seq_len=seq_len)
    if problem is not None:
        raise ConfigError(problem)


def vocab_rows(model: nn.Module) -> int:
    """Rows of the teacher's input embedding: every token id fed to it must be below this."""
    return int(model.get_input_embeddings().num_embeddings)


def output_rows(model: nn.Module) -> int:
    """Rows of the teacher's output (its lm_head's out_features, else its embedding's): the ids a pass stores."""
    from kdflow.tasks.common.models import output_layer

    return int(getattr(output_layer(model), "out_features", None) or vocab_rows(model))


def check_tokenizer_fits(tokenizer: Any, model: nn.Module) -> None:
    largest = max(max(tokenizer.get_vocab().values(), default=0), len(tokenizer) - 1)
    rows = vocab_rows(model)
    if largest >= rows:
        raise ConfigError(f"the tokenizer has ids up to {largest} but the teacher's embedding has only {rows} rows")
