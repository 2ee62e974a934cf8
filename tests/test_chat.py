"""`kdflow chat` and `kdflow.tasks.student.generate.generate` on a student that `kdflow.tasks.student.train` trained
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
from support.chat import Terminal, with_chat_template
from support.children import run, wait_until
from support.runs import run_config, trained_tiny_run

from kdflow.schemas.errors import KDFlowError

PROMPT = "The object"


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> Path:
    """students/student of a 3-step run: tokenise -> dense top-K -> train -> final/."""
    base = tmp_path_factory.mktemp("chat")
    trained_tiny_run(base, tiny_teacher_dir)
    return base / "run" / "students" / "student"


def kdflow_chat(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "kdflow", "chat", *args], what="kdflow chat", input=stdin, timeout=300)


@pytest.mark.usefixtures("children")
def test_saved_student_generates_in_a_fresh_process(student_dir: Path) -> None:
    from kdflow.tasks.student.generate import generate

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


def test_lines_between_triple_quotes_are_one_message(student_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow.cli import main

    transcript = tmp_path / "talk.jsonl"
    block = 'The class\n\n/reset is text here\n  indented'
    monkeypatch.setattr(sys, "stdin", io.StringIO(f'"""\n{block}\n"""\n/save {transcript}\n"""\nA module\nends'))
    capsys.readouterr()
    assert main(["chat", str(student_dir), "--greedy", "--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert "conversation cleared" not in captured.err  # a command inside a block is text
    messages = [json.loads(line) for line in transcript.read_text().splitlines()]
    assert [m["content"] for m in messages if m["role"] == "user"] == [block]
    first = messages[1]["content"] + "\n"
    assert captured.out.startswith(first) and len(captured.out) > len(first)  # the block open at the end: sent


def test_a_student_named_by_a_file_url_is_its_local_folder(student_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow.cli import main

    replies = []
    for name in (str(student_dir), f"file://{student_dir}", f"file://{student_dir / 'final'}"):
        capsys.readouterr()
        assert main(["chat", name, "--prompt", PROMPT, "--greedy", "--max-new-tokens", "4"]) == 0, name
        replies.append(capsys.readouterr().out)
    assert replies[1:] == replies[:1] * 2  # a `file://` run root's student (it said "has no final model yet")


def test_a_folder_that_is_not_a_model_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kdflow.cli import main
    from kdflow.tasks.student.generate import generate

    with pytest.raises(KDFlowError, match="is not a model: no config.json in it"):
        generate(str(tmp_path), PROMPT)
    assert main(["chat", str(tmp_path), "--prompt", PROMPT]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        f"kdflow: error: student '{tmp_path}' is not a model: no config.json in it"]
    (tmp_path / "config.json").write_text("{}")  # a model's file given for its folder (it was NotADirectoryError)
    assert main(["chat", str(tmp_path / "config.json"), "--prompt", PROMPT]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"kdflow: error: student '{tmp_path / 'config.json'}' is not a model: a file, not a model folder"]


def test_a_device_that_is_not_here_and_bad_sampling_settings_are_one_line(
        student_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from kdflow.cli import main
    from kdflow.tasks.common.devices import cuda_unavailable

    cases = [(["--top-p", "2"], "top-p must be in (0, 1] and top-k >= 0 (0: off), got 2.0 and 50"),
             (["--device", "tpu"], "unknown device 'tpu' (auto, cpu, cuda, cuda:N)")]
    if not torch.cuda.is_available():  # it said "AssertionError: Torch not compiled with CUDA enabled"
        why = cuda_unavailable() or f"torch {torch.__version__} finds 0 CUDA devices here"
        cases.append((["--device", "cuda"], f"--device='cuda', but {why}: set it to auto (a GPU when there is one) "
                                            "or cpu"))
    for args, message in cases:
        capsys.readouterr()
        assert main(["chat", str(student_dir), "--prompt", PROMPT, *args]) == 2, args
        assert capsys.readouterr().err.strip().splitlines() == [f"kdflow: error: {message}"]


def test_sampling_is_reproducible_with_a_seed(student_dir: Path) -> None:
    from kdflow.tasks.student.generate import continue_text, load_student

    student = load_student(str(student_dir), "cpu")
    first = continue_text(student, PROMPT, max_new_tokens=12, seed=3)
    assert continue_text(student, PROMPT, max_new_tokens=12, seed=3) == first
    with pytest.raises(ValueError, match="temperature must be > 0"):
        continue_text(student, PROMPT, temperature=0.0)


def test_base_student_continues_text_and_a_chat_template_is_used_when_present(
        student_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kdflow.tasks.student.generate import encode_prompt, load_student

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
    base = run_config(tmp_path, tiny_teacher_dir, corpus).student
    assert student_tokenizer(base, with_template).chat_template is None

    init_dir = tmp_path / "instruct"
    with_template.chat_template = template
    with_template.save_pretrained(init_dir)
    config = run_config(tmp_path, tiny_teacher_dir, corpus, student__init_from=str(init_dir))
    assert student_tokenizer(config.student, AutoTokenizer.from_pretrained(tiny_teacher_dir)).chat_template == template


TERMINAL_USERS = ["What does the with statement do in Python?", "And what does a for loop do?",
                  "Tell me about the classes of objects.", "What is a module and how is it imported?",
                  "How are exceptions raised and caught?"]


def chat_on_terminal(model_dir: Path, *args: str) -> Terminal:
    terminal = Terminal([sys.executable, "-m", "kdflow", "chat", str(model_dir), "--device", "cpu", *args])
    terminal.expect("Ctrl-D ends")
    return terminal


@pytest.mark.usefixtures("children")
def test_on_a_terminal_each_answer_sees_the_history_until_it_is_cut(student_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = with_chat_template(student_dir / "final", tmp_path / "chat-student")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    new_tokens = 6

    def template(messages: list[tuple[str, str]]) -> list[int]:
        return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                             add_generation_prompt=True, tokenize=True)["input_ids"]

    # Room for the second turn with the first (reply of up to 6 tokens, re-tokenised), not for five turns.
    budget = len(template([("user", TERMINAL_USERS[0]), ("assistant", ""), ("user", TERMINAL_USERS[1])])) + 12
    transcript = tmp_path / "talk.jsonl"
    with chat_on_terminal(model_dir, "--greedy", "--max-new-tokens", str(new_tokens), "--max-positions",
                          str(budget + new_tokens)) as terminal:
        for turn, message in enumerate(TERMINAL_USERS, start=1):
            terminal.send(f"{message}\r/settings\r")
            terminal.expect(f"history   {turn} turn{'' if turn == 1 else 's'}")
        terminal.send(f"/save {transcript}\r")
        saved = terminal.expect(f"saved {2 * len(TERMINAL_USERS)} messages")
        # Ctrl-D at the prompt ends the conversation. Typed before the prompt is back, it would be lost: the
        # kernel keeps it as an end-of-file mark while the terminal is line-buffered, and readline, switching the
        # terminal to read key by key for its prompt, receives that mark as a NUL byte.
        terminal.expect("> ", after=saved)
        terminal.send("\x04")
        assert terminal.wait() == 0, terminal.output()
        output = terminal.output()
    assert "history cut: 1 oldest turn left out, to fit in" in output

    messages = [json.loads(line) for line in transcript.read_text().splitlines()]
    users, replies = messages[0::2], messages[1::2]
    assert [m["content"] for m in users] == TERMINAL_USERS
    assert all(m["input_tokens"] <= budget for m in replies)
    second_input = template([("user", TERMINAL_USERS[0]), ("assistant", replies[0]["content"]),
                             ("user", TERMINAL_USERS[1])])
    assert replies[0]["content"].strip()
    assert replies[1]["input_tokens"] == len(second_input)  # the first reply was in the second turn's input
    assert replies[1]["content"] == greedy_after(model_dir, second_input, new_tokens)
    cut = [bool(m.get("cut")) for m in users]
    assert cut[0] and not cut[-1] and cut == sorted(cut, reverse=True)  # the oldest turns, whole


@pytest.mark.usefixtures("children")
def test_ctrl_c_stops_a_reply_and_the_conversation_goes_on(student_dir: Path, tmp_path: Path) -> None:
    model_dir = with_chat_template(student_dir / "final", tmp_path / "endless")
    for name in ("config.json", "generation_config.json"):  # no end-of-sequence token: only Ctrl-C ends a reply
        path = model_dir / name
        data = json.loads(path.read_text())
        path.write_text(json.dumps(data | {"eos_token_id": None}))
    transcript = tmp_path / "talk.jsonl"
    with chat_on_terminal(model_dir, "--max-new-tokens", "100000", "--max-positions", "200000") as terminal:
        start = len(terminal.output())
        terminal.send("Tell me everything.\r")
        wait_until(lambda: len(terminal.output()) > start + 300, what="300 characters of the reply", timeout=300,
                   process=terminal.process, output=terminal.output)
        terminal.send("\x03")
        after = terminal.expect("[reply stopped]")
        terminal.send("/settings\r")
        terminal.expect("history   1 turn,", after=after)
        terminal.send(f"/save {transcript}\r")
        terminal.expect("saved 2 messages", after=after)
        terminal.send("/quit\r")
        assert terminal.wait() == 0, terminal.output()
    reply = json.loads(transcript.read_text().splitlines()[1])
    assert reply["stopped"] is True and 0 < reply["new_tokens"] < 100000 and reply["content"].strip()


def test_a_repetition_penalty_divides_the_scores_of_tokens_already_in_the_text(student_dir: Path) -> None:
    """`--repetition-penalty P` against a greedy loop written here: each step, the scores of ids already in the text
    are divided by P where positive and multiplied by P where negative, then the largest is taken."""
    import torch

    from kdflow.cli import main
    from kdflow.tasks.student.generate import continue_text, load_student

    student = load_student(str(student_dir / "final"), "cpu")
    tokenizer, model = student.tokenizer, student.model
    ids = tokenizer(PROMPT)["input_ids"]
    penalty, new = 1.8, 12
    with torch.no_grad():
        for _ in range(new):
            scores = model(torch.tensor([ids])).logits[0, -1].float()
            seen = torch.tensor(sorted(set(ids)))
            scores[seen] = torch.where(scores[seen] > 0, scores[seen] / penalty, scores[seen] * penalty)
            ids.append(int(scores.argmax()))
    expected = tokenizer.decode(ids[-new:], skip_special_tokens=True)
    assert continue_text(student, PROMPT, max_new_tokens=new, greedy=True, repetition_penalty=penalty) == expected
    assert continue_text(student, PROMPT, max_new_tokens=new, greedy=True) != expected  # it changed the reply
    with pytest.raises(ValueError, match="repetition penalty must be > 0"):
        continue_text(student, PROMPT, repetition_penalty=0.0)
    assert main(["chat", str(student_dir), "--prompt", PROMPT, "--repetition-penalty", "-1"]) == 2
