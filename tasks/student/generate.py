"""Generate with a saved student: the replies of `kdflow chat` (kdflow.commands.chat), streamed and stoppable, and the
`generate()` the demo calls.

A student folder is what `kdflow.tasks.student.train` writes to `students/NAME/final/` (HF model + tokenizer); the
`students/NAME` folder itself is accepted too. A tokenizer with a chat template means an instruction-tuned
student (an `init_from` chat model): prompts go through the template. A base student is saved without
one (kdflow.tasks.student.model.student_tokenizer), so its prompts are plain text to continue. The history of a
conversation and its cut to the model's positions: kdflow.tasks.student.conversation.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

from kdflow.schemas.errors import first_line
from kdflow.schemas.layout import FINAL_DIR
from kdflow.tasks.common.models import text_config
from kdflow.tasks.student.conversation import has_template, running_text, template_ids, text_ids
from kdflow.tasks.student.model import StudentError, load_causal_lm


@dataclass
class LoadedStudent:
    model: nn.Module
    tokenizer: Any
    device: torch.device
    folder: str


def resolve_student_dir(path: str) -> str:
    """STUDENT_DIR may be the model folder or the students/NAME folder that holds it in `final/`."""
    final = os.path.join(path, FINAL_DIR)
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(final, "config.json")):
        return final
    return path


def _device(name: str) -> torch.device:
    from kdflow.tasks.common.models import resolve_device

    try:
        return resolve_device(name, setting="--device")
    except RuntimeError:
        raise StudentError(f"unknown device {name!r} (auto, cpu, cuda, cuda:N)") from None


def load_student(path: str, device: str = "auto") -> LoadedStudent:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar would interleave with the conversation
    folder = resolve_student_dir(path)
    target = _device(device)
    model = load_causal_lm(folder, what="student", device=str(target))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as error:
        raise StudentError(f"student {folder!r} has no usable tokenizer: {first_line(error)}") from None
    model.eval()
    return LoadedStudent(model, tokenizer, target, folder)


def max_positions(student: LoadedStudent) -> int | None:
    """The positions the student was made for (`max_position_embeddings`; a kdflow student: its seq_len)."""
    config = getattr(student.model, "config", None)
    positions = getattr(text_config(config), "max_position_embeddings", None)
    return int(positions) if positions else None


def encode_prompt(tokenizer: Any, prompt: str, system: str | None = None) -> list[int]:
    """Token ids to continue: through the chat template when the tokenizer has one, else the plain text (after the
    system text on its own line)."""
    if has_template(tokenizer):
        messages = [{"role": "system", "content": system}] if system else []
        return template_ids(tokenizer, [*messages, {"role": "user", "content": prompt}])
    return text_ids(tokenizer, running_text(system, [], prompt))


@dataclass(frozen=True)
class Decoding:
    """How replies are drawn: greedy, or sampled with temperature, top-p and top-k; `repetition_penalty` > 1 divides
    the scores of tokens already in the text (small students otherwise loop on one word)."""

    max_new_tokens: int = 64
    greedy: bool = False
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 50
    repetition_penalty: float = 1.0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature} (use --greedy)")
        if not self.greedy and not (0 < self.top_p <= 1 and self.top_k >= 0):
            raise ValueError(f"top-p must be in (0, 1] and top-k >= 0 (0: off), got {self.top_p} and {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition penalty must be > 0 (1: off), got {self.repetition_penalty}")

    def generate_kwargs(self) -> dict[str, Any]:
        self.check()
        penalty = {"repetition_penalty": self.repetition_penalty} if self.repetition_penalty != 1.0 else {}
        if self.greedy:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens, **penalty}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens, **penalty}

    def describe(self) -> str:
        penalty = f", repetition penalty {self.repetition_penalty:g}" if self.repetition_penalty != 1.0 else ""
        if self.greedy:
            return f"greedy{penalty}, up to {self.max_new_tokens} new tokens"
        return (f"sampling (temperature {self.temperature}, top-p {self.top_p}, top-k {self.top_k}{penalty}), "
                f"up to {self.max_new_tokens} new tokens")


@dataclass(frozen=True)
class Reply:
    text: str  # the new text, special tokens removed
    new_tokens: int
    stopped: bool  # `stop` was set before the reply's end


class _Stop(StoppingCriteria):
    """Ends generation after the current token once `event` is set (Ctrl-C in `kdflow chat`)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _Streamer(TextStreamer):
    """transformers' streamer, handing each finished piece of text to `on_text` instead of printing it."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None]) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.on_text = on_text

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.on_text(text)


@torch.no_grad()
def reply_to(student: LoadedStudent, input_ids: list[int], decoding: Decoding, *,
             on_text: Callable[[str], None] | None = None, stop: threading.Event | None = None) -> Reply:
    """Generate after `input_ids`; `on_text` gets the text as it is generated, `stop` ends the reply early."""
    tokenizer = student.tokenizer
    options = decoding.generate_kwargs()
    ids = torch.tensor([input_ids], device=student.device)  # (1, n)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if on_text is not None:
        options["streamer"] = _Streamer(tokenizer, on_text)
    if stop is not None:
        options["stopping_criteria"] = StoppingCriteriaList([_Stop(stop)])
    output = student.model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=pad_id,
                                    **options)  # (1, n + new)
    new = output[0, ids.shape[1]:]
    return Reply(tokenizer.decode(new, skip_special_tokens=True), int(new.shape[0]),
                 stop is not None and stop.is_set())


def continue_text(student: LoadedStudent, prompt: str, *, max_new_tokens: int = 64, greedy: bool = False,
                  temperature: float = 0.8, top_p: float = 0.95, top_k: int = 50, seed: int | None = 0,
                  system: str | None = None, repetition_penalty: float = 1.0) -> str:
    """The student's continuation of `prompt` alone (new text only, special tokens removed)."""
    decoding = Decoding(max_new_tokens, greedy, temperature, top_p, top_k, repetition_penalty)
    decoding.check()
    if seed is not None and not greedy:
        torch.manual_seed(seed)
    return reply_to(student, encode_prompt(student.tokenizer, prompt, system), decoding).text


def generate(student_dir: str, prompt: str, *, max_new_tokens: int = 64, greedy: bool = False, temperature: float = 0.8,
             top_p: float = 0.95, top_k: int = 50, seed: int | None = 0, device: str = "auto",
             repetition_penalty: float = 1.0) -> str:
    """Load the student in `student_dir` and continue `prompt` once."""
    student = load_student(student_dir, device)
    return continue_text(student, prompt, max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature,
                         top_p=top_p, top_k=top_k, seed=seed, repetition_penalty=repetition_penalty)
