"""JSON extraction with a schema: plain decoding against n-gram speculation with and without grammar drafting (a
script, not a test).

    python bench/bench_json.py [--model default] [--verifier w8a8] [--rounds 2] [--max-tokens 160]
    python bench/bench_json.py --mask-cost --model qwen2.5-coder-1.5b --verifier auto

20 prompts each ask for a schema'd object (name, age, city, occupation, hobbies) from a short passage, greedy,
one request at a time. Methods, interleaved by round on one loaded model: `ar` (plain decoding), `ngram` (n-gram
drafts, the grammar's forced tokens drafted first), `ngram-unforced` (n-gram drafts only). Every answer is parsed
and validated against the schema. Prints tokens/s, the ratio to `ar`, and the mean tokens a verify step emits with
the forced ones apart.

`--mask-cost`: plain decoding of the same prompts with and without the schema, interleaved: ms per decode step and
the time the grammar's mask takes within a step (GrammarMask.apply, timed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},  # bounded: a small model that loops in a string still ends
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "occupation", "hobbies"],
    "additionalProperties": False,
}
PEOPLE = [
    ("Maria Lopez", 34, "Madrid", "architect", ["painting", "running"]),
    ("John Smith", 52, "Chicago", "teacher", ["fishing", "chess"]),
    ("Aiko Tanaka", 27, "Osaka", "nurse", ["baking", "hiking", "reading"]),
    ("Lars Nilsen", 41, "Oslo", "engineer", ["skiing"]),
    ("Fatima Khan", 29, "Lahore", "doctor", ["cricket", "poetry"]),
    ("Pierre Dubois", 63, "Lyon", "baker", ["gardening", "cycling"]),
    ("Emma Brown", 19, "Leeds", "student", ["football", "music"]),
    ("Carlos Silva", 45, "Lisbon", "fisherman", ["sailing"]),
    ("Anna Kowalska", 38, "Warsaw", "lawyer", ["tennis", "opera"]),
    ("David Cohen", 57, "Haifa", "pharmacist", ["photography", "swimming"]),
    ("Grace Okafor", 31, "Lagos", "banker", ["dancing", "cooking"]),
    ("Tom Becker", 24, "Munich", "mechanic", ["climbing", "gaming"]),
    ("Sofia Rossi", 48, "Milan", "designer", ["knitting", "travel"]),
    ("Ivan Petrov", 36, "Sofia", "pilot", ["boxing"]),
    ("Mei Chen", 22, "Taipei", "programmer", ["drawing", "badminton"]),
    ("Omar Haddad", 60, "Beirut", "chef", ["backgammon", "reading"]),
    ("Laura White", 44, "Denver", "farmer", ["horse riding", "quilting"]),
    ("Jonas Berg", 33, "Stockholm", "journalist", ["jogging", "jazz"]),
    ("Nina Ivanova", 26, "Riga", "singer", ["yoga", "writing"]),
    ("Ahmed Ali", 50, "Cairo", "carpenter", ["football", "fishing", "chess"]),
]


def prompts() -> list[list[dict[str, str]]]:
    out = []
    for name, age, city, job, hobbies in PEOPLE:
        passage = (
            f"{name} is {age} years old and lives in {city}, where {name.split()[0]} works as a {job}. "
            f"In free time, {name.split()[0]} enjoys {' and '.join(hobbies)}."
        )
        ask = (
            "Extract the person described below as a JSON object with the keys name, age, city, occupation and "
            f"hobbies.\n\n{passage}"
        )
        out.append([{"role": "user", "content": ask}])
    return out


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def engines(model: str, verifier: str):
    """The three methods on one loaded model: name -> Engine."""
    from quasar import LLM
    from quasar.decoding.engine import Engine
    from quasar.decoding.speculative import Speculative

    speculative = LLM(model, verifier=verifier, drafter="ngram").engine
    unforced = Speculative(speculative.decoder.drafter.spawn(), speculative.decoder.k, forced_drafts=False)
    return {
        "ar": Engine(speculative.target, max_context=speculative.max_context),
        "ngram": speculative,
        "ngram-unforced": Engine(speculative.target, unforced, max_context=speculative.max_context),
    }


def compare(args: argparse.Namespace) -> None:
    from quasar import SamplingParams

    methods = engines(args.model, args.verifier)
    params = SamplingParams(max_new_tokens=args.max_tokens, json_schema=SCHEMA)
    conversations = prompts()
    encoded = [methods["ar"].encode(c) for c in conversations]
    for engine in methods.values():  # warm-up
        engine.generate(encoded[0], params)
    totals = {
        name: {"tokens": 0, "seconds": 0.0, "steps": 0, "emitted": 0, "forced": 0, "invalid": 0} for name in methods
    }
    answers: dict[str, list[list[int]]] = {name: [] for name in methods}
    for r in range(args.rounds):
        for name, engine in methods.items():
            for ids in encoded:
                out = engine.generate(ids, params)
                t = totals[name]
                t["tokens"] += len(out.token_ids)
                t["seconds"] += out.stats.wall_s
                t["steps"] += out.stats.verify_steps
                t["emitted"] += sum(out.stats.accept_lengths)
                t["forced"] += out.stats.forced_tokens
                t["invalid"] += not valid(out.text)
                if r == 0:
                    answers[name].append(out.token_ids)
        print(f"round {r + 1} done", flush=True)
    same = all(answers[name] == answers["ar"] for name in methods)
    path = methods["ar"].path
    print(
        f"{len(encoded)} prompts x {args.rounds} rounds, {args.model} {args.verifier} on {path}, greedy, "
        f"max {args.max_tokens} tokens; answers identical across methods: {same}"
    )
    base = totals["ar"]["tokens"] / totals["ar"]["seconds"]
    print("| method | tok/s | x ar | tokens a verify step | of them forced | drafted by n-gram + bonus | invalid |")
    print("|---|---|---|---|---|---|---|")
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        per_step = t["emitted"] / t["steps"] if t["steps"] else 1.0
        forced = t["forced"] / t["steps"] if t["steps"] else 0.0
        print(
            f"| {name} | {rate:.1f} | {rate / base:.2f}x | {per_step:.2f} | {forced:.2f} | {per_step - forced:.2f} "
            f"| {t['invalid']} of {len(encoded) * args.rounds} |"
        )


def mask_cost(args: argparse.Namespace) -> None:
    """ms per plain decode step with and without the schema (interleaved), and the mask's own time per step."""
    from quasar import LLM, SamplingParams
    from quasar.decoding.grammar import GrammarMask

    engine = LLM(args.model, verifier=args.verifier).engine
    spent = [0.0]
    apply = GrammarMask.apply

    def timed(self, logits, history, draft):  # the mask's time, summed (a script's own wrapper)
        start = time.perf_counter()
        apply(self, logits, history, draft)
        spent[0] += time.perf_counter() - start

    GrammarMask.apply = timed
    encoded = [engine.encode(c) for c in prompts()]
    with_schema = SamplingParams(max_new_tokens=args.max_tokens, json_schema=SCHEMA)
    engine.generate(encoded[0], with_schema)
    step_ms: dict[str, list[float]] = {"schema": [], "free": []}
    mask_ms: list[float] = []
    for ids in encoded * args.rounds:
        spent[0] = 0.0
        out = engine.generate(ids, with_schema)
        steps = max(1, out.stats.verify_steps)
        step_ms["schema"].append(1000 * out.stats.decode_s / steps)
        mask_ms.append(1000 * spent[0] / (steps + 1))  # the prefill's row is masked too
        free = engine.generate(ids, SamplingParams(max_new_tokens=len(out.token_ids), ignore_eos=True))
        step_ms["free"].append(1000 * free.stats.decode_s / max(1, free.stats.verify_steps))
    s, f, m = (statistics.median(x) for x in (step_ms["schema"], step_ms["free"], mask_ms))
    print(f"{args.model} {args.verifier} on {engine.path}, plain decoding, {len(mask_ms)} answers interleaved")
    print(
        f"ms per decode step: with the schema {s:.2f}, without {f:.2f} ({100 * (s - f) / f:+.1f}%); "
        f"the mask itself {m:.3f} ms a step ({100 * m / s:.1f}% of a step)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default: %(default)s")
    parser.add_argument("--verifier", default="w8a8", help="default: %(default)s")
    parser.add_argument("--rounds", type=int, default=2, help="default: %(default)s")
    parser.add_argument("--max-tokens", type=int, default=160, help="default: %(default)s")
    parser.add_argument("--mask-cost", action="store_true", help="measure the mask's cost per plain decode step")
    args = parser.parse_args()
    if min(args.rounds, args.max_tokens) < 1:
        parser.error("--rounds and --max-tokens must be positive")
    (mask_cost if args.mask_cost else compare)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
