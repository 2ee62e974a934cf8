"""A conversation with a saved student, without a terminal: the history, what goes into the model each turn, the
cut of the oldest turns to fit its positions, and the transcript. `kdflow chat`
(kdflow.commands.chat) is the terminal side.

Two modes, chosen by the tokenizer:
- `template`: the tokenizer has a chat template (an `init_from` instruction-tuned student). Each turn the whole
  history (the system message, the earlier user and assistant messages, the new user message) goes through the
  template with the generation prompt.
- `transcript`: no template (a base student). The conversation is one running text: the system text, then each
  user message on a new line, each followed by the student's continuation of it; each turn continues that text.

The input must leave `max_new_tokens` of the model's `max_positions` free. When it does not, whole turns (a user
message and its reply) are cut from the front, the system message staying, until it does; cut turns stay in the
transcript but are not sent again. A new message that does not fit even alone is refused (`MessageTooLong`) and
changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kdflow.schemas.errors import KDFlowError

TRANSCRIPT_SEPARATOR = "\n"  # between the running text and the next user message (transcript mode)


class MessageTooLong(KDFlowError):
    """The new message (with the system text) does not fit in the model's positions on its own."""


@dataclass
class Turn:
    user: str
    reply: str | None = None  # None until the reply is finished (or stopped)
    input_tokens: int = 0  # the length of the model's input for this turn
    new_tokens: int = 0
    stopped: bool = False  # the reply was stopped (Ctrl-C) before its end


@dataclass(frozen=True)
class Prepared:
    """The model's input for a new turn."""

    input_ids: list[int]
    cut: int  # earlier turns cut from the input by this turn (0 when none newly)
    kept: int  # earlier turns in the input


def token_ids(encoded: Any) -> list[int]:
    """The ids of what `tokenizer(...)` or `apply_chat_template(tokenize=True)` returned (a dict or a list)."""
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return [int(i) for i in ids]


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat template over `messages`, with the generation prompt: what the student continues."""
    return token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Plain text to continue; an empty one starts a document (as after the EOS that separates training documents)."""
    ids = token_ids(tokenizer(text, add_special_tokens=True))
    if not ids:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = [start]
    return ids


def running_text(system: str | None, pieces: list[tuple[str, str]], user: str) -> str:
    """Transcript mode: the system text, then each (user, reply) and the new user message, users on new lines."""
    text = system or ""
    for earlier, reply in [*pieces, (user, "")]:
        text += (TRANSCRIPT_SEPARATOR if text else "") + earlier + reply
    return text


class Conversation:
    """The history of one conversation and the model input of each new turn (see the module's docstring)."""

    def __init__(self, tokenizer: Any, *, max_positions: int, max_new_tokens: int, system: str | None = None) -> None:
        if max_new_tokens < 1:
            raise KDFlowError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if max_new_tokens >= max_positions:
            raise KDFlowError(f"max_new_tokens {max_new_tokens} leaves no room for the conversation in the model's "
                              f"{max_positions} positions: lower it or raise the positions (--max-positions)")
        self.tokenizer, self.max_positions, self.max_new_tokens = tokenizer, max_positions, max_new_tokens
        self.system = system or None
        self.mode = "template" if has_template(tokenizer) else "transcript"
        self.turns: list[Turn] = []
        self.first_kept = 0  # turns before this index are cut: no longer sent

    @property
    def budget(self) -> int:
        """The most input tokens a turn may have."""
        return self.max_positions - self.max_new_tokens

    def render(self, earlier: list[Turn], user: str) -> list[int]:
        """The model input for `user` after the `earlier` turns."""
        if self.mode == "template":
            messages = [{"role": "system", "content": self.system}] if self.system else []
            for turn in earlier:
                messages += [{"role": "user", "content": turn.user},
                             {"role": "assistant", "content": turn.reply or ""}]
            return template_ids(self.tokenizer, [*messages, {"role": "user", "content": user}])
        return text_ids(self.tokenizer, running_text(self.system, [(t.user, t.reply or "") for t in earlier], user))

    def prepare(self, user: str) -> Prepared:
        """Start a turn: the input for `user`, with as many of the latest turns as fit. The turn is open until
        `finish`; a message that does not fit alone raises MessageTooLong and changes nothing."""
        if self.turns and self.turns[-1].reply is None:
            raise RuntimeError("the last turn has no reply yet: finish() it first")
        start = self.first_kept
        while True:
            ids = self.render(self.turns[start:], user)
            if len(ids) <= self.budget:
                break
            if start == len(self.turns):
                with_system = " with the system text" if self.system else ""
                raise MessageTooLong(f"this message is {len(ids)} tokens{with_system}; at most {self.budget} fit "
                                     f"({self.max_positions} positions less {self.max_new_tokens} new tokens)")
            start += 1
        cut, self.first_kept = start - self.first_kept, start
        self.turns.append(Turn(user, input_tokens=len(ids)))
        return Prepared(ids, cut, len(self.turns) - 1 - start)

    def finish(self, reply: str, *, new_tokens: int = 0, stopped: bool = False) -> None:
        """Close the open turn with the student's reply (a stopped reply is kept as far as it got)."""
        if not self.turns or self.turns[-1].reply is not None:
            raise RuntimeError("no turn is open")
        turn = self.turns[-1]
        turn.reply, turn.new_tokens, turn.stopped = reply, new_tokens, stopped

    def abandon(self) -> None:
        """Drop the open turn (its reply failed): the history is as before it."""
        if self.turns and self.turns[-1].reply is None:
            self.turns.pop()
            self.first_kept = min(self.first_kept, len(self.turns))

    def reset(self) -> None:
        """Forget every turn; the system message stays."""
        self.turns, self.first_kept = [], 0

    def transcript(self) -> list[dict[str, Any]]:
        """The conversation as messages, cut turns included (`cut: true`); replies carry their input and new token
        counts and whether they were stopped."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.system}] if self.system else []
        for index, turn in enumerate(self.turns):
            if turn.reply is None:
                continue
            cut = {"cut": True} if index < self.first_kept else {}
            messages.append({"role": "user", "content": turn.user, **cut})
            messages.append({"role": "assistant", "content": turn.reply, "input_tokens": turn.input_tokens,
                             "new_tokens": turn.new_tokens, "stopped": turn.stopped, **cut})
        return messages

    def transcript_jsonl(self) -> str:
        return "".join(json.dumps(message, ensure_ascii=False) + "\n" for message in self.transcript())

    def settings(self) -> dict[str, Any]:
        """What /settings shows of the conversation."""
        done = [turn for turn in self.turns if turn.reply is not None]
        return {"mode": self.mode, "system": self.system, "max_positions": self.max_positions,
                "max_new_tokens": self.max_new_tokens, "input_budget": self.budget, "turns": len(done),
                "turns_cut": self.first_kept, "last_input_tokens": done[-1].input_tokens if done else None}
