"""Float references at memory speed: quasar's fp32 and bf16 verifiers against transformers and
llama.cpp at the same precision, with quasar's w8a8 beside them, on the same model and the same tokens.

    python bench/bench_float.py [--model default] [--w8a8 DIR] [--engines quasar:fp32,transformers:fp32,...]
                                [--prompt-len 1024] [--rounds 3]

Each round, engine after engine (interleaved, so slow phases of the machine hit all alike): a prefill of
`prompt-len` random tokens into an empty cache (only the last position's logits), then at that context a
decode step (1 token) and a verify step (6 tokens, every position's logits), each undone after timing. We
report medians: prefill tokens/s, decode and verify milliseconds. Engines:

- quasar:fp32, quasar:bf16, quasar:w8a8 (load_verifier; the kernel paths are printed beside every row), and
  quasar:V@PATH to run it on one of the CPU's float paths (`native.kernel().float_paths()`): two paths of one
  verifier side by side, e.g. quasar:bf16@avx512bf16,quasar:bf16@avx512;
- transformers:fp32, transformers:bf16 (its own Llama/Qwen2 code on the same weights, dequantized from the GGUF
  as quasar does, DynamicCache);
- llama.cpp:f16, llama.cpp:bf16, llama.cpp:q8_0, llama.cpp:q4_k_m (llama-cpp-python on GGUF copies of the same
  weights, all threads; not in the test extras: `pip install llama-cpp-python`), and llama.cpp:file on the model's
  own GGUF (the Q4_K_M or Q4_1 file users run: beside quasar:w4a8, which reads that file's blocks).

On a 1.5B model the float engines do not all fit in 24 GB at once: run them in groups with --engines.

`--llama-bench "PATH [ARGS]"` (repeatable; builds of llama.cpp's or ik_llama.cpp's `llama-bench`, e.g.
`--llama-bench "$IK/build/bin/llama-bench -rtr 1"`, never built by quasar) adds each native build's own figures on the
model's GGUF file, same threads: `-p PROMPT_LEN,6 -n 64` (quasar.tools.bench.llama_bench). Its steps run from an
empty context, quasar's at `prompt-len` cached tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from contextlib import contextmanager

import torch

from quasar.builder import model_source
from quasar.kernels import native
from quasar.tools.bench.llama_bench import LlamaBench

DEFAULT_ENGINES = "quasar:fp32,quasar:bf16,quasar:w8a8,transformers:fp32,transformers:bf16,llama.cpp:f16,llama.cpp:bf16"
VERIFY = 6


class Quasar:
    def __init__(self, model: str, verifier: str, w8a8: str | None, max_len: int) -> None:
        from quasar.verifiers.registry import load_verifier

        verifier, _, self.float_path = verifier.partition("@")
        self.model = load_verifier(w8a8 if verifier == "w8a8" and w8a8 else model, verifier).model
        self.cache = self.model.new_cache(max_len)
        self.path = self.model.plan.paths
        if self.float_path:
            native.kernel().use_float_path(self.float_path)  # raises on a path this CPU lacks
            native.kernel().use_float_path("auto")
            self.path = re.sub(r"[^:+]+$", self.float_path, self.path) + " (forced)"  # the float path is the last

    @contextmanager
    def on_path(self):
        if not self.float_path:
            yield
            return
        native.kernel().use_float_path(self.float_path)
        try:
            yield
        finally:
            native.kernel().use_float_path("auto")

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> None:
        self.cache.reset()
        with self.on_path():
            self.model(torch.tensor([ids]), self.cache, last_only=True)

    @torch.inference_mode()
    def step(self, ids: list[int]) -> float:
        with self.on_path():
            start = time.perf_counter()
            self.model(torch.tensor([ids]), self.cache)
            elapsed = time.perf_counter() - start
        self.cache.trim(len(ids))
        return elapsed


class Transformers:
    def __init__(self, model: str, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        from quasar.model.loading import float_directory

        directory = float_directory(model)  # plain float safetensors (transformers 5 keeps GGUF weights packed)
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch_dtype).eval()
        self.past = None
        self.path = f"torch {torch.plan.cpu.get_cpu_capability()}"

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> None:
        from transformers import DynamicCache

        self.past = DynamicCache()
        self.model(torch.tensor([ids]), past_key_values=self.past, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def step(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.model(torch.tensor([ids]), past_key_values=self.past, use_cache=True)
        elapsed = time.perf_counter() - start
        self.past.crop(-len(ids))  # drop the step's positions
        return elapsed


class LlamaCpp:
    def __init__(self, model: str, precision: str, max_len: int) -> None:
        import llama_cpp

        from quasar.tools.bench.gguf_export import llama_cpp_gguf

        threads = torch.get_num_threads()
        path = llama_cpp_gguf(model, precision)
        self.llm = llama_cpp.Llama(str(path), n_ctx=max_len, n_batch=max_len, n_ubatch=512,
                                   n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
        self.path = f"llama.cpp {llama_cpp.__version__} {path.name if precision == 'file' else precision.upper()}"

    def prefill(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm._logits_all = False  # only the last position's logits, as the others are asked
        self.llm.eval(ids)
        self.llm._logits_all = True
        self.context = len(ids)

    def step(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.llm.eval(ids)  # every position's logits
        elapsed = time.perf_counter() - start
        self.llm.n_tokens = self.context  # the next eval drops the cache past it
        return elapsed


def build(name: str, args: argparse.Namespace, max_len: int):
    engine, _, precision = name.partition(":")
    if engine == "quasar":
        return Quasar(args.model, precision, args.w8a8, max_len)
    if engine == "transformers":
        return Transformers(args.model, precision)
    if engine == "llama.cpp":
        return LlamaCpp(args.model, precision, max_len)
    raise ValueError(f"unknown engine {name!r}: quasar:V, transformers:fp32|bf16 or llama.cpp:f16|bf16|q8_0|q4_k_m|file")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--w8a8", help="a quantized checkpoint (quasar quantize) to use as quasar:w8a8")
    parser.add_argument("--engines", default=DEFAULT_ENGINES, help="comma-separated, default: %(default)s")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-bench", action="append", default=[], metavar='"PATH [ARGS]"',
                        help="a native llama-bench build (and its own arguments) to run on the model's GGUF beside "
                        "quasar (repeatable)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    args.model = model_source(args.model)  # resolved once: 'default', an installed name or a path
    if args.prompt_len < 1 or args.rounds < 1:
        parser.error("--prompt-len and --rounds must be >= 1")
    max_len = -(-(args.prompt_len + VERIFY + 1) // 256) * 256
    anchors = [LlamaBench(command) for command in args.llama_bench]  # checked before any model loads
    engines = {name: build(name, args, max_len) for name in args.engines.split(",")}
    kernel = native.kernel()
    print(f"{torch.get_num_threads()} threads; quasar kernels: int8 {kernel.int8_path() if kernel else '-'}, "
          f"float {kernel.float_path() if kernel else '-'}", flush=True)
    generator = torch.Generator().manual_seed(0)
    times: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": [], "verify": []} for name in engines}
    for round_ in range(args.rounds + 1):  # the first round warms up
        ids = torch.randint(100, 20000, (args.prompt_len + VERIFY,), generator=generator).tolist()
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.prefill(ids[: args.prompt_len])
            prefill = time.perf_counter() - start
            decode = engine.step(ids[args.prompt_len : args.prompt_len + 1])
            verify = engine.step(ids[args.prompt_len : args.prompt_len + VERIFY])
            if round_:
                for key, value in (("prefill", prefill), ("decode", decode), ("verify", verify)):
                    times[name][key].append(value)
    rows = []
    print(f"\n| engine | path | prefill {args.prompt_len} tok/s | decode ms | verify {VERIFY} ms | verify / decode |")
    print("|---|---|---:|---:|---:|---:|")
    for name, engine in engines.items():
        med = {key: statistics.median(values) for key, values in times[name].items()}
        row = {"engine": name, "path": engine.path, "prefill_tok_s": args.prompt_len / med["prefill"],
               "decode_ms": 1e3 * med["decode"], "verify_ms": 1e3 * med["verify"], "rounds": args.rounds}
        rows.append(row)
        print(f"| {name} | {row['path']} | {row['prefill_tok_s']:.1f} | {row['decode_ms']:.2f} | {row['verify_ms']:.2f} | "
              f"{row['verify_ms'] / row['decode_ms']:.2f} |", flush=True)
    if anchors:
        from quasar.tools.bench.gguf_export import llama_cpp_gguf

        gguf = llama_cpp_gguf(args.model, "file")
        for anchor in anchors:
            got = anchor.run(gguf, torch.get_num_threads(), args.prompt_len, VERIFY, args.rounds)
            row = {"engine": got.name, "path": f"native, {gguf.name}", "prefill_tok_s": got.prefill_tok_s,
                   "decode_ms": got.decode_ms, "verify_ms": got.verify_ms, "rounds": args.rounds}
            rows.append(row)
            print(f"| {row['engine']} | {row['path']} | {row['prefill_tok_s']:.1f} | {row['decode_ms']:.2f} | "
                  f"{row['verify_ms']:.2f} | {row['verify_ms'] / row['decode_ms']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model.name, "prompt_len": args.prompt_len, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
