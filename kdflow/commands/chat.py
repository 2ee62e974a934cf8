"""`kdflow chat STUDENT_DIR`: a conversation with a saved student on the terminal.

With `--prompt TEXT`, one reply to TEXT alone is printed (for scripts). Otherwise every line read is a message of
one conversation (kdflow.tasks.student.conversation: the history through the chat template, or the running text
of a base student, cut from the front to fit the model's positions); replies are printed as they are generated.
Lines starting with `/` are commands (COMMANDS); `//text` sends `/text`. A message of several lines goes
between two lines of three double quotes (BLOCK; what a terminal pastes in one piece needs none). Ctrl-C stops a
reply and keeps the conversation; Ctrl-D, /quit or the end of the input ends it. Replies go to stdout, everything
else to stderr, so `kdflow chat DIR < questions.txt > answers.txt` keeps only the replies.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

from kdflow.tasks.common.progress import count_of

COMMANDS = {
    "/reset": "forget the conversation (the system text stays)",
    "/settings": "the student, the mode, the positions and the decoding",
    "/save FILE": "write the transcript as JSON lines",
    "/help": "this list",
    "/quit": "end (also Ctrl-D)",
}
BLOCK = '"""'  # a line of its own: the lines up to the next such line are one message


def _note(text: str) -> None:
    print(f"[{text}]", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _ctrl_c_sets(event: threading.Event) -> Iterator[None]:
    """While the block runs, Ctrl-C (SIGINT) sets `event` instead of raising KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatSession:
    """One conversation: reads lines, runs commands, streams replies to `out`."""

    def __init__(self, student: Any, conversation: Any, decoding: Any, seed: int, out: TextIO) -> None:
        self.student, self.conversation, self.decoding, self.seed, self.out = student, conversation, decoding, seed, out

    def command(self, line: str) -> bool:
        """Run a /command; -> False when the conversation ends."""
        name, _, argument = line.strip().partition(" ")
        argument = argument.strip()
        if name in ("/quit", "/exit"):
            return False
        if name == "/reset":
            self.conversation.reset()
            _note("conversation cleared")
        elif name == "/settings":
            self.show_settings()
        elif name == "/save":
            self.save(argument)
        elif name == "/help":
            for usage, what in COMMANDS.items():
                print(f"  {usage:<12} {what}", file=sys.stderr)
            print(f"  {BLOCK:<12} on a line of its own: the lines up to the next {BLOCK} are one message",
                  file=sys.stderr)
            print("  Ctrl-C       stop a reply (the conversation goes on)", file=sys.stderr, flush=True)
        else:
            _note(f"unknown command {name} (/help lists them; //text sends /text)")
        return True

    def show_settings(self) -> None:
        settings = self.conversation.settings()
        mode = ("template: the history goes through the tokenizer's chat template" if settings["mode"] == "template"
                else "transcript: no chat template, the running text is continued")
        last = settings["last_input_tokens"]
        lines = [f"student   {self.student.folder} on {self.student.device}",
                 f"mode      {mode}",
                 f"system    {settings['system']!r}" if settings["system"] else "system    none",
                 f"positions {settings['max_positions']}: input up to {settings['input_budget']} tokens, "
                 f"{settings['max_new_tokens']} for the reply",
                 f"decoding  {self.decoding.describe()}, seed {self.seed}",
                 f"history   {count_of(settings['turns'], 'turn')}, {settings['turns_cut']} cut"
                 + (f"; last input {last} tokens" if last is not None else "")]
        print("\n".join(lines), file=sys.stderr, flush=True)

    def save(self, path: str) -> None:
        if not path:
            _note("/save needs a file name: /save FILE")
            return
        text = self.conversation.transcript_jsonl()
        try:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
        except OSError as error:
            _note(f"cannot save to {path}: {error.strerror or error}")
            return
        _note(f"saved {text.count(chr(10))} messages to {path}")

    def say(self, message: str) -> None:
        """One turn: the input (cut if needed), the reply streamed, the history updated."""
        from kdflow.tasks.student.conversation import MessageTooLong
        from kdflow.tasks.student.generate import reply_to

        conversation = self.conversation
        try:
            prepared = conversation.prepare(message)
        except MessageTooLong as error:
            _note(f"not sent: {error}")
            return
        if prepared.cut:
            _note(f"history cut: {count_of(prepared.cut, 'oldest turn')} left out, to fit in "
                  f"{conversation.max_positions} positions with {conversation.max_new_tokens} new tokens; "
                  f"{count_of(prepared.kept, 'earlier turn')} kept")

        def show(text: str) -> None:
            self.out.write(text)
            self.out.flush()

        stop = threading.Event()
        try:
            with _ctrl_c_sets(stop):
                reply = reply_to(self.student, prepared.input_ids, self.decoding, on_text=show, stop=stop)
        except BaseException:
            conversation.abandon()
            raise
        conversation.finish(reply.text, new_tokens=reply.new_tokens, stopped=reply.stopped)
        self.out.write("\n")
        self.out.flush()
        if reply.stopped:
            _note("reply stopped")

    @staticmethod
    def read_block(interactive: bool) -> tuple[str, bool]:
        """The lines up to a closing BLOCK line, as one message (commands inside are text); -> (message, whether
        the input ended). Ctrl-C drops the block; the end of the input sends what it holds."""
        lines: list[str] = []
        while True:
            try:
                line = input("... " if interactive else "")
            except EOFError:
                return "\n".join(lines), True
            except KeyboardInterrupt:
                print(file=sys.stderr)
                _note("message dropped")
                return "", False
            if line.strip() == BLOCK:
                return "\n".join(lines), False
            lines.append(line)

    def loop(self, interactive: bool) -> None:
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                if interactive:
                    print(file=sys.stderr)
                return
            except KeyboardInterrupt:  # at the prompt: a fresh line, the conversation goes on
                print(file=sys.stderr)
                continue
            if line.strip() == BLOCK:
                line, ended = self.read_block(interactive)
                if line.strip():
                    self.say(line)
                if ended:
                    return
                continue
            if not line.strip():
                continue
            if line.startswith("/") and not line.startswith("//"):
                if not self.command(line):
                    return
                continue
            self.say(line[1:] if line.startswith("//") else line)


def chat_main(args: argparse.Namespace) -> int:
    """`kdflow chat`: one --prompt, or a conversation read line by line from the terminal (or stdin)."""
    import torch

    from kdflow.schemas.errors import KDFlowError
    from kdflow.tasks.student.conversation import Conversation
    from kdflow.tasks.student.generate import Decoding, continue_text, encode_prompt, load_student, max_positions

    decoding = Decoding(args.max_new_tokens, args.greedy, args.temperature, args.top_p, args.top_k,
                        args.repetition_penalty)
    try:
        decoding.check()
    except ValueError as error:
        raise KDFlowError(str(error)) from None
    student = load_student(args.student_dir, args.device)
    positions = args.max_positions or max_positions(student)
    if args.prompt is not None:
        needed = len(encode_prompt(student.tokenizer, args.prompt, args.system)) + args.max_new_tokens
        if positions is not None and needed > positions:  # as a conversation refuses a message that does not fit
            raise KDFlowError(f"--prompt does not fit: {needed - args.max_new_tokens} tokens and --max-new-tokens "
                              f"{args.max_new_tokens} need {needed} positions, the student has {positions} "
                              "(--max-positions): shorten it")
        print(continue_text(student, args.prompt, seed=args.seed, system=args.system,
                            max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, repetition_penalty=args.repetition_penalty),
              flush=True)
        return 0
    if positions is None:
        raise KDFlowError(f"student {student.folder!r} does not say how many positions it has "
                          "(max_position_embeddings): give --max-positions")
    conversation = Conversation(student.tokenizer, max_positions=positions, max_new_tokens=args.max_new_tokens,
                                system=args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        mode = "chat template" if conversation.mode == "template" else "no chat template: your text is continued"
        print(f"student {student.folder} ({mode}); /help for commands, Ctrl-C stops a reply, Ctrl-D ends",
              file=sys.stderr, flush=True)
    torch.manual_seed(args.seed)  # seeded once: each reply continues the same random stream
    ChatSession(student, conversation, decoding, args.seed, sys.stdout).loop(interactive)
    return 0
