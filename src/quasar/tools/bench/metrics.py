"""Pure functions from answer records (Spec-Bench schema) to the numbers in the summary.

A record is one method's answer to one question at one temperature:
  {"question_id", "category", "model_id": method, "temperature",
   "choices": [{"turns", "new_tokens", "wall_time", "decoding_steps", "accept_lengths", "token_ids", "stats"}]}
with one entry per turn in every list except `accept_lengths` (flat over turns, as in Spec-Bench).

Definitions (docs/metrics.md): mean accepted tokens = tokens emitted per verify step (plain decoding 1.0);
acceptance rate = accepted draft tokens / proposed draft tokens; prompt share = seconds spent on the prompts /
wall seconds (tokens/s counts prompt processing); speedup = tokens/s of a method over
tokens/s of its baseline on the same prompts (total tokens / total wall time, as Spec-Bench).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from quasar.spec import EngineSpec

Record = dict[str, Any]
BASELINES = ("ar:bf16", "ngram+bf16")  # the plain float baseline and the paper's baseline
PLAIN_SPEEDUP = "speedup_vs_plain"  # a speculative method against plain decoding with its own verifier
ALL = "all"


def choice(record: Record) -> dict[str, Any]:
    return record["choices"][0]


def totals(records: Iterable[Record]) -> tuple[int, float]:
    """(new tokens, wall seconds) summed over records and turns."""
    tokens, seconds = 0, 0.0
    for r in records:
        tokens += sum(choice(r)["new_tokens"])
        seconds += sum(choice(r)["wall_time"])
    return tokens, seconds


def tokens_per_s(records: Iterable[Record]) -> float | None:
    tokens, seconds = totals(records)
    return tokens / seconds if seconds > 0 else None


def mean_accepted_tokens(records: Iterable[Record]) -> float | None:
    """Tokens emitted per verify step over all steps; None when the method does not report steps."""
    lengths = [n for r in records for n in choice(r).get("accept_lengths") or ()]
    return sum(lengths) / len(lengths) if lengths else None


def acceptance_rate(records: Iterable[Record]) -> float | None:
    """Accepted draft tokens / proposed draft tokens; None when nothing was proposed."""
    proposed = accepted = 0
    for r in records:
        for stats in choice(r).get("stats") or ():
            proposed += stats.get("proposed_tokens", 0)
            accepted += stats.get("accepted_tokens", 0)
    return accepted / proposed if proposed else None


def prompt_share(records: Iterable[Record]) -> float | None:
    """The share of the wall time spent processing prompts (a turn's prefill before its first new token); None
    when a record's turns do not all report it (transformers' generate reports its wall time alone: a prefill of
    0 s is one not measured)."""
    prompt = wall = 0.0
    for r in records:
        stats = choice(r).get("stats") or ()
        if len(stats) != len(choice(r)["wall_time"]) or any(not s.get("prefill_s") for s in stats):
            return None
        prompt += sum(s["prefill_s"] for s in stats)
        wall += sum(choice(r)["wall_time"])
    return prompt / wall if wall > 0 else None


def speedup(records: list[Record], baseline: list[Record]) -> float | None:
    """tokens/s of `records` over tokens/s of `baseline`, both restricted to the questions they share."""
    shared = {r["question_id"] for r in records} & {r["question_id"] for r in baseline}
    mine = tokens_per_s(r for r in records if r["question_id"] in shared)
    theirs = tokens_per_s(r for r in baseline if r["question_id"] in shared)
    return mine / theirs if mine is not None and theirs else None


def group(records: Iterable[Record]) -> dict[tuple[str, float, str], list[Record]]:
    """(method, temperature, category) -> records, with category 'all' holding every category."""
    out: dict[tuple[str, float, str], list[Record]] = defaultdict(list)
    for r in records:
        out[(r["model_id"], r["temperature"], r["category"])].append(r)
        out[(r["model_id"], r["temperature"], ALL)].append(r)
    return out


def summarize(records: list[Record], baselines: tuple[str, ...] = BASELINES) -> list[dict[str, Any]]:
    """One row per (method, temperature, category), categories in first-seen order and 'all' last."""
    groups = group(records)
    rows = []
    for (method, temperature, category), rs in groups.items():
        tokens, seconds = totals(rs)
        row = {
            "method": method, "temperature": temperature, "category": category, "prompts": len(rs),
            "new_tokens": tokens, "wall_time": seconds, "tokens_per_s": tokens_per_s(rs),
            "mean_accepted_tokens": mean_accepted_tokens(rs), "acceptance_rate": acceptance_rate(rs),
            "prompt_share": prompt_share(rs),
        }
        for base in baselines:
            reference = groups.get((base, temperature, category))
            row[f"speedup_vs_{base}"] = speedup(rs, reference) if reference else None
        plain = groups.get((reference_method(method), temperature, category))
        row[PLAIN_SPEEDUP] = speedup(rs, plain) if plain else None  # DRAFTER+V against ar:V
        rows.append(row)
    order = {c: i for i, c in enumerate(dict.fromkeys(r["category"] for r in records))}
    order[ALL] = len(order)
    methods = {m: i for i, m in enumerate(dict.fromkeys(r["model_id"] for r in records))}
    return sorted(rows, key=lambda r: (r["temperature"], order[r["category"]], methods[r["method"]]))


def reference_method(method: str) -> str | None:
    """The plain-decoding method whose greedy tokens `method` must reproduce: 'ngram+w8a8' -> 'ar:w8a8',
    'hf:pld' -> 'hf:ar', 'llamacpp:pld:f16' -> 'llamacpp:ar:f16'; None for plain methods."""
    peer, sep, rest = method.partition(":pld")
    if peer.partition(":")[0] not in ("hf", "llamacpp"):  # quasar's engine: plain decoding with its top verifier
        spec = EngineSpec.parse(method)
        return str(EngineSpec((spec.top,))) if spec.speculative else None
    return f"{peer}:ar{rest}" if sep else None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length when one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def matched_when_sampling(method: str) -> bool:
    """Whether `method`'s sampled answers must be its reference's too: quasar's one-verifier engine with a copying
    drafter ('ngram', 'suffix'), whose drafts are matched against plain decoding's draws (same seed, same tokens)."""
    if method.partition(":")[0] in ("hf", "llamacpp"):
        return False
    spec = EngineSpec.parse(method)
    return spec.drafter in ("ngram", "suffix") and spec.middle is None


def divergences(records: list[Record]) -> list[dict[str, Any]]:
    """Answers whose tokens differ from their plain-decoding reference's: greedy ones (temperature 0), and sampled
    ones of the methods `matched_when_sampling` names (the bench seeds every method's prompt alike)."""
    by_key = {(r["model_id"], r["temperature"], r["question_id"]): r for r in records}
    found = []
    for (method, temperature, qid), r in by_key.items():
        reference = reference_method(method)
        other = by_key.get((reference, temperature, qid)) if reference else None
        if other is None or (temperature != 0 and not matched_when_sampling(method)):
            continue
        for turn, (mine, theirs) in enumerate(zip(choice(r)["token_ids"], choice(other)["token_ids"])):
            position = first_difference(mine, theirs)
            if position is not None:
                found.append({"method": method, "reference": reference, "question_id": qid, "turn": turn,
                              "position": position, "category": r["category"]})
                break
    return found
