"""Speculative decoding side by side on the default model.

    python bench/bench_speculative.py [--max-new-tokens 128] [--pruned 8] [--k 5] [--json out.json]

10 real prompts, one per kind (8 MT-bench categories, HumanEval, GSM8K; sha256-checked by
quasar.tools.bench.suites), greedy. Methods AR-bf16, AR-w8a8, ngram+bf16, ngram+w8a8, ngram+pruned:N run
interleaved (every method on prompt 1, then prompt 2, ...) in one process. Reports mean accepted
tokens (tokens per verify step, bonus included) and tokens/s (new tokens / (prefill + decode time)).
"""

from __future__ import annotations

import argparse
import json
import sys

from quasar.tools.bench.suites import load_suite
from quasar.decoding.drafters import build_drafter
from quasar.decoding.engine import Engine
from quasar.decoding.sampling import SamplingParams
from quasar.decoding.speculative import Speculative
from quasar.spec import parse_k
from quasar.builder import model_source
from quasar.verifiers.registry import load_verifier

KINDS = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities", "humaneval", "gsm8k")


def engines(pruned: int, k: int | str) -> dict[str, Engine]:
    targets = {v: load_verifier(model_source("default"), v) for v in ("bf16", "w8a8", f"pruned:{pruned}")}

    def spec(verifier: str) -> Engine:
        return Engine(targets[verifier], decoder=Speculative(build_drafter("ngram", targets[verifier]), k))

    return {
        "AR-bf16": Engine(targets["bf16"]),
        "AR-w8a8": Engine(targets["w8a8"]),
        "ngram+bf16": spec("bf16"),
        "ngram+w8a8": spec("w8a8"),
        f"ngram+pruned:{pruned}": spec(f"pruned:{pruned}"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--pruned", type=int, default=8, help="layers dropped by the pruned verifier (default: 8)")
    parser.add_argument("--k", default="5")
    parser.add_argument("--json", help="write the per-prompt results here")
    args = parser.parse_args()
    items = load_suite("quick", per_category=1, categories=KINDS)
    methods = engines(args.pruned, parse_k(args.k))
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows: list[dict] = []
    for item in items:
        for name, engine in methods.items():
            done = engine.generate(engine.encode(item.turns[0]), params)
            rows.append({"method": name, "prompt": item.question_id, "kind": item.category,
                         "tokens": done.token_ids, **done.stats.to_dict()})
            print(f"{item.category:>10} {name:>16} MAT {done.stats.mean_accepted_tokens:5.2f} "
                  f"{done.stats.tokens_per_s:7.1f} tok/s", file=sys.stderr, flush=True)
    print(f"{'method':>16} {'MAT':>6} {'tok/s':>7} {'accept':>7} {'same tokens as AR-bf16':>24}")
    reference = {r["prompt"]: r["tokens"] for r in rows if r["method"] == "AR-bf16"}
    for name in methods:
        mine = [r for r in rows if r["method"] == name]
        steps = sum(r["verify_steps"] for r in mine)
        tokens = sum(r["new_tokens"] for r in mine)
        seconds = sum(r["prefill_s"] + r["decode_s"] for r in mine)
        accept = sum(r["accepted_tokens"] for r in mine) / max(1, sum(r["proposed_tokens"] for r in mine))
        same = sum(r["tokens"] == reference[r["prompt"]] for r in mine)
        # MAT over all steps of all prompts: the first token (from the prefill) is not a verify step.
        print(f"{name:>16} {sum(sum(r['accept_lengths']) for r in mine) / max(1, steps):6.2f} "
              f"{tokens / seconds:7.1f} {accept:7.2f} {same:>20}/{len(mine)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
