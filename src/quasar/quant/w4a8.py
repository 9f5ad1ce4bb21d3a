"""The linears of the w4a8 verifier: GGUF's quantized blocks as the file holds them, times dynamic int8 activations
with one scale per 32 inputs, exact int32 dot products per group of 32.

W4A8Linear: 4-bit weights in blocks with scales and mins (Q4_0, Q4_1 and Q4_K; 5-bit ones too, Q5_K).

    w[n, k] = S[n, g] * q[n, k] - M[n, g]    q in [0, 15] ([0, 31]), g = k / 32,  S = d * sc,  M = dmin * m (exact)
    y[m, n] = sum_g (float(q[n, g] . x[m, g]) * S[n, g] - M[n, g] * float(xsum[m, g])) * x_scale[m, g]   (+ bias)

x[m, g] are the row's int8 inputs of group g (quant.int8.quantize_tokens with G = 32, as the w8a8 verifier's) and
xsum their sum: the mins cost one product per group, not per weight (llama.cpp's Q4_K dot products take the mins
the same way). The groups are summed in order, each float operation rounded as written (no fused multiply-add): this
module is the reference quasar's kernels (kernels/quant_layers.KernelW4A8Linear) give bit for bit, and a row's
result depends on its own input only.

W6A8Linear: Q6_K's 6-bit weights, one signed scale per sub-block of 16 inputs (sc) and float16 d per 256:

    w[n, k] = S[n, s] * (q[n, k] - 32)    q in [0, 63], s = k / 16,  S = d * sc (exact)
    y[m, n] = sum_g (D[a] * S[n, a] + D[b] * S[n, b]) * x_scale[m, g]   D[s] = q[n, s] . x[m, s] - 32 * xsum16[m, s]

with a and b the two sub-blocks of group g and D exact integers (KernelW6A8Linear gives its floats bit for bit).
"""

from __future__ import annotations

import torch
from torch import nn

from quasar.quant.int8 import quantize_tokens

GROUP = 32
LEVELS = 15  # the largest 4-bit quant
SUPER_BLOCK = 256  # the inputs of a K-quant super-block (Q4_K); where it does not divide K, see fit_bits
CLIP_RATIOS = torch.linspace(1.0, 0.7, 13).tolist()  # the range searched for each group's scale and min
ROWS_AT_ONCE = 4096  # rows of a weight fitted together (bounds the fit's temporaries)
ACTIVATION_AWARE = ("awq", "gptq")  # the fits that weigh each input by its calibration mean square
GPTQ_DAMP = 0.01  # added to the input products' diagonal, times its mean (GPTQ's dampening)
GPTQ_COLUMNS = 128  # inputs rounded together before their errors reach the later ones (GPTQ's lazy batch)


def block_size(in_features: int) -> int:
    """The inputs one float16 (d, dmin) pair spans in a calibrated W4A8 weight: 256 as Q4_K where that divides K, else
    the largest of 128, 64, 32 that does."""
    return next(b for b in (256, 128, 64, 32) if in_features % b == 0)


def fit_bits(in_features: int, fallbacks: bool) -> int:
    """The quant bits of a fitted W4A8 weight of `in_features` inputs: 4, or with llama.cpp's fallbacks 5 where Q4_K's
    super-block does not divide them (its Q4_K_M takes Q5_0 there)."""
    return 5 if fallbacks and in_features % SUPER_BLOCK else 4


def fit_groups(w: torch.Tensor, importance: torch.Tensor, search: bool,
               levels: int = LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, G] (one group a row) -> (scale [R], low [R]): w ~ scale * q + low, q in [0, levels],
    low <= 0 <= scale * levels + low, minimising sum_k importance[k] * (w - w_hat)^2 (importance [R, G]: the inputs'
    mean square, so that the error is the linear's expected output error). search: try the clip ratios and refine
    scale and low by weighted least squares (the activation-aware fit); else min-max round to nearest. Each span is
    tried in `levels` steps and in a few less, down to three quarters of them (4 bits: 15 to 12; 5 bits: 31 to 24):
    a weight already on a grid (a dequantized Q4_1, Q4_K or Q5_0 file, whose groups need not reach both ends of
    theirs) lies on the points of one of them, and keeps its values."""
    hi, lo = w.amax(1).clamp_min(0), w.amin(1).clamp_max(0)  # [R]
    best = None
    steps = range(levels, 3 * levels // 4, -1)
    for ratio, n in [(r, n) for r in (CLIP_RATIOS if search else [1.0]) for n in steps]:
        scale, low = ((hi - lo) * ratio / n).clamp_min(1e-12), lo * ratio
        for _ in range(2 if search else 0):  # weighted least squares for (scale, low) with q fixed
            q = ((w - low[:, None]) / scale[:, None]).round_().clamp_(0, levels)
            a, aq, aqq = importance.sum(1), (importance * q).sum(1), (importance * q * q).sum(1)
            aw, aqw = (importance * w).sum(1), (importance * q * w).sum(1)
            det = aqq * a - aq * aq
            ok = det > 1e-20 * aqq * a
            new_scale = torch.where(ok, (aqw * a - aq * aw) / det.clamp_min(1e-30), scale)
            new_low = torch.where(ok, (aqq * aw - aq * aqw) / det.clamp_min(1e-30), low)
            positive = new_low > 0  # keep low <= 0 (the min is subtracted): refit the scale alone there
            new_scale = torch.where(positive, aqw / aqq.clamp_min(1e-30), new_scale)
            scale, low = new_scale.clamp_min(1e-12), torch.where(positive, torch.zeros_like(new_low), new_low)
        q = ((w - low[:, None]) / scale[:, None]).round_().clamp_(0, levels)
        err = (importance * (scale[:, None] * q + low[:, None] - w) ** 2).sum(1)
        if best is None:
            best = (err, scale, low)
        else:
            better = err < best[0]
            best = (torch.where(better, err, best[0]), torch.where(better, scale, best[1]), torch.where(better, low, best[2]))
    return best[1], best[2]


def two_level(values: torch.Tensor, per: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values [N, groups] >= 0 -> (d [N, groups / per] float16, byte [N, groups] uint8): values ~ d * byte, the largest
    of each block of `per` groups at byte 255."""
    N, groups = values.shape
    top = values.view(N, groups // per, per).amax(2)  # [N, blocks]
    d = (top / 255).half()
    step = d.float().repeat_interleave(per, 1)
    byte = torch.where(step > 0, (values / step.clamp_min(1e-30)).round(), torch.zeros_like(values)).clamp_(0, 255)
    return d, byte.to(torch.uint8)


def nearest_quants(w: torch.Tensor, S: torch.Tensor, M: torch.Tensor, levels: int = LEVELS) -> torch.Tensor:
    """The quants q in [0, levels] (as floats) nearest to w = S q - M, 0 where S is 0 (w, S, M broadcast together)."""
    return torch.where(S > 0, ((w + M) / S.clamp_min(1e-30)).round(), torch.zeros_like(w)).clamp_(0, levels)


def compensated_quants(weight: torch.Tensor, hessian: torch.Tensor, S: torch.Tensor, M: torch.Tensor,
                       levels: int = LEVELS) -> torch.Tensor:
    """GPTQ's rounding (Frantar et al., 2023, arXiv 2210.17323) with fixed group scales: weight [N, K], hessian [K, K]
    (the sum of x^T x over the calibration inputs), S and M [N, K/32] the stored scale and min of each group -> q [N, K]
    in [0, levels]. The inputs are rounded in order, and each one's rounding error is moved onto the inputs not yet
    rounded as their correlation with it says, so that the linear's output on inputs like the calibration's changes
    least."""
    N, K = weight.shape
    W = weight.detach().float().clone()
    H = hessian.detach().double().clone()
    dead = H.diagonal() == 0  # an input never seen: its weights cannot matter, nothing is compensated through it
    H[dead, dead] = 1
    W[:, dead] = 0
    H.diagonal().add_(GPTQ_DAMP * H.diagonal().mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()  # H^-1 = U^T U
    q = torch.empty(N, K, dtype=torch.uint8)
    for c0 in range(0, K, GPTQ_COLUMNS):
        c1 = min(c0 + GPTQ_COLUMNS, K)
        block, errors, U1 = W[:, c0:c1].clone(), torch.empty(N, c1 - c0), U[c0:c1, c0:c1]
        for i in range(c1 - c0):
            s, lo, w = S[:, (c0 + i) // GROUP], M[:, (c0 + i) // GROUP], block[:, i]
            qi = nearest_quants(w, s, lo, levels)
            q[:, c0 + i] = qi.to(torch.uint8)
            errors[:, i] = (w - (s * qi - lo)) / U1[i, i]
            block[:, i:].addr_(errors[:, i], U1[i, i:], alpha=-1)
        W[:, c1:].addmm_(errors, U[c0:c1, c1:], alpha=-1)
    return q


def quantize_4bit(weight: torch.Tensor, group: int = GROUP, importance: torch.Tensor | None = None,
                  search: bool = True, hessian: torch.Tensor | None = None, bits: int = 4):
    """weight [N, K] float -> FourBitBlocks (quasar.model.gguf_blocks) of `bits`-bit quants (4, or 5 as Q5_K holds
    them): a scale and a min per `group` inputs (a multiple of 32 dividing K), stored as Q4_K stores them (bytes sc
    and m per 32 inputs times float16 d and dmin per block of block_size(K) inputs), the quants refitted to the stored
    scales. importance [K]: the inputs' mean square
    (calibration), None for all alike. hessian [K, K]: the sum of the calibration inputs' x^T x, to round the quants
    by compensated_quants instead of each to its nearest."""
    from quasar.model.gguf_blocks import FourBitBlocks

    N, K = weight.shape
    if bits not in (4, 5):
        raise ValueError(f"W4A8 blocks hold 4- or 5-bit quants, not {bits}-bit ones")
    levels = 2**bits - 1
    if group % GROUP or K % group:
        raise ValueError(f"a W4A8 group of {group} inputs must be a multiple of 32 dividing K = {K}")
    weight = weight.detach().float()
    imp = torch.ones(K) if importance is None else importance.float().clamp_min(1e-8 * importance.float().mean())
    scale, low = torch.empty(N, K // group), torch.empty(N, K // group)
    for r0 in range(0, N, ROWS_AT_ONCE):
        rows = weight[r0 : r0 + ROWS_AT_ONCE]
        R = rows.shape[0]
        s, lo = fit_groups(rows.reshape(-1, group), imp.view(1, K // group, group).expand(R, -1, -1).reshape(-1, group),
                           search, levels)
        scale[r0 : r0 + R], low[r0 : r0 + R] = s.view(R, -1), lo.view(R, -1)
    B, repeat = block_size(K), group // GROUP
    d, sc = two_level(scale.repeat_interleave(repeat, 1), B // GROUP)
    dmin, m = two_level((-low).repeat_interleave(repeat, 1), B // GROUP)
    S = d.float().repeat_interleave(B // GROUP, 1) * sc.float()  # [N, K/32] as stored
    M = dmin.float().repeat_interleave(B // GROUP, 1) * m.float()
    if hessian is not None:
        q = compensated_quants(weight, hessian, S, M, levels)
        return FourBitBlocks(q, d, dmin, sc, m, B, f"w4a8:g{group}", bits)
    q = nearest_quants(weight.view(N, K // GROUP, GROUP), S[..., None], M[..., None], levels)
    return FourBitBlocks(q.to(torch.uint8).view(N, K), d, dmin, sc, m, B, f"w4a8:g{group}", bits)


class W4A8Linear(nn.Module):
    """The weights as blocks (quasar.model.gguf_blocks.FourBitBlocks): q's low 4 bits as nibble pairs qweight [N, K/2]
    uint8 (q[2i] in the low nibble), 5-bit quants' fifth bits in qhigh [N, K/8] (bit i of byte j: q[8j + i]'s),
    d and dmin [N, K/block] float16, sc and m [N, K/32] uint8."""

    qhigh: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, block: int = 256, bits: int = 4) -> None:
        super().__init__()
        if block % GROUP or in_features % block:
            raise ValueError(f"W4A8 blocks of {block} inputs must be a multiple of 32 dividing K = {in_features}")
        if bits not in (4, 5):
            raise ValueError(f"W4A8 blocks hold 4- or 5-bit quants, not {bits}-bit ones")
        self.in_features, self.out_features, self.block, self.bits = in_features, out_features, block, bits
        N, K = out_features, in_features
        self.register_buffer("qweight", torch.zeros(N, K // 2, dtype=torch.uint8))
        if bits == 5:
            self.register_buffer("qhigh", torch.zeros(N, K // 8, dtype=torch.uint8))
        else:
            self.qhigh = None
        self.register_buffer("d", torch.zeros(N, K // block, dtype=torch.float16))
        self.register_buffer("dmin", torch.zeros(N, K // block, dtype=torch.float16))
        self.register_buffer("sc", torch.zeros(N, K // GROUP, dtype=torch.uint8))
        self.register_buffer("m", torch.zeros(N, K // GROUP, dtype=torch.uint8))
        self.register_buffer("bias", torch.zeros(N) if bias else None)  # [N] float32

    @classmethod
    def from_blocks(cls, blocks, bias: torch.Tensor | None = None) -> W4A8Linear:
        """From FourBitBlocks (q [N, K] in [0, 15])."""
        N, K = blocks.q.shape
        with torch.device("meta"):  # every buffer is set below: no zeros of the weight's size first
            layer = cls(K, N, bias is not None, blocks.block, blocks.bits)
        q = (blocks.q & 0x0F).view(N, K // 2, 2)
        layer.qweight = (q[..., 0] | (q[..., 1] << 4)).contiguous()
        if blocks.bits == 5:
            fifth = (blocks.q >> 4).view(N, K // 8, 8) << torch.arange(8, dtype=torch.uint8)
            layer.qhigh = fifth.sum(-1, dtype=torch.uint8).contiguous()  # distinct bits: the sum is their OR
        layer.d, layer.dmin = blocks.d.contiguous(), blocks.dmin.contiguous()
        layer.sc, layer.m = blocks.sc.contiguous(), blocks.m.contiguous()
        if bias is not None:
            layer.bias = bias.detach().float().clone()
        return layer

    @classmethod
    def from_float(cls, linear: nn.Linear, group: int = GROUP, importance: torch.Tensor | None = None,
                   search: bool = True, hessian: torch.Tensor | None = None, bits: int = 4) -> W4A8Linear:
        """Calibrated 4- or 5-bit blocks of a float linear (quantize_4bit)."""
        return cls.from_blocks(quantize_4bit(linear.weight, group, importance, search, hessian, bits), linear.bias)

    def quants(self, rows: slice = slice(None)) -> torch.Tensor:
        """q [N, K] uint8 in [0, 2^bits) (of the channels `rows` only: [n, K])."""
        packed = self.qweight[rows]
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], self.in_features)
        if self.qhigh is not None:
            fifth = (self.qhigh[rows, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [n, K/8, 8]
            q = q | (fifth.view(packed.shape[0], self.in_features) << 4)
        return q

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, M) [N, K/32] float32: each group's scale d * sc and min dmin * m."""
        per = self.block // GROUP
        S = self.d.float().repeat_interleave(per, 1) * self.sc.float()
        M = self.dmin.float().repeat_interleave(per, 1) * self.m.float()
        return S, M

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the blocks hold."""
        S, M = self.group_scales()
        q = self.quants().float().view(self.out_features, -1, GROUP)
        return (S[..., None] * q - M[..., None]).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        x_int8, x_scale = quantize_tokens(rows, GROUP)  # [M, K], [M, K/32]
        xq = x_int8.float().view(rows.shape[0], -1, GROUP)  # [M, K/32, 32]
        xsum = xq.sum(-1)  # [M, K/32], exact
        q = self.quants().float().view(self.out_features, -1, GROUP)  # [N, K/32, 32]
        S, M = self.group_scales()
        y = torch.zeros(rows.shape[0], self.out_features, device=rows.device)
        for g in range(S.shape[1]):  # in order, as the kernels' lanes
            dot = xq[:, g] @ q[:, g].t()  # [M, N]: integers below 2^24, exact in float32
            y = y + (dot * S[:, g] - M[:, g] * xsum[:, g : g + 1]) * x_scale[:, g : g + 1]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bits = ", bits=5" if self.bits == 5 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}{bits}"


class W6A8Linear(nn.Module):
    """Q6_K blocks (quasar.model.gguf_blocks.SixBitBlocks): q [N, K] uint8 in [0, 63], d [N, K/256] float16, sc [N, K/16]
    int8."""

    BLOCK = 256
    SUB = 16

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        if in_features % self.BLOCK:
            raise ValueError(f"Q6_K blocks of 256 inputs must divide K = {in_features}")
        self.in_features, self.out_features = in_features, out_features
        N, K = out_features, in_features
        self.register_buffer("qweight", torch.zeros(N, K, dtype=torch.uint8))
        self.register_buffer("d", torch.zeros(N, K // self.BLOCK, dtype=torch.float16))
        self.register_buffer("sc", torch.zeros(N, K // self.SUB, dtype=torch.int8))
        self.register_buffer("bias", torch.zeros(N) if bias else None)  # [N] float32

    @classmethod
    def from_blocks(cls, blocks, bias: torch.Tensor | None = None) -> W6A8Linear:
        N, K = blocks.q.shape
        with torch.device("meta"):  # every buffer is set below: no zeros of the weight's size first
            layer = cls(K, N, bias is not None)
        layer.qweight, layer.d, layer.sc = blocks.q.contiguous(), blocks.d.contiguous(), blocks.sc.contiguous()
        if bias is not None:
            layer.bias = bias.detach().float().clone()
        return layer

    def sub_scales(self) -> torch.Tensor:
        """S [N, K/16] float32: d * sc of each sub-block."""
        return self.d.float().repeat_interleave(self.BLOCK // self.SUB, 1) * self.sc.float()

    def dequantize(self) -> torch.Tensor:
        q = self.qweight.float().view(self.out_features, -1, self.SUB) - 32
        return (self.sub_scales()[..., None] * q).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        x_int8, x_scale = quantize_tokens(rows, GROUP)  # [M, K], [M, K/32]
        xq = x_int8.float().view(rows.shape[0], -1, self.SUB)  # [M, K/16, 16]
        xsum = xq.sum(-1)  # [M, K/16], exact
        q = self.qweight.float().view(self.out_features, -1, self.SUB)  # [N, K/16, 16]
        S = self.sub_scales()
        y = torch.zeros(rows.shape[0], self.out_features, device=rows.device)
        for g in range(x_scale.shape[1]):  # in order, as the kernels' lanes
            a, b = 2 * g, 2 * g + 1
            dot_a = xq[:, a] @ q[:, a].t() - 32 * xsum[:, a : a + 1]  # [M, N]: exact integers
            dot_b = xq[:, b] @ q[:, b].t() - 32 * xsum[:, b : b + 1]
            y = y + (dot_a * S[:, a] + dot_b * S[:, b]) * x_scale[:, g : g + 1]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q6_K"
