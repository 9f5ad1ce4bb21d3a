"""Decode speed and memory of the default model: quasar vs transformers, fp32 and bf16.

Speed: all four engines live in one process and run interleaved, round by round, on the same prompt;
each round decodes N tokens greedily after a prefill; we report the median decode tokens/s.
Memory: peak RSS of a fresh process that loads one engine and decodes (ru_maxrss is per process).

    python bench/bench_decode.py --rounds 5 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

PROMPT = "Explain in detail how a bicycle works, from the pedals to the wheels."


def quasar_decoder(dtype: str):
    from quasar.engine import Engine
    from quasar.loading import load
    from quasar.sampling import SamplingParams

    engine = Engine(load("default", dtype))
    ids = engine.encode(PROMPT)

    def run(n: int) -> float:
        stats = engine.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True)).stats
        return (stats.new_tokens - 1) / stats.decode_s

    return run


def hf_decoder(dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quasar.loading import default_model_path

    path = default_model_path()
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])

    def run(n: int) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return (n - 1) / (time.perf_counter() - start - prefill)

    return run


ENGINES = {"quasar": quasar_decoder, "transformers": hf_decoder}


def memory(engine: str, dtype: str, n: int) -> float:
    code = (
        "import sys; sys.argv=['x']; from bench_decode import ENGINES; from quasar.stats import peak_rss_mb;"
        f"ENGINES[{engine!r}]({dtype!r})({n}); print(peak_rss_mb())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=sys.path[0], check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    runs = {(e, d): ENGINES[e](d) for e in ENGINES for d in ("fp32", "bf16")}
    for run in runs.values():
        run(4)  # warm-up
    speeds: dict = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, run in runs.items():
            speeds[key].append(run(args.new_tokens))
    rows = []
    for (engine, dtype), values in speeds.items():
        row = {"engine": engine, "dtype": dtype, "decode_tok_s_median": statistics.median(values),
               "decode_tok_s_all": [round(v, 1) for v in values]}
        if not args.no_memory:
            row["peak_rss_mb"] = memory(engine, dtype, args.new_tokens)
        rows.append(row)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
