"""GSM8K: exact match of the final number (the reference's '#### N'), chat prompt, greedy decoding."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from quasar.decoding.engine import Engine
from quasar.tools.evals import data
from quasar.tools.evals.task import ItemResult, TaskOptions
from quasar.decoding.sampling import SamplingParams

INSTRUCTION = (
    "Solve the following math problem step by step. "
    "Give the final answer as a number on the last line, in the form '#### <number>'."
)
DEFAULT_MAX_NEW_TOKENS = 256
NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
# the places a final answer is stated, most explicit first; the last number of the text is the fallback
ANSWER_PATTERNS = (
    re.compile(rf"####\s*({NUMBER})"),
    re.compile(rf"\\boxed\{{\s*({NUMBER})"),
    re.compile(rf"answer\s*(?:is|:|=)\s*\**\s*({NUMBER})", re.IGNORECASE),
)


def normalize(number: str) -> str | None:
    """'$1,234.50' -> '1234.5', '18.00' -> '18'; None when it is not a number."""
    text = number.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(completion: str) -> str | None:
    """The final number a completion states, normalised; None when it states none."""
    for pattern in ANSWER_PATTERNS:
        found = pattern.findall(completion)
        if found:
            return normalize(found[-1])
    numbers = re.findall(NUMBER, completion)
    return normalize(numbers[-1]) if numbers else None


def is_correct(completion: str, reference: str) -> bool:
    predicted = extract_answer(completion)
    return predicted is not None and predicted == normalize(reference)


def encode(engine: Engine, item: data.GSM8KItem) -> list[int]:
    """The question under the instruction, as a chat turn when the model has a chat template."""
    text = f"{INSTRUCTION}\n\n{item.question}"
    if engine.tokenizer.chat_template:
        return engine.encode([{"role": "user", "content": text}])
    return engine.encode(text + "\n", chat=False)


class GSM8K:
    name = "gsm8k"

    def load(self, limit: int | None) -> list[data.GSM8KItem]:
        return data.gsm8k(limit)

    def ask(self, engine: Engine, item: data.GSM8KItem, options: TaskOptions) -> tuple[list[int], SamplingParams]:
        return encode(engine, item), SamplingParams(max_new_tokens=options.max_new_tokens or DEFAULT_MAX_NEW_TOKENS)

    def judge(self, item: data.GSM8KItem, completion: str, options: TaskOptions) -> ItemResult:
        return ItemResult(item.id, is_correct(completion, item.answer), extract_answer(completion) or "", completion)

