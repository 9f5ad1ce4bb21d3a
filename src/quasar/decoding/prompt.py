"""Prompts -> token ids, by one rule for the engine, the API, the server and the bench (and its peers)."""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, str]]  # a conversation: [{"role": "user", "content": "..."}, ...]


def encode(tokenizer: Any, prompt: str | Messages, chat: bool | None = None) -> list[int]:
    """Text or a conversation -> prompt token ids.

    A conversation goes through the tokenizer's chat template (with the generation prompt); a tokenizer
    without one gets the contents of its turns joined by blank lines, encoded as text. Text is a one-turn
    conversation when `chat` is true (None: when the tokenizer has a chat template), else encoded as is,
    with the tokenizer's special tokens. So a one-turn conversation, and text with chat=None, give the same
    ids on every tokenizer.
    """
    if isinstance(prompt, str):
        if not (chat if chat is not None else bool(tokenizer.chat_template)):
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    if not tokenizer.chat_template:
        return tokenizer.encode("\n\n".join(m["content"] for m in prompt))
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
