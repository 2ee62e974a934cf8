"""`kdflow chat` and `kdflow.tasks.student.chat.generate` on a student that `kdflow.tasks.student.train` trained
and saved: the saved `final/` loads in a fresh process and generates; prompts, the interactive loop, templates,
bad folders."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.children import run
from support.corpus import sample_documents, write_jsonl
from support.runs import make_tokens, run_config, write_dense_topk

from kdflow.schemas.errors import KDFlowError

PROMPT = "The object"


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> Path:
    """students/student of a 3-step run: tokenise -> dense top-K -> train -> final/."""
    from kdflow.tasks.student.train import train

    base = tmp_path_factory.mktemp("chat")
    corpus = write_jsonl(base / "docs.jsonl", sample_documents(20))
    config = run_config(base / "run", tiny_teacher_dir, corpus, student__steps=3, student__eval_shards=1)
    make_tokens(config)
    write_dense_topk(config, tiny_teacher_dir)
    train(config)
    return base / "run" / "students" / "student"


def kdflow_chat(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "kdflow", "chat", *args], what="kdflow chat", input=stdin, timeout=300)


@pytest.mark.usefixtures("children")
def test_saved_student_generates_in_a_fresh_process(student_dir: Path) -> None:
    from kdflow.tasks.student.chat import generate

    final = student_dir / "final"
    expected = generate(str(final), PROMPT, max_new_tokens=8, greedy=True, device="cpu")
    done = kdflow_chat(str(final), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "8", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"


def greedy_after(model_dir: Path, input_ids: list[int], new_tokens: int) -> str:
    """The reference reply: plain transformers, greedy, after exactly these ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, len(input_ids):], skip_special_tokens=True)


def test_lines_from_stdin_are_one_conversation_that_continues_the_running_text(
        student_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    from kdflow.cli import main

    final = student_dir / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    first = greedy_after(final, tokenizer("The class")["input_ids"], 5)
    second = greedy_after(final, tokenizer("The class" + first + "\nA module")["input_ids"], 5)
    transcript = tmp_path / "talk.jsonl"
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"The class\n\nA module\n/save {transcript}\n/nope\n"))
    assert main(["chat", str(student_dir), "--greedy", "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out == first + "\n" + second + "\n"  # replies only; an empty line is skipped, EOF ends
    assert f"[saved 4 messages to {transcript}]" in captured.err and "unknown command /nope" in captured.err
    messages = [json.loads(line) for line in transcript.read_text().splitlines()]
    assert [(m["role"], m["content"]) for m in messages] == [("user", "The class"), ("assistant", first),
                                                             ("user", "A module"), ("assistant", second)]


def test_a_folder_that_is_not_a_model_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow.cli import main
    from kdflow.tasks.student.chat import generate

    with pytest.raises(KDFlowError, match="is not a model: no config.json in it"):
        generate(str(tmp_path), PROMPT)
    assert main(["chat", str(tmp_path), "--prompt", PROMPT]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        f"kdflow: error: student '{tmp_path}' is not a model: no config.json in it"]


def test_sampling_is_reproducible_with_a_seed(student_dir: Path) -> None:
    from kdflow.tasks.student.chat import continue_text, load_student

    student = load_student(str(student_dir), "cpu")
    first = continue_text(student, PROMPT, max_new_tokens=12, seed=3)
    assert continue_text(student, PROMPT, max_new_tokens=12, seed=3) == first
    with pytest.raises(ValueError, match="temperature must be > 0"):
        continue_text(student, PROMPT, temperature=0.0)


def test_base_student_continues_text_and_a_chat_template_is_used_when_present(
        student_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kdflow.tasks.student.chat import encode_prompt, load_student

    base = load_student(str(student_dir), "cpu").tokenizer
    assert not base.chat_template
    assert encode_prompt(base, PROMPT) == base(PROMPT)["input_ids"]
    assert encode_prompt(base, "") == [base.bos_token_id]

    chat_dir = tmp_path / "chat-student"
    shutil.copytree(student_dir / "final", chat_dir)
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    tokenizer.chat_template = "{% for m in messages %}<|endoftext|>user: {{ m['content'] }}\n{% endfor %}assistant:"
    tokenizer.save_pretrained(chat_dir)
    templated = load_student(str(chat_dir), "cpu").tokenizer
    rendered = f"<|endoftext|>user: {PROMPT}\nassistant:"
    assert encode_prompt(templated, PROMPT) == templated(rendered, add_special_tokens=False)["input_ids"]


def test_only_an_init_from_student_keeps_a_chat_template(tmp_path: Path, tiny_teacher_dir: Path) -> None:
    from transformers import AutoTokenizer

    from kdflow.tasks.student.model import student_tokenizer

    corpus = tmp_path / "docs.jsonl"
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with_template = AutoTokenizer.from_pretrained(tiny_teacher_dir)
    with_template.chat_template = template
    assert student_tokenizer(run_config(tmp_path, tiny_teacher_dir, corpus), with_template).chat_template is None

    init_dir = tmp_path / "instruct"
    with_template.chat_template = template
    with_template.save_pretrained(init_dir)
    config = run_config(tmp_path, tiny_teacher_dir, corpus, student__init_from=str(init_dir))
    assert student_tokenizer(config, AutoTokenizer.from_pretrained(tiny_teacher_dir)).chat_template == template
