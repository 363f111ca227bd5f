"""kdn.template: the chat frame both the origin's publish and the engine's prompt are cut from."""

from __future__ import annotations

import pytest

from kdn.errors import InvalidInput
from kdn.template import chat_frame, encode_text


class Templated:
    """A tokenizer with a chat template rendered by a format string (what matters is where content lands)."""

    chat_template = "fmt"

    def __init__(self, fmt: str = "<{role}>{content}</{role}>") -> None:
        self.fmt = fmt

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        out = "".join(self.fmt.format(**m) for m in messages)
        return out + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text] if not add_special_tokens else [1] + [ord(c) for c in text]


class Bare:
    def encode(self, text):  # the byte tokenizer of tiny models: no keyword
        return list(text.encode())


def test_the_frame_splits_around_the_users_message_with_and_without_a_system_turn():
    tok = Templated()
    assert chat_frame(tok) == ("<user>", "</user><assistant>")
    assert chat_frame(tok, generation_prompt=False) == ("<user>", "</user>")
    head, tail = chat_frame(tok, "be brief")
    assert head == "<system>be brief</system><user>" and tail == "</user><assistant>"
    # what the origin publishes + what the engine appends is the template's own rendering
    doc = "a document"
    full = tok.apply_chat_template([{"role": "user", "content": doc}], add_generation_prompt=True)
    assert chat_frame(tok, generation_prompt=False)[0] + doc + chat_frame(tok)[1] == full


def test_a_template_that_does_not_place_the_message_verbatim_once_is_refused():
    with pytest.raises(InvalidInput, match="verbatim"):
        chat_frame(Templated("<{role}>{content}|{content}</{role}>"))
    with pytest.raises(InvalidInput, match="verbatim"):
        chat_frame(Templated("<{role}>[redacted]</{role}>"))
    with pytest.raises(InvalidInput, match="no chat template"):
        chat_frame(Bare())


def test_encode_text_adds_no_special_tokens_and_takes_tokenizers_without_the_keyword():
    assert encode_text(Templated(), "ab") == [97, 98]
    assert encode_text(Bare(), "ab") == [97, 98]
