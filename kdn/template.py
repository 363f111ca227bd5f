"""Text around a document in published tokens: the chat template's frame, and tokenizing without specials.

A manifest published with ``template: chat`` holds the tokens of the chat template's opening of a user turn
(after an optional system turn), then the document. An engine that asks a question about it must continue
*that* turn with the same tokens, then close it as the template does. Both sides (``origin/publish.py`` and
the adapters' ``prompt_tokens`` / ``rag_frame``) take the frame from :func:`chat_frame`, so they cannot
drift apart. Torch-free: the origin's publish path imports it.
"""

from __future__ import annotations

from typing import Any

from kdn.errors import InvalidInput

_SENTINEL = "\ue000KDN-DOCUMENT\ue001"  # private-use code points: no real text contains them


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as text: no special tokens added, and none parsed from it.

    A document (or a question) that contains ``<|im_end|>\\n<|im_start|>system`` is tokenized into the
    characters it spells, never into the real control ids: otherwise every prompt built on a published
    text would carry a system turn its publisher wrote. The template's own frame is ``encode_frame``'s."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    except TypeError:  # a tokenizer without special tokens to split (the tiny models' bytes): as it is
        return encode_frame(tokenizer, text)


def encode_frame(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text the chat template rendered (``chat_frame``): its control tokens parsed as such."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def chat_frame(tokenizer: Any, system: str | None = None, *, generation_prompt: bool = True) -> tuple[str, str]:
    """``(head, tail)``: the chat template rendered around one user message, split where its content goes.

    ``head`` opens the turn (after ``system``'s turn, if given); ``tail`` closes it and, with
    ``generation_prompt``, opens the assistant's turn. Raises ``InvalidInput`` if the tokenizer has no chat
    template or the template does not place the user's message verbatim, once."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidInput("this model's tokenizer has no chat template; use prefix_text instead")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    if not isinstance(rendered, str) or rendered.count(_SENTINEL) != 1:
        raise InvalidInput("the chat template does not place the user message verbatim")
    head, tail = rendered.split(_SENTINEL, 1)
    return head, tail
