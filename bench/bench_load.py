"""Load time and peak memory of one GGUF: quasar (its default verifier, the file's own blocks) against llama.cpp
(llama-cpp-python, with and without mmap) loading the same file, each load in a fresh process, alternated.

    python bench/bench_load.py --model qwen2.5-coder-1.5b [--rounds 3] [--first-load]

Reported per process: import, load (to a ready model), first token (one token of "Hi"), the whole process, and the
peak RSS (ru_maxrss; a mapped file's pages count once touched). The file is read once before the rounds so every
load finds it in the page cache. --first-load adds one quasar load with an empty cache directory beside a copy of
the compiled kernels: what a first run pays for the tokenizer conversion and the sha256, not for compiling.
llama-cpp-python must be importable (docs/benchmarks.md says how to build it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUASAR = """
import json, resource, sys, time
t0 = time.perf_counter()
from quasar import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1])
t2 = time.perf_counter()
llm.generate(["Hi"], SamplingParams(max_new_tokens=1))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "path": llm.engine.path}))
"""
LLAMA = """
import json, resource, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
t1 = time.perf_counter()
llm = Llama(model_path=sys.argv[1], n_ctx=4096, n_threads=2, verbose=False, use_mmap=sys.argv[2] == "mmap")
t2 = time.perf_counter()
llm.create_completion("Hi", max_tokens=1)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "path": "llama.cpp"}))
"""


def measure(name: str, code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *args], check=False, capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1]) | {"process_s": time.perf_counter() - start}
    print(f"{name:20} import {result['import_s']:5.2f} s  load {result['load_s']:6.2f} s  first token "
          f"{result['first_token_s']:5.2f} s  process {result['process_s']:6.2f} s  peak {result['peak_mb']:7.0f} MiB"
          f"  ({result['path']})", flush=True)
    return result


def first_load(path: str) -> None:
    """quasar's load with an empty cache but for the compiled kernels."""
    from quasar.files import cache_root

    with tempfile.TemporaryDirectory() as home:
        shutil.copytree(cache_root() / "kernels", Path(home) / "quasar" / "kernels")
        measure("quasar, first load", QUASAR, path, env=dict(os.environ, XDG_CACHE_HOME=home))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a GGUF file or a name quasar knows (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-load", action="store_true", help="also time one quasar load with an empty cache")
    args = parser.parse_args()
    from quasar.builder import model_source

    source = model_source(args.model)
    path = str(source.path)
    size = source.path.stat().st_size
    with open(path, "rb") as f:  # into the page cache for every load alike
        while f.read(1 << 24):
            pass
    print(f"{source.path.name}: {size:,} bytes")
    if args.first_load:
        first_load(path)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        runs.setdefault("quasar", []).append(measure("quasar", QUASAR, path))
        runs.setdefault("llama.cpp mmap", []).append(measure("llama.cpp mmap", LLAMA, path, "mmap"))
        runs.setdefault("llama.cpp no mmap", []).append(measure("llama.cpp no mmap", LLAMA, path, "no-mmap"))
    for name, results in runs.items():
        loads = sorted(r["load_s"] for r in results)
        peaks = sorted(r["peak_mb"] for r in results)
        print(f"{name:20} load median {loads[len(loads) // 2]:.2f} s, peak median {peaks[len(peaks) // 2]:.0f} MiB "
              f"({peaks[len(peaks) // 2] * 2**20 / size:.2f}x the file)")


if __name__ == "__main__":
    main()
