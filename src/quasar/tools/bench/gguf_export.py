"""F16, BF16, Q8_0 and Q4_K_M copies of a GGUF model, for the llama.cpp peers (same weights as quasar's methods).

Every metadata field is copied; each 2-D weight is dequantized and re-encoded (F16, BF16, or Q8_0 where rows
are a multiple of its 32-value block), 1-D tensors (norms, biases) stay F32 as llama.cpp expects. The Q4_K_M copy
is llama.cpp's own quantizer (`llama_model_quantize`, needs llama-cpp-python) run on the F16 copy: llama.cpp's 4-bit
blocks of the same float weights that quasar's calibrated `w4a8:gN` fits. Written once into the user cache, keyed by
the source's sha256.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from quasar.files import cache_root
from quasar.model.loading import open_gguf
from quasar.model.source import ModelSource

log = logging.getLogger("quasar")
PRECISIONS = {"f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0")}  # -> (tensor type, file type)
LLAMA_QUANTIZED = {"q4_k_m": "Q4_K_M"}  # copies made by llama.cpp's quantizer from the F16 copy -> its file type


def encode(weights: np.ndarray, precision: str) -> tuple[np.ndarray, object]:
    """float32 weights -> (encoded data, GGML type) for `precision`."""
    import gguf
    from gguf.quants import quantize

    if weights.ndim == 1:
        return weights.astype(np.float32), gguf.GGMLQuantizationType.F32
    kind = gguf.GGMLQuantizationType[PRECISIONS[precision][0]]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if weights.shape[-1] % block:
        kind = gguf.GGMLQuantizationType.F16
    return quantize(weights, kind), kind


def write_copy(source: Path, target: Path, precision: str) -> None:
    """Write `source` re-encoded at `precision` to `target` (through a temporary file)."""
    import gguf
    from gguf.quants import dequantize

    reader = open_gguf(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")  # one per process: concurrent exports never share it
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.file_type") or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType[PRECISIONS[precision][1]])
    for tensor in reader.tensors:
        data, kind = encode(dequantize(tensor.data, tensor.tensor_type).astype(np.float32), precision)
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)


def llama_quantize(source: Path, target: Path, file_type: str) -> None:
    """llama.cpp's own quantizer: `source` (F16) to `target` of `file_type` ('Q4_K_M'), through a temporary file."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = os.cpu_count() or 1
    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {source.name} to {file_type}")
    os.replace(tmp, target)


def exported_gguf(model: ModelSource, precision: str) -> Path:
    """The cached `precision` ('f16', 'bf16', 'q8_0' or 'q4_k_m') copy of a GGUF model, made on first use."""
    if precision not in (*PRECISIONS, *LLAMA_QUANTIZED):
        raise ValueError(f"unknown GGUF precision {precision!r}; choose from {', '.join((*PRECISIONS, *LLAMA_QUANTIZED))}")
    if model.format != "gguf":
        raise ValueError("the llama.cpp peers need a GGUF model (--model default or a .gguf file)")
    source = model.path
    target = cache_root() / "gguf-export" / f"{model.sha256}-{precision}.gguf"
    if not target.exists():
        log.info("writing a %s copy of %s for llama.cpp into %s", precision, source.name, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        if precision in LLAMA_QUANTIZED:
            llama_quantize(exported_gguf(model, "f16"), target, LLAMA_QUANTIZED[precision])
        else:
            write_copy(source, target, precision)
    return target


def llama_cpp_gguf(model: ModelSource, precision: str) -> Path:
    """The GGUF a llama.cpp peer runs: the model's own file ('file', e.g. the Q4_K_M users run) or its cached copy in
    `precision`."""
    if precision != "file":
        return exported_gguf(model, precision)
    if model.format != "gguf":
        raise ValueError("the llama.cpp peers need a GGUF model (--model default or a .gguf file)")
    return model.path
