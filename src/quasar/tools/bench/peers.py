"""Peers run side by side with quasar: transformers (plain and prompt lookup) and llama.cpp.

Peers get the same prompt token ids (`quasar.decoding.prompt.encode`) and token budget as quasar's methods. Their
verify steps are counted from outside: a forward pre-hook records where each transformers forward starts.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from quasar.tools.bench.base import PeerMissingError, Pool
from quasar.model.loading import load_tokenizer, tokenizer_directory
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.prompt import Messages, encode
from quasar.decoding.sampling import SamplingParams
from quasar.decoding.stats import GenerationStats


def forward_starts(model: torch.nn.Module) -> tuple[list[tuple[int, int]], Any]:
    """Record (first position, input length) of every forward of a transformers model; returns the list and
    the hook handle (remove it when done)."""
    starts: list[tuple[int, int]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is not None and positions is not None:
            starts.append((int(positions[0, 0]), ids.shape[1]))

    return starts, model.register_forward_pre_hook(hook, with_kwargs=True)


def step_lengths(starts: list[tuple[int, int]], prompt_len: int, total_len: int) -> list[int]:
    """Tokens emitted by each verify step, from where each forward started. The first forward is the
    prefill (a step only when it also scored a draft); the last token emitted is never fed back."""
    bounds = [s for s, _ in starts[1:]] + [total_len - 1]
    lengths = [b - a for (a, _), b in zip(starts[1:], bounds[1:])]
    if starts and starts[0][1] > prompt_len:
        lengths.insert(0, bounds[0] - prompt_len + 1)
    return lengths


class HFMethod:
    """transformers' `generate` in bf16, plain or with prompt lookup decoding (`prompt_lookup_num_tokens`)."""

    def __init__(self, name: str, directory: Path, pld_tokens: int | None) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        self.name, self.pld_tokens = name, pld_tokens
        self.path = f"transformers {transformers.__version__} bf16, torch {torch.backends.cpu.get_cpu_capability()}"
        self.tokenizer = load_tokenizer(directory)
        self.model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in self.eos:
            self.eos.append(self.tokenizer.eos_token_id)

    def sampling_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"min_new_tokens": params.max_new_tokens} if params.ignore_eos else {}
        if params.greedy:
            return {**kwargs, "do_sample": False}
        return {**kwargs, "do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "min_p": params.min_p or None}

    def forget(self) -> None:  # transformers' generate keeps nothing between calls
        pass

    @torch.inference_mode()
    def generate(self, messages: Messages, params: SamplingParams) -> RequestOutput:
        ids = encode(self.tokenizer, messages)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        starts, handle = forward_starts(self.model)
        start = time.perf_counter()
        try:
            out = self.model.generate(
                torch.tensor([ids]), max_new_tokens=params.max_new_tokens, eos_token_id=self.eos or None,
                pad_token_id=self.eos[0] if self.eos else 0, prompt_lookup_num_tokens=self.pld_tokens,
                **self.sampling_kwargs(params),
            )
        finally:
            handle.remove()
        wall = time.perf_counter() - start
        new = out[0, len(ids):].tolist()
        stats = GenerationStats(prompt_tokens=len(ids), new_tokens=len(new), decode_s=wall,
                                finish_reason=finish_reason(new, self.eos, params))
        for emitted in step_lengths(starts, len(ids), len(ids) + len(new)):
            stats.record_step(proposed=0, accepted=0, emitted=emitted)  # drafts are not visible from outside
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return RequestOutput(list(messages), ids, text=text, token_ids=new, stats=stats)


# A few tokens through llama.cpp in a child process: prints its system info, then evaluates a prompt and one token.
LLAMA_PROBE = """
import sys
import llama_cpp
print(llama_cpp.llama_print_system_info().decode(), flush=True)
llm = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), verbose=False)
llm.eval(list(range(1, 9)))
llm.eval([9])
"""
PROBE_TIMEOUT_S = 300
# What builds llama-cpp-python without ggml's AMX path (and with every other x86 extension; drop those the CPU lacks).
NO_AMX_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
                '-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF" '
                'pip install --no-cache-dir --force-reinstall llama-cpp-python')


@functools.cache
def llama_cpp_fails(gguf: str, threads: int) -> str | None:
    """Why llama.cpp cannot run this GGUF here, or None: it is tried first in a child process, because it runs in
    the bench's own process, where a crash of its native code (llama-cpp-python 0.3.36 built for a CPU with AMX
    segfaults in ggml's AMX matrix product) would end the whole run without a word."""
    try:
        done = subprocess.run([sys.executable, "-c", LLAMA_PROBE, gguf, str(threads)], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"a probe run of llama.cpp on {gguf} did not finish in {PROBE_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
    last = done.stderr.strip().splitlines()[-1:] if done.returncode > 0 else []
    why = f"llama.cpp failed a probe run on this CPU ({how}{': ' + last[0] if last else ''})"
    if "AMX_INT8 = 1" in done.stdout:
        why += f"; it was built with ggml's AMX path, which crashes on some CPUs: rebuild it without: {NO_AMX_BUILD}"
    return why


class LlamaCppMethod:
    """llama-cpp-python on the model's own GGUF file ('file', e.g. the Q4_K_M users run) or on an F16 or Q8_0 copy of
    it, plain or with LlamaPromptLookupDecoding."""

    INSTALL = "llama-cpp-python is not installed; install it with: pip install llama-cpp-python"

    def __init__(self, name: str, pool: Pool, precision: str, pld_tokens: int | None) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise PeerMissingError(self.INSTALL)
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from quasar.tools.bench.gguf_export import llama_cpp_gguf

        if pool.source.format != "gguf":
            raise PeerMissingError("the llama.cpp peers need a GGUF model (--model default or a .gguf file)")
        self.name = name
        source = pool.source.path
        self.path = f"llama.cpp {llama_cpp.__version__} " + (source.name if precision == "file" else precision.upper())
        self.tokenizer = load_tokenizer(tokenizer_directory(pool.source))
        draft = LlamaPromptLookupDecoding(num_pred_tokens=pld_tokens) if pld_tokens else None
        path = llama_cpp_gguf(pool.source, precision)
        if why := llama_cpp_fails(str(path), torch.get_num_threads()):
            raise PeerMissingError(why)
        n_ctx = pool.options.max_context or 4096
        # logits_all: with a draft model llama-cpp-python scores several positions per eval; without it, its
        # score buffer holds n_batch rows and a verify step past position 512 fails with a broadcast error.
        self.llm = Llama(str(path), n_ctx=n_ctx, n_threads=torch.get_num_threads(), draft_model=draft,
                         logits_all=draft is not None, verbose=False)

    def forget(self) -> None:  # every answer evaluates with reset=True
        pass

    def generate(self, messages: Messages, params: SamplingParams) -> RequestOutput:
        ids = encode(self.tokenizer, messages)
        eos = {self.llm.token_eos()}
        new: list[int] = []
        if params.seed is not None:
            self.llm.set_seed(params.seed)
        start = time.perf_counter()
        first = None  # when the first new token came: the prompt's evaluation before it
        tokens = self.llm.generate(ids, temp=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                   min_p=params.min_p, reset=True)  # llama.cpp's own default min_p is 0.05
        for token in tokens:
            first = first or time.perf_counter()
            new.append(token)
            if (token in eos and not params.ignore_eos) or len(new) >= params.max_new_tokens:
                break
        end = time.perf_counter()
        first = first or end
        stats = GenerationStats(prompt_tokens=len(ids), new_tokens=len(new), prefill_s=first - start,
                                decode_s=end - first, finish_reason=finish_reason(new, eos, params))
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return RequestOutput(list(messages), ids, text=text, token_ids=new, stats=stats)


def finish_reason(new: list[int], eos: Collection[int], params: SamplingParams) -> str:
    """'stop' when the answer ended at an end-of-sequence token, else 'length' (as quasar's engine says)."""
    return "stop" if new and new[-1] in eos and not params.ignore_eos else "length"


def build_hf(name: str, pool: Pool) -> HFMethod:
    mode = name.partition(":")[2]
    if mode not in ("ar", "pld"):
        raise ValueError(f"unknown transformers peer {name!r}; choose hf:ar or hf:pld")
    return HFMethod(name, pool.directory(), pool.options.pld_tokens if mode == "pld" else None)


def build_llamacpp(name: str, pool: Pool) -> LlamaCppMethod:
    _, mode, precision = (name.split(":") + ["q8_0"])[:3]
    if mode not in ("ar", "pld") or precision not in ("q8_0", "f16", "q4_k_m", "file"):
        raise ValueError(f"unknown llama.cpp peer {name!r}; choose llamacpp:{{ar,pld}}[:f16|:q8_0|:q4_k_m|:file] (file: "
                         "the model's own GGUF)")
    return LlamaCppMethod(name, pool, precision, pool.options.pld_tokens if mode == "pld" else None)
