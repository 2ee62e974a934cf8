"""Generate with a saved student: `kdflow chat STUDENT_DIR` and the `generate()` the demo calls.

A student folder is what `kdflow.tasks.student.train` writes to `students/NAME/final/` (HF model + tokenizer); the
`students/NAME` folder itself is accepted too. A tokenizer with a chat template means an instruction-tuned
student (an `init_from` chat model): prompts go through the template. A base student is saved without
one (kdflow.tasks.student.model.student_tokenizer), so its prompts are plain text to continue.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kdflow.schemas.errors import first_line
from kdflow.schemas.layout import FINAL_DIR
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
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
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


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids to continue: through the chat template when the tokenizer has one, else the plain text."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True)
        ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
        return list(ids)
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:  # nothing to condition on: start a document, as after the EOS that separates training documents
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = [start]
    return list(ids)


@torch.no_grad()
def continue_text(student: LoadedStudent, prompt: str, *, max_new_tokens: int = 64, greedy: bool = False,
                  temperature: float = 0.8, top_p: float = 0.95, top_k: int = 50, seed: int | None = 0) -> str:
    """The student's continuation of `prompt` (new text only, special tokens removed)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    tokenizer = student.tokenizer
    input_ids = torch.tensor([encode_prompt(tokenizer, prompt)], device=student.device)  # (1, n)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling: dict[str, Any] = {"do_sample": False}
    if not greedy:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature} (use --greedy)")
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
        if seed is not None:
            torch.manual_seed(seed)
    output = student.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                    pad_token_id=pad_id, **sampling)  # (1, n + new)
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)


def generate(student_dir: str, prompt: str, *, max_new_tokens: int = 64, greedy: bool = False, temperature: float = 0.8,
             top_p: float = 0.95, top_k: int = 50, seed: int | None = 0, device: str = "auto") -> str:
    """Load the student in `student_dir` and continue `prompt` once."""
    student = load_student(student_dir, device)
    return continue_text(student, prompt, max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature,
                         top_p=top_p, top_k=top_k, seed=seed)


def chat_main(args: argparse.Namespace) -> int:
    """`kdflow chat`: one --prompt, or prompts read from stdin until EOF or an empty line."""
    student = load_student(args.student_dir, args.device)
    options = {"max_new_tokens": args.max_new_tokens, "greedy": args.greedy, "temperature": args.temperature,
               "top_p": args.top_p, "top_k": args.top_k}
    if args.prompt is not None:
        print(continue_text(student, args.prompt, seed=args.seed, **options), flush=True)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"student {student.folder}: type a prompt, an empty line or Ctrl-D ends", file=sys.stderr)
    torch.manual_seed(args.seed)  # seeded once: each reply continues the same random stream
    while True:
        try:
            prompt = input("> " if interactive else "")
        except EOFError:
            break
        if not prompt.strip():
            break
        print(continue_text(student, prompt, seed=None, **options), flush=True)
    return 0
