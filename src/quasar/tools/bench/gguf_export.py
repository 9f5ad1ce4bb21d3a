"""F16, BF16 and Q8_0 copies of a GGUF model, for the llama.cpp peers (same weights as quasar's methods).

Every metadata field is copied; each 2-D weight is dequantized and re-encoded (F16, BF16, or Q8_0 where rows
are a multiple of its 32-value block), 1-D tensors (norms, biases) stay F32 as llama.cpp expects.
Written once into the user cache, keyed by the source's sha256.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from quasar.files import cache_root, sha256_memo
from quasar.model.loading import open_gguf, resolve

log = logging.getLogger("quasar")
PRECISIONS = {"f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0")}  # -> (tensor type, file type)


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


def exported_gguf(model: str | Path, precision: str) -> Path:
    """The cached `precision` ('f16', 'bf16' or 'q8_0') copy of a GGUF model, made on first use."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown GGUF precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    source = resolve(model)
    if not source.is_file():
        raise ValueError("the llama.cpp peers need a GGUF model (--model default or a .gguf file)")
    target = cache_root() / "gguf-export" / f"{sha256_memo(source)}-{precision}.gguf"
    if not target.exists():
        log.info("writing a %s copy of %s for llama.cpp into %s", precision, source.name, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_copy(source, target, precision)
    return target


def llama_cpp_gguf(model: str | Path, precision: str) -> Path:
    """The GGUF a llama.cpp peer runs: the model's own file ('file', e.g. the Q4_K_M users run) or its cached copy in
    `precision`."""
    if precision != "file":
        return exported_gguf(model, precision)
    source = resolve(model)
    if not source.is_file():
        raise ValueError("the llama.cpp peers need a GGUF model (--model default or a .gguf file)")
    return source
