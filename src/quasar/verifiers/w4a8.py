"""The 'w4a8' verifier: a GGUF model's own quantized blocks, computed on as they are (no requantization); or, for
'w4a8:gN[:awq|:rtn|:gptq]' and for a model that is no GGUF file, 4-bit blocks fitted to the float weights once and cached
as the w8a8 checkpoints are (verifiers/quantized.py, quant/w4a8.quantize_4bit).

Every linear whose tensor is Q4_0, Q4_1, Q4_K, Q5_0, Q5_1 or Q5_K becomes a W4A8Linear holding the file's 4- or 5-bit
quants, scales and mins (quant/w4a8.py); Q6_K ones a W6A8Linear holding its 6-bit quants and scales; Q8_0 ones
group-wise W8A8 linears holding the file's int8 values and block scales (Int8Linear, G = 32). Those weights are exactly
the file's: against the float model (the file dequantized) the only difference is activation rounding, one int8 scale
per 32 inputs. A Q8_0 lm_head takes its activations in two int8 passes (Int8Linear.activation_passes, about 15 bits):
its weights' error is far below an 8-bit activation's, and the logits are what a verifier is judged by (the default
model: top-1 against the float model 0.974 with one pass, 0.979 with two; docs/quantization.md). Linears of other
types (Q2_K, Q3_K, IQ*, float) are quantized to W8A8 per group of 32 from their dequantized weights, and the load says
how many.
The token embeddings are looked up in the file's own blocks too (gguf_blocks.BlockEmbedding) where their type has a
block form; norms stay float32 as in the float model.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from quasar.kernels import native
from quasar.kernels.plan import kernel_for, pack_early_
from quasar.model.gguf_blocks import BlockEmbedding, Blocks, ByteBlocks, FourBitBlocks, SixBitBlocks, linear_blocks
from quasar.model.loading import LoadedModel, gguf_config, load, map_gguf
from quasar.model.source import ModelSource
from quasar.quant.int8 import Int8Linear
from quasar.quant.schemes import swap_module_
from quasar.quant.w4a8 import W4A8Linear, W6A8Linear
from quasar.spec import VerifierSpec
from quasar.verifiers.quantized import load_quantized_verifier

log = logging.getLogger("quasar")
LARGE_ROWS = 32768


def block_linear(linear: nn.Linear, blocks: Blocks | None) -> tuple[nn.Module, str]:
    """The layer computing `linear` from its blocks, and where its weights came from."""
    if isinstance(blocks, FourBitBlocks):
        return W4A8Linear.from_blocks(blocks, linear.bias), blocks.source
    if isinstance(blocks, SixBitBlocks):
        return W6A8Linear.from_blocks(blocks, linear.bias), blocks.source
    if isinstance(blocks, ByteBlocks):
        layer = Int8Linear(linear.in_features, linear.out_features, linear.bias is not None, group_size=32)
        layer.weight, layer.weight_scale = blocks.values, blocks.scale
        if linear.bias is not None:
            layer.bias = linear.bias.detach().float().clone()
        return layer, blocks.source
    return Int8Linear.from_float(linear, group_size=32), "requantized"


def load_w4a8(model: ModelSource, spec: VerifierSpec | None = None, owned: bool = True) -> LoadedModel:
    """Plain 'w4a8' on a GGUF file: the file's own blocks (as 'gguf'); else calibrated blocks (a cached or given
    checkpoint)."""
    spec = spec or VerifierSpec("w4a8")
    if spec.calibrated_blocks or model.format != "gguf":
        return load_quantized_verifier(model, spec)
    return load_file_blocks(model, spec, owned)


def load_file_blocks(model: ModelSource, spec: VerifierSpec | None = None, owned: bool = True) -> LoadedModel:
    """The 'gguf' verifier: the model of a GGUF file with every linear computing on the file's own blocks. The float
    weights of those (and of the embedding) are never read, and no float copy of the file is made. owned (nothing
    but the verifier reads its weights): where quasar's kernels run, each layer is packed for them as it is made
    and its plain blocks dropped, so the plain blocks of the whole model and its panels are never held together
    (load_verifier's plan then finds them packed)."""
    path, file = model.path, map_gguf(model.path)
    blocks = linear_blocks(file, gguf_config(file.header))
    loaded = load(model, "fp32", skip=set(blocks))  # never read in float
    kernel = kernel_for(loaded.model) if owned else None
    sources: Counter[str] = Counter()
    names = [n for n, m in loaded.model.named_modules() if isinstance(m, nn.Linear)]
    for name in names:  # each tensor's blocks unpacked, made a layer and dropped before the next
        read = blocks.get(f"{name}.weight")
        layer, source = block_linear(loaded.model.get_submodule(name), read() if read else None)
        if name == "lm_head" and source == "Q8_0":
            layer.activation_passes = 2  # the file's 8-bit head: its activations' rounding would be the larger error
        swap_module_(loaded.model, name, layer)
        if kernel is not None:
            pack_early_(layer, kernel)
        sources[source] += 1
        if kernel is not None or layer.out_features > LARGE_ROWS:  # the plain blocks' pages back at once
            native.release_memory()
    if "model.embed_tokens.weight" in blocks:  # looked up in the blocks: the float table was never read
        table = blocks["model.embed_tokens.weight"]()
        loaded.model.model.embed_tokens = BlockEmbedding(table, loaded.model.model.embed_tokens.multiplier)
    log.info("gguf blocks of %s: %s", path.name, ", ".join(f"{n} linears {s}" for s, n in sorted(sources.items())))
    return loaded
