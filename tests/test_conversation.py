"""The conversation of `kdflow chat` without a terminal or a model (kdflow.tasks.student.conversation): what goes
into the model each turn in both modes, the cut of whole turns from the front, the transcript."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.chat import CHAT_TEMPLATE

from kdflow.schemas.errors import KDFlowError
from kdflow.tasks.student.conversation import Conversation, MessageTooLong

USERS = ["What does the with statement do?", "And a for loop?", "Tell me about classes.", "What is a module?",
         "How are exceptions raised?", "What is a generator?"]


def reply_of(index: int) -> str:
    return f" reply number {index} about the object model"


@pytest.fixture(scope="module")
def base_tokenizer(tiny_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def rendered(tokenizer: Any, system: str | None, pairs: list[tuple[str, str]], user: str) -> list[int]:
    """The reference: the template text written out by hand, tokenised without special tokens."""
    text = f"system: {system}\n" if system else ""
    text += "".join(f"user: {u}\nassistant: {a}\n" for u, a in pairs) + f"user: {user}\nassistant:"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def talk(conversation: Conversation, turns: int) -> list[Any]:
    prepared = []
    for index in range(turns):
        prepared.append(conversation.prepare(USERS[index]))
        conversation.finish(reply_of(index), new_tokens=3)
    return prepared


def test_each_turn_sends_the_whole_history_through_the_template(chat_tokenizer: Any) -> None:
    conversation = Conversation(chat_tokenizer, max_positions=4096, max_new_tokens=16, system="Be brief.")
    assert conversation.mode == "template"
    first, second, third = talk(conversation, 3)
    assert first.input_ids == rendered(chat_tokenizer, "Be brief.", [], USERS[0])
    assert second.input_ids == rendered(chat_tokenizer, "Be brief.", [(USERS[0], reply_of(0))], USERS[1])
    assert reply_of(0) in chat_tokenizer.decode(second.input_ids)  # the second turn sees the first reply
    assert len(third.input_ids) > len(second.input_ids) > len(first.input_ids)
    assert (first.cut, second.kept, third.kept) == (0, 1, 2)
    assert [t.input_tokens for t in conversation.turns] == [len(p.input_ids) for p in (first, second, third)]


def test_without_a_template_the_running_text_is_continued(base_tokenizer: Any) -> None:
    conversation = Conversation(base_tokenizer, max_positions=4096, max_new_tokens=16)
    assert conversation.mode == "transcript"
    first, second = talk(conversation, 2)
    assert first.input_ids == base_tokenizer(USERS[0])["input_ids"]
    text = USERS[0] + reply_of(0) + "\n" + USERS[1]
    assert second.input_ids == base_tokenizer(text)["input_ids"]

    with_system = Conversation(base_tokenizer, max_positions=4096, max_new_tokens=16, system="Python notes.")
    assert with_system.prepare(USERS[0]).input_ids == base_tokenizer("Python notes.\n" + USERS[0])["input_ids"]
    assert Conversation(base_tokenizer, max_positions=64, max_new_tokens=8).prepare("").input_ids == [
        base_tokenizer.bos_token_id]


@pytest.mark.parametrize("mode", ["template", "transcript"])
def test_whole_turns_are_cut_from_the_front_to_fit_the_positions(mode: str, chat_tokenizer: Any,
                                                                 base_tokenizer: Any) -> None:
    tokenizer = chat_tokenizer if mode == "template" else base_tokenizer
    system = "Be brief." if mode == "template" else None
    unlimited = Conversation(tokenizer, max_positions=100_000, max_new_tokens=10, system=system)
    full = talk(unlimited, len(USERS))
    positions = len(full[3].input_ids) + 10 - 1  # the fourth turn with its whole history is one token too long
    conversation = Conversation(tokenizer, max_positions=positions, max_new_tokens=10, system=system)
    prepared = talk(conversation, len(USERS))

    first_kept = 0
    for index, turn in enumerate(prepared):
        # the reference: the longest run of latest turns whose input fits, never going back to cut turns
        while len(unlimited.render(unlimited.turns[first_kept:index], USERS[index])) > positions - 10:
            first_kept += 1
        assert turn.input_ids == unlimited.render(unlimited.turns[first_kept:index], USERS[index])
        assert turn.kept == index - first_kept
        assert len(turn.input_ids) <= conversation.budget
    assert [p.cut for p in prepared[:3]] == [0, 0, 0] and prepared[3].cut >= 1
    assert sum(p.cut for p in prepared) == conversation.first_kept == first_kept
    if system:  # the system message stays
        assert all(tokenizer.decode(p.input_ids).startswith(f"system: {system}\nuser: ") for p in prepared)

    messages = conversation.transcript()
    assert len(messages) == 2 * len(USERS) + (1 if system else 0)
    turns = [m for m in messages if m["role"] != "system"]
    assert all(m.get("cut") for m in turns[:2 * first_kept]) and not any(m.get("cut") for m in turns[2 * first_kept:])


def test_a_message_that_does_not_fit_alone_is_refused_and_changes_nothing(chat_tokenizer: Any) -> None:
    conversation = Conversation(chat_tokenizer, max_positions=80, max_new_tokens=8, system="Be brief.")
    talk(conversation, 1)
    before = conversation.transcript()
    with pytest.raises(MessageTooLong, match=r"this message is \d+ tokens with the system text; at most 72 fit "
                                             r"\(80 positions less 8 new tokens\)"):
        conversation.prepare(" ".join(USERS * 3))
    assert conversation.transcript() == before and conversation.first_kept == 0
    with pytest.raises(KDFlowError, match="max_new_tokens 40 leaves no room for the conversation in the model's 40"):
        Conversation(chat_tokenizer, max_positions=40, max_new_tokens=40)


def test_the_transcript_reset_and_a_failed_reply(chat_tokenizer: Any) -> None:
    conversation = Conversation(chat_tokenizer, max_positions=4096, max_new_tokens=16, system="Be brief.")
    talk(conversation, 1)
    conversation.prepare(USERS[1])
    conversation.finish("half a rep", new_tokens=2, stopped=True)
    conversation.prepare(USERS[2])
    conversation.abandon()  # the reply failed: the turn is gone
    lines = [json.loads(line) for line in conversation.transcript_jsonl().splitlines()]
    assert [(m["role"], m["content"]) for m in lines] == [
        ("system", "Be brief."), ("user", USERS[0]), ("assistant", reply_of(0)), ("user", USERS[1]),
        ("assistant", "half a rep")]
    assert lines[2]["input_tokens"] == conversation.turns[0].input_tokens and lines[2]["stopped"] is False
    assert (lines[4]["new_tokens"], lines[4]["stopped"]) == (2, True)
    assert conversation.settings() | {"last_input_tokens": 0} == {
        "mode": "template", "system": "Be brief.", "max_positions": 4096, "max_new_tokens": 16, "input_budget": 4080,
        "turns": 2, "turns_cut": 0, "last_input_tokens": 0}

    conversation.reset()
    assert conversation.transcript() == [{"role": "system", "content": "Be brief."}]
    assert conversation.prepare(USERS[3]).input_ids == rendered(chat_tokenizer, "Be brief.", [], USERS[3])
    with pytest.raises(RuntimeError, match="finish"):
        conversation.prepare(USERS[4])
