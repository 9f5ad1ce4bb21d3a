"""Continuous batching in-process, without HTTP: the load test's prompts through `LLM.chat` all at once (up to
`--max-batch` sharing each forward) against one at a time, rounds interleaved (a script, not a test).

    python bench/bench_batch.py [--prompts 32] [--max-tokens 128] [--rounds 2] [--max-batch 16]
        [--verifier w8a8] [--drafter ngram]

Every answer has `--max-tokens` tokens (temperature 0, `ignore_eos`). Prints, per round and as medians, the
tokens/s of each way and their ratio, with the kernel path that ran. The same answers either way (the
batching tests check it), so only the time differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import prompts  # noqa: E402  (the load test's prompt pool)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32,
                        help="prompts from the load test's pool (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of (batched, one at a time) (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=16, help="requests sharing a forward (default: %(default)s)")
    parser.add_argument("--max-batch-tokens", type=int, default=64, help="rows per forward (default: %(default)s)")
    parser.add_argument("--verifier", default="w8a8", help="default: %(default)s")
    parser.add_argument("--drafter", default="ngram", help="default: %(default)s")
    args = parser.parse_args()
    if min(args.prompts, args.max_tokens, args.rounds, args.max_batch, args.max_batch_tokens) < 1:
        parser.error("every count must be positive")

    from quasar import LLM, SamplingParams

    llm = LLM("default", verifier=args.verifier, drafter=args.drafter, max_batch=args.max_batch,
              max_batch_tokens=args.max_batch_tokens)
    params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    conversations = [[{"role": "user", "content": text}] for text in prompts(args.prompts)]
    llm.chat(conversations[:2], params)  # warm-up
    print(f"{len(conversations)} prompts x {args.max_tokens} tokens, {args.drafter}+{args.verifier}, "
          f"{llm.engine.target.model.plan.paths}, max batch {args.max_batch}", flush=True)

    def tokens_per_s(batched: bool) -> float:
        start = time.perf_counter()
        outputs = llm.chat(conversations, params) if batched else [llm.chat(c, params) for c in conversations]
        return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)

    together, alone = [], []
    for r in range(args.rounds):
        together.append(tokens_per_s(True))
        alone.append(tokens_per_s(False))
        print(f"round {r + 1}: batched {together[-1]:.1f} tok/s, one at a time {alone[-1]:.1f} tok/s, "
              f"{together[-1] / alone[-1]:.2f}x", flush=True)
    b, a = statistics.median(together), statistics.median(alone)
    print(f"median: batched {b:.1f} tok/s, one at a time {a:.1f} tok/s, {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
