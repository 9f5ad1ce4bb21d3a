"""A GGUF file's quantized linear weights as its blocks hold them, unpacked but not dequantized: for verifiers that
compute with the file's own weights (quasar.verifiers.w4a8) instead of the float model made from them.

Two forms, each exact (dequantizing it gives gguf's own dequantization of the tensor, float for float):

- FourBitBlocks (Q4_0, Q4_1, Q4_K, and with 5-bit quants Q5_0, Q5_1, Q5_K): quants q in [0, 15] ([0, 31]) and
  w = d * sc * q - dmin * m, with float16 d and dmin per block of `block` inputs (the K-quants' super-blocks of 256;
  32 for the others) and byte sc and m per group of 32 (the K-quants' 6-bit scales and mins; sc = m = 1 for Q4_0 and
  Q5_0, whose dmin is 8 d and 16 d, and for Q4_1 and Q5_1, whose dmin is -min).
- SixBitBlocks (Q6_K): quants q in [0, 63] and w = d * sc * (q - 32), with float16 d per block of 256 inputs and a
  signed byte sc per sub-block of 16.
- ByteBlocks (Q8_0): int8 values and one float scale per group of 32.

Other tensor types (Q2_K, Q3_K, IQ*, float) have no block form here (`unpack` gives None). BlockEmbedding looks
token embeddings up in blocks of any of these forms.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import nn

from quasar.model.gguf_file import GGUFFile
from quasar.model.llama import rows_table, scaled
from quasar.model.loading import hf_name, unpermute_rope

GROUP = 32


@dataclass(frozen=True)
class FourBitBlocks:
    """w [N, K] = (d * sc)[group] * q - (dmin * m)[group]: q [N, K] uint8 in [0, 2^bits), d and dmin [N, K/block]
    float16, sc and m [N, K/32] uint8."""

    q: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor
    block: int
    source: str  # the GGUF tensor type: Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q5_K
    bits: int = 4

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as gguf dequantizes the tensor."""
        N, K = self.q.shape
        per = self.block // GROUP
        scale = self.d.float().repeat_interleave(per, 1) * self.sc.float()  # [N, K/32], exact
        low = self.dmin.float().repeat_interleave(per, 1) * self.m.float()
        q = self.q.float().view(N, K // GROUP, GROUP)
        return (scale[..., None] * q - low[..., None]).view(N, K)


@dataclass(frozen=True)
class ByteBlocks:
    """w [N, K] = scale[group] * values: values [N, K] int8, scale [N, K/32] float32."""

    values: torch.Tensor
    scale: torch.Tensor
    source: str  # Q8_0

    def dequantize(self) -> torch.Tensor:
        N, K = self.values.shape
        return (self.values.float().view(N, K // GROUP, GROUP) * self.scale[..., None]).view(N, K)


@dataclass(frozen=True)
class SixBitBlocks:
    """w [N, K] = (d * sc)[sub-block] * (q - 32): q [N, K] uint8 in [0, 63], d [N, K/256] float16, sc [N, K/16] int8."""

    q: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor
    source: str = "Q6_K"

    def dequantize(self) -> torch.Tensor:
        N, K = self.q.shape
        scale = self.d.float().repeat_interleave(16, 1) * self.sc.float()  # [N, K/16], exact
        return (scale[..., None] * (self.q.float() - 32).view(N, K // 16, 16)).view(N, K)


Blocks = FourBitBlocks | SixBitBlocks | ByteBlocks


CACHED_ROWS = 4096  # dequantized embedding rows kept for small steps (a 1.5B model's: 6 KB each)
SMALL_STEP = 16  # tokens a step at most whose rows kernel_table keeps


class BlockEmbedding(nn.Module):
    """Token embeddings looked up in a GGUF file's own blocks: a step dequantizes only its tokens' rows, the same
    floats as the whole table dequantized (every operation is per element), in a quarter of float32's memory or
    less (a 1.5B model's Q4_K table: 233 MB instead of 933)."""

    def __init__(self, blocks: Blocks, multiplier: float | None = None) -> None:
        super().__init__()
        self.kind, self.multiplier = type(blocks), multiplier  # multiplier: as the float table's (Embedding's)
        values = {f.name: getattr(blocks, f.name) for f in fields(blocks)}
        self.tensors = [name for name, value in values.items() if isinstance(value, torch.Tensor)]
        self.fixed = {name: value for name, value in values.items() if name not in self.tensors}
        for name in self.tensors:
            self.register_buffer(name, values[name], persistent=False)
        self.num_embeddings, self.embedding_dim = values[self.tensors[0]].shape  # q or values: [N, K]
        self.rows: dict[int, torch.Tensor] = {}  # token -> its dequantized row, for small steps (kernel_table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.kind(**{name: getattr(self, name)[flat] for name in self.tensors}, **self.fixed)
        return scaled(rows.dequantize().view(*ids.shape, self.embedding_dim), self.multiplier)

    def kernel_table(self, ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """The fused kernels' (ids, table): these tokens' rows as a table of their own. A decode or verify step's
        rows come from the rows dequantized before (the same floats): dequantizing them took about 0.2 ms a step,
        3% of the default model's."""
        device = getattr(self, self.tensors[0]).device
        if len(ids) > SMALL_STEP:
            return rows_table(self, ids, device)
        missing = [token for token in dict.fromkeys(ids) if token not in self.rows]
        if missing:
            if len(self.rows) + len(missing) > CACHED_ROWS:
                self.rows.clear()
            self.rows.update(zip(missing, self(torch.tensor(missing, device=device))))
        return list(range(len(ids))), torch.stack([self.rows[token] for token in ids])


def halves(qs: np.ndarray) -> np.ndarray:
    """Packed nibbles [..., n] -> [..., 2n]: the low nibbles first, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def fp16(raw: np.ndarray) -> np.ndarray:
    """Two bytes [..., 2] -> float16 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def k_quant(data: np.ndarray, rows: int, five: bool) -> FourBitBlocks:
    """Q4_K (d, dmin, 12 bytes of 6-bit scales and mins, 128 of quants) and Q5_K (the same with 32 bytes of fifth
    bits before the quants)."""
    from gguf.quants import Q4_K

    width = 176 if five else 144
    blocks = data.reshape(rows, -1, width)  # [N, K/256, width]
    nb = blocks.shape[1]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))  # [N * nb, 8] each
    qs = blocks[..., width - 128 :].reshape(rows, nb, 4, 32)  # four chunks of 64 weights: low nibbles, then high ones
    q = halves(qs).reshape(rows, nb, 8, 32)  # [N, nb, group, 32]
    if five:  # bit j of byte i: the fifth bit of weight 32 j + i
        qh = blocks[..., 16:48].reshape(rows, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = q | ((qh & 0x01) << 4)
    return FourBitBlocks(torch.from_numpy(q.reshape(rows, nb * 256)), torch.from_numpy(fp16(blocks[..., 0:2])),
                         torch.from_numpy(fp16(blocks[..., 2:4])), torch.from_numpy(sc.reshape(rows, nb * 8)),
                         torch.from_numpy(m.reshape(rows, nb * 8)), 256, "Q5_K" if five else "Q4_K", 5 if five else 4)


def q6_k(data: np.ndarray, rows: int) -> SixBitBlocks:
    blocks = data.reshape(rows, -1, 210)  # [N, K/256, 210]: 128 bytes of low 4 bits, 64 of high 2 bits, 16 sc, d
    nb = blocks.shape[1]
    low = halves(blocks[..., :128].reshape(rows, nb, 2, 64))  # [N, nb, 2, 128]: weight 128 h + j
    qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = (qh & 0x03).reshape(rows, nb, 2, 128)  # weight 128 h + 32 s + i: bits 2s of byte 32 h + i
    q = (low | (high << 4)).reshape(rows, nb * 256)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, nb * 16)
    return SixBitBlocks(torch.from_numpy(q), torch.from_numpy(fp16(blocks[..., 208:210])), torch.from_numpy(sc))


def legacy(data: np.ndarray, rows: int, five: bool, with_min: bool) -> FourBitBlocks:
    """Q4_0, Q4_1, Q5_0 and Q5_1: per 32 inputs d (and min), for 5-bit quants 4 bytes of fifth bits (bit j: weight j),
    then 16 bytes of nibbles. w = d q + min with a min, else d (q - 8) (Q4_0) or d (q - 16) (Q5_0): dmin = 8 d or 16 d,
    exact (a float16 times a power of two)."""
    heads = 4 if with_min else 2
    width = heads + (4 if five else 0) + 16
    blocks = data.reshape(rows, -1, width)  # [N, K/32, width]
    nb = blocks.shape[1]
    d = fp16(blocks[..., 0:2])
    if with_min:
        dmin = -fp16(blocks[..., 2:4])
    else:
        with np.errstate(over="raise"):
            dmin = d * np.float16(16 if five else 8)
    q = halves(blocks[..., width - 16 :])  # [N, nb, 32]
    if five:
        q = q | (np.unpackbits(blocks[..., heads : heads + 4], axis=-1, bitorder="little") << 4)
    ones = torch.ones(rows, nb, dtype=torch.uint8)
    name = f"Q{5 if five else 4}_{1 if with_min else 0}"
    return FourBitBlocks(torch.from_numpy(q.reshape(rows, nb * 32)), torch.from_numpy(d), torch.from_numpy(dmin), ones,
                         ones.clone(), 32, name, 5 if five else 4)


def byte_blocks(data: np.ndarray, rows: int, qtype: Any) -> ByteBlocks:
    """Q8_0: the values from gguf's dequantization divided by the block's d (exact: each is d times an integer), checked
    to be integers."""
    from gguf.quants import dequantize

    blocks = data.reshape(rows, -1, 34)
    d = fp16(blocks[..., 0:2]).astype(np.float32)  # [N, K/32]
    w = dequantize(data, qtype).reshape(rows, -1, GROUP)
    values = np.divide(w, d[..., None], out=np.zeros_like(w), where=d[..., None] != 0)
    if not (np.all(values == np.round(values)) and np.abs(values).max(initial=0) <= 127):
        raise ValueError("a Q8_0 tensor whose blocks are not d times int8 values")
    return ByteBlocks(torch.from_numpy(values.astype(np.int8).reshape(rows, -1)), torch.from_numpy(d), "Q8_0")


# The GGML types with a block form here, by name: (raw blocks, rows, the type) -> blocks.
UNPACKERS: dict[str, Callable[[np.ndarray, int, Any], Blocks]] = {
    "Q4_K": lambda data, rows, qtype: k_quant(data, rows, False),
    "Q5_K": lambda data, rows, qtype: k_quant(data, rows, True),
    "Q6_K": lambda data, rows, qtype: q6_k(data, rows),
    "Q4_0": lambda data, rows, qtype: legacy(data, rows, False, False),
    "Q4_1": lambda data, rows, qtype: legacy(data, rows, False, True),
    "Q5_0": lambda data, rows, qtype: legacy(data, rows, True, False),
    "Q5_1": lambda data, rows, qtype: legacy(data, rows, True, True),
    "Q8_0": byte_blocks,
}


def tensor_blocks(tensor: Any) -> Blocks | None:
    """One GGUF tensor's blocks, or None for a type without a block form here."""
    return unpack(np.asarray(tensor.data), tensor.tensor_type, int(np.prod(tensor.shape[1:])))


CHUNK_ROWS = 4096  # rows unpacked at a time: an unpacker's temporaries are several times its output


def unpack(data: np.ndarray, qtype: Any, rows: int) -> Blocks | None:
    """The raw blocks of a tensor of `rows` rows of GGML type qtype (gguf.GGMLQuantizationType) as blocks, or None.
    A tall tensor (a 150k-token embedding or lm_head) is unpacked CHUNK_ROWS rows at a time into its output, so the
    unpackers' temporaries never span the whole tensor (on the 1.5B's Q6_K lm_head, 0.8 GB of the load's peak)."""
    unpacker = UNPACKERS.get(qtype.name)
    if unpacker is None:
        return None
    if rows <= CHUNK_ROWS:
        return unpacker(data, rows, qtype)
    data = data.reshape(rows, -1)
    first = unpacker(data[:CHUNK_ROWS], CHUNK_ROWS, qtype)
    whole = {f.name: getattr(first, f.name) for f in fields(first)}
    whole.update({name: torch.empty((rows, *v.shape[1:]), dtype=v.dtype)
                  for name, v in whole.items() if isinstance(v, torch.Tensor)})
    for start in range(0, rows, CHUNK_ROWS):
        n = min(CHUNK_ROWS, rows - start)
        part = first if start == 0 else unpacker(data[start : start + n], n, qtype)
        for f in fields(part):
            if isinstance(whole[f.name], torch.Tensor):
                whole[f.name][start : start + n] = getattr(part, f.name)
    return type(first)(**whole)


def permute_rows(blocks: Blocks, heads: int) -> Blocks:
    """llama.cpp's q/k row order undone (loading.unpermute_rope) on every per-row tensor of the blocks."""
    fields = {k: unpermute_rope(v, heads) for k, v in vars(blocks).items() if isinstance(v, torch.Tensor)}
    return type(blocks)(**{**vars(blocks), **fields})


def linear_blocks(file: GGUFFile, config: dict[str, Any]) -> dict[str, Callable[[], Blocks]]:
    """Every 2-D weight of the mapped GGUF whose type has a block form, by its Hugging Face name ('lm_head.weight'
    for a tied embedding too): a function that unpacks its blocks. A caller that turns each into its layer before
    unpacking the next holds one tensor's unpacked blocks at a time, not the whole model's (on the 1.5B, 1.6 GB of
    quants a byte each); the embedding's blocks are unpacked once, for the table and a tied lm_head alike."""
    out: dict[str, Callable[[], Blocks]] = {}
    for tensor in file.tensors:
        if len(tensor.shape) != 2 or not tensor.name.endswith(".weight") or tensor.tensor_type.name not in UNPACKERS:
            continue
        heads = None
        if config["model_type"] in ("llama", "mistral") and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads" if "attn_q" in tensor.name else "num_key_value_heads"]
        name = hf_name(tensor.name, config["model_type"])
        out[name] = functools.partial(_read_blocks, tensor, heads, file)
        if name == "model.embed_tokens.weight":
            out[name] = functools.cache(out[name])
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _read_blocks(tensor: Any, heads: int | None, file: GGUFFile) -> Blocks:
    """A tensor's blocks, its rows in the Hugging Face order (llama.cpp permutes Llama's q and k: heads given); the file's
    pages it read then leave this process's resident memory (release_pages)."""
    blocks = tensor_blocks(tensor)
    release_pages(file.data, tensor.data_offset, tensor.n_bytes)
    return blocks if heads is None else permute_rows(blocks, heads)


def release_pages(mapping: Any, offset: int, size: int) -> None:
    """Drop the whole pages of bytes [offset, offset + size) of a file's mapping (a numpy memmap) from this process's resident
    set (MADV_DONTNEED; a read-only mapping of the file: a later read pages them in again from the page cache). Read
    tensor by tensor, a whole file's pages would otherwise stay resident until the reader goes: on the 1.5B's Q4_K_M,
    1 GB of the peak over a w4a8 load."""
    mapping = getattr(mapping, "_mmap", None)  # np.memmap keeps its mmap.mmap here
    if not isinstance(mapping, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
