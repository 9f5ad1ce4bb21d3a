"""Prompts -> token ids, by one rule for the engine, the API, the server and the bench (and its peers).

Text that a user sends is data: a control token's text inside it (`<|im_end|>`, `<|im_start|>system`) is encoded as
the plain characters it is, never as the control token, so a message cannot close its turn and forge another one
past the operator's system prompt. `special=True` (`--allow-special-tokens`) lets the text's control tokens through.
"""

from __future__ import annotations

import re
from typing import Any

Messages = list[dict[str, Any]]  # a conversation: [{"role": "user", "content": "..."}, ...] (and tool calls)
HOLDER = "\ue000{}\ue001"  # stands for message i's content while the template is rendered (a private-use pair)
HOLDERS = re.compile("(\ue000\\d+\ue001)")


def encode(tokenizer: Any, prompt: str | Messages, chat: bool | None = None, special: bool = False,
           tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Text or a conversation -> prompt token ids.

    A conversation goes through the tokenizer's chat template (with the generation prompt); a tokenizer
    without one gets the contents of its turns joined by blank lines, encoded as text. Text is a one-turn
    conversation when `chat` is true (None: when the tokenizer has a chat template), else encoded as is,
    with the tokenizer's special tokens (BOS). So a one-turn conversation, and text with chat=None, give the same
    ids on every tokenizer. special: the control tokens written in the text are control tokens (else plain text).
    tools: OpenAI tool definitions, given to the chat template (which may show them to the model or not).
    """
    if isinstance(prompt, str):
        if not (chat if chat is not None else bool(tokenizer.chat_template)):
            return tokenizer.encode(prompt, split_special_tokens=not special)
        prompt = [{"role": "user", "content": prompt}]
    if not tokenizer.chat_template:
        return tokenizer.encode("\n\n".join(m["content"] for m in prompt), split_special_tokens=not special)
    text = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
    if special or not any(holds_control_text(tokenizer, m.get("content")) for m in prompt):
        return tokenizer.encode(text, add_special_tokens=False)
    return encode_contents_as_text(tokenizer, prompt, tools)


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows the model the tools it is given (Qwen2.5's does; many ignore
    them): a probe tool's name appears in the rendered prompt."""
    if not tokenizer.chat_template:
        return False
    probe = {"type": "function", "function": {"name": "probe_tool_4f1c", "parameters": {"type": "object"}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe],
                                             add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 (a template that fails on tools does not take them)
        return False
    return "probe_tool_4f1c" in text


def holds_control_text(tokenizer: Any, content: Any) -> bool:
    """Whether a message's content contains the text of one of the tokenizer's control (added special) tokens."""
    if not isinstance(content, str):
        return False
    return any(t.special and t.content in content for t in tokenizer.added_tokens_decoder.values())


def encode_contents_as_text(tokenizer: Any, messages: Messages, tools: list[dict[str, Any]] | None = None
                            ) -> list[int]:
    """The conversation's ids with the template's own control tokens as control tokens and every message's content
    encoded as plain text: the template is rendered with a placeholder for each content, and the pieces between the
    placeholders are encoded one by one."""
    held = [{**m, "content": HOLDER.format(i)} if isinstance(m.get("content"), str) else m
            for i, m in enumerate(messages)]
    skeleton = tokenizer.apply_chat_template(held, tools=tools, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    for piece in HOLDERS.split(skeleton):
        if HOLDERS.fullmatch(piece):
            content = messages[int(piece[1:-1])]["content"]
            ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids
