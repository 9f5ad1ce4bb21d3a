"""How a model's forwards run, decided once at load (quasar.kernels.plan.prepare_) and kept as `model.plan`: every
module that needs to know (the model's forward, the batch planner, the prefix cache, the sampling helpers, the
reports) reads it here instead of probing the model's modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

TORCH = "torch"


@dataclass(frozen=True)
class ExecutionPlan:
    paths: str = TORCH  # what computes the forward, printed beside every figure ('kernels:dpbusd', 'torch', ...)
    fused: bool = False  # a whole forward (embedding, every layer, final norm, lm_head) is one kernel call
    batches_rows: bool = False  # several sequences' rows run as one forward, every row independent of the others
    bf16_attention: bool = False  # attention runs on bfloat16 products (the bf16 verifier on AMX)
    kernel: Any = None  # quasar's kernel module, for the row operations on float32 CPU logits; None: torch's

    @property
    def tree_rows(self) -> bool:
        """Whether a step may score a draft tree (quasar.model.llama.Rows): on the fused kernels' float32 attention,
        where a tree's row gets the floats of the same path verified as a chain (not on AMX's bfloat16 tiles, nor on
        torch, whose fixed-shape chain rows a tree's mask would not keep)."""
        return self.fused and not self.bf16_attention

    def row_kernel(self, t: torch.Tensor) -> Any:
        """The kernel module for work on tensor t where it is a float32 CPU tensor and the plan has one, else None."""
        return self.kernel if t.device.type == "cpu" and t.dtype == torch.float32 else None


ON_TORCH = ExecutionPlan()
