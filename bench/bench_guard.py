"""`--guard MARGIN` against plain `ngram+w8a8` and the float model (`ar:bf16`), interleaved (a script, not a test).

    python bench/bench_guard.py [--margins 0.1,0.25,0.5,1] [--max-tokens 128] [--suite quick] [--per-category N]
        [--model default]

The first turn of each suite prompt, temperature 0, k auto; every method answers a prompt before the next
prompt, in an order rotated per prompt. Prints per method: tokens/s (new tokens / wall time, prefill included),
re-scored steps, agreement with the float model (teacher-forced: bf16's argmax after each prefix of the answer,
over every answer position) and the answers identical to `ar:bf16`'s token for token; with the kernel path.
"""

from __future__ import annotations

import argparse

import torch


def agreement(model, prompt: list[int], answer: list[int]) -> tuple[int, int]:
    """(positions where the model's argmax after the prefix is the answer's token, positions)."""
    cache = model.new_cache(len(prompt) + len(answer) + 8)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + answer[:-1]]), cache)[0, len(prompt) - 1 :]  # [len(answer), V]
    return int((logits.argmax(-1) == torch.tensor(answer)).sum()), len(answer)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--margins", default="0.1,0.25,0.5,1", help="guard margins, logits (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--suite", default="quick", help="bench suite: quick (11 prompts), spec (default: %(default)s)")
    parser.add_argument("--per-category", type=int, help="prompts per category (default: the suite's)")
    parser.add_argument("--model", default="default", help="default: %(default)s")
    args = parser.parse_args()
    try:
        margins = [float(m) for m in args.margins.split(",")]
    except ValueError:
        parser.error(f"--margins takes numbers separated by commas, got {args.margins!r}")
    if args.max_tokens < 1 or any(not m >= 0 for m in margins):
        parser.error("--max-tokens must be positive and every margin >= 0")

    from quasar.builder import Verifiers, build_engine
    from quasar.spec import EngineSpec
    from quasar.tools.bench.suites import load_suite
    from quasar.decoding.sampling import SamplingParams

    verifiers = Verifiers(args.model)
    engines = {name: build_engine(EngineSpec.parse(name), verifiers) for name in ("ar:bf16", "ngram+w8a8")}
    for margin in margins:
        engines[f"guard {margin:g}"] = build_engine(EngineSpec.parse("ngram+w8a8", guard=margin), verifiers)
    float_model = engines["ar:bf16"].target.model
    names = list(engines)
    print("paths:", {name: e.target.model.plan.paths for name, e in engines.items() if name in ("ar:bf16", "ngram+w8a8")})
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0)
    items = load_suite(args.suite, args.per_category)
    prompts = [engines["ar:bf16"].encode([{"role": "user", "content": item.turns[0]}]) for item in items]
    for engine in engines.values():  # warm-up
        engine.generate(prompts[0], SamplingParams(max_new_tokens=8))
    tokens = {n: 0 for n in names}
    wall = {n: 0.0 for n in names}
    steps = {n: [0, 0] for n in names}  # re-scored, verify steps
    agree = {n: [0, 0] for n in names}
    same = {n: 0 for n in names}
    for i, ids in enumerate(prompts):
        answers = {}
        for name in names[i % len(names):] + names[: i % len(names)]:
            out = engines[name].generate(ids, params)
            answers[name] = out.token_ids
            tokens[name] += len(out.token_ids)
            wall[name] += out.stats.wall_s
            steps[name][0] += out.stats.rechecked_tokens
            steps[name][1] += out.stats.verify_steps
        for name in names:
            hit, n = agreement(float_model, ids, answers[name])
            agree[name][0] += hit
            agree[name][1] += n
            same[name] += answers[name] == answers["ar:bf16"]
        print(f"prompt {i + 1}/{len(prompts)} ({items[i].category}) done", flush=True)
    print(f"\n{args.model}, {len(prompts)} prompts x {args.max_tokens} tokens, T = 0")
    print("| method | tok/s | re-scored steps | agreement with bf16 | identical answers |")
    print("|---|---|---|---|---|")
    for name in names:
        rescored = f"{steps[name][0]} of {steps[name][1]}" if steps[name][1] else "–"
        print(f"| `{name}` | {tokens[name] / wall[name]:.1f} | {rescored} | "
              f"{100 * agree[name][0] / agree[name][1]:.2f}% | {same[name]}/{len(prompts)} |")
    base = tokens["ngram+w8a8"] / wall["ngram+w8a8"]
    print("speed vs ngram+w8a8:", {n: round(tokens[n] / wall[n] / base, 3) for n in names})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
