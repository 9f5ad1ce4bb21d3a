"""A multi-turn conversation on one engine, its KV cache kept across turns (`quasar chat`, the Python API).

Each turn's prompt is the conversation's token ids so far (the earlier prompts and the replies exactly as
they were generated) plus only the new turn's tokens: the chat template is rendered for the whole
conversation and the ids of the text it adds after what the model has already read are appended. So the
engine's prefix cache (quasar.model.kv_cache.CachePool) holds everything before, and a turn prefills only
its own tokens, plus the previous reply's last token (generated, never fed to the model). Where a template
re-renders earlier turns differently (it strips a reply, say), the whole conversation is encoded again and
the prefix cache keeps whatever start still matches.
"""

from __future__ import annotations

from collections.abc import Iterator

from quasar.decoding.engine import Engine, Run
from quasar.decoding.prompt import Messages
from quasar.decoding.sampling import SamplingParams


class Conversation:
    def __init__(self, engine: Engine, system: str | None = None) -> None:
        self.engine = engine
        self.system = system
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.messages: Messages = [{"role": "system", "content": self.system}] if self.system else []
        self.ids: list[int] = []  # what the model has read and written so far, as token ids
        self.turns: list[Run] = []

    def render(self, messages: Messages) -> str:
        """The conversation as the model reads it, up to where the reply starts: its chat template with the
        generation prompt, or (without one) the turns' contents joined by blank lines, as
        quasar.decoding.prompt.encode joins them."""
        tokenizer = self.engine.tokenizer
        if tokenizer.chat_template:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text = "\n\n".join(m["content"] for m in messages)
        return text + "\n\n" if len(messages) > 1 else text

    def prompt_ids(self, messages: Messages) -> list[int]:
        """The ids of the conversation with its next turn: the ids so far plus the new text's, when the rendered
        conversation starts with the text those ids decode to; else the whole conversation encoded again."""
        tokenizer = self.engine.tokenizer
        text = self.render(messages)
        if self.ids:
            read = tokenizer.decode(self.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if text.startswith(read) and len(text) > len(read):
                return self.ids + tokenizer.encode(text[len(read):], add_special_tokens=False)
        return tokenizer.encode(text, add_special_tokens=not tokenizer.chat_template)  # a template has its own

    def send(self, text: str, params: SamplingParams) -> Run:
        """Start the reply to `text`. Iterate the Run for its pieces; when it ends, or is closed early (the reply
        interrupted), the conversation keeps the turn with the reply as far as it got."""
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.prompt_ids(messages)
        run = self.engine.run(ids, params, messages)

        def pieces() -> Iterator[str]:
            try:
                yield from run
            finally:
                run.close()
                self.messages = [*messages, {"role": "assistant", "content": run.output.text}]
                self.ids = ids + run.output.token_ids

        turn = Run(run.output, pieces())
        self.turns.append(turn)
        return turn
