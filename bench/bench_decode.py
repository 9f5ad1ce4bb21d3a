"""Plain decoding speed of the default model: quasar (fp32, bf16, w8a8 verifiers) vs transformers
(fp32, bf16).

All engines live in one process and run interleaved, round by round, on the same prompt; each round
decodes N tokens greedily after a prefill; we report the median decode tokens/s. Memory per verifier:
bench/bench_memory.py (a fresh process each).

    python bench/bench_decode.py --rounds 5 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

PROMPT = "Explain in detail how a bicycle works, from the pedals to the wheels."
RUNS = (("quasar", "fp32"), ("quasar", "bf16"), ("quasar", "w8a8"), ("transformers", "fp32"), ("transformers", "bf16"))


def quasar_decoder(dtype: str):
    from quasar.decoding.engine import Engine
    from quasar.decoding.sampling import SamplingParams
    from quasar.builder import model_source
    from quasar.verifiers.registry import load_verifier

    engine = Engine(load_verifier(model_source("default"), dtype))
    ids = engine.encode(PROMPT)

    def run(n: int) -> float:
        stats = engine.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True)).stats
        return (stats.new_tokens - 1) / stats.decode_s

    return run


def hf_decoder(dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quasar.builder import model_source
    from quasar.model.loading import float_directory

    directory = float_directory(model_source("default"))  # plain float safetensors: transformers 5 keeps GGUF weights packed
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    runs = {(engine, dtype): ENGINES[engine](dtype) for engine, dtype in RUNS}
    for run in runs.values():
        run(4)  # warm-up
    speeds: dict = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, run in runs.items():
            speeds[key].append(run(args.new_tokens))
    for (engine, dtype), values in speeds.items():
        row = {"engine": engine, "dtype": dtype, "decode_tok_s_median": round(statistics.median(values), 1),
               "decode_tok_s_all": [round(v, 1) for v in values]}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
