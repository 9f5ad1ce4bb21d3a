// W4A8: 4- and 5-bit weights with scales and mins as GGUF's Q4_0, Q4_1, Q4_K and Q5_K blocks hold them, times dynamic
// int8 activations (one scale per 32 inputs), with the weights packed in panels of 16 output channels:
//
//   w[n, k] = S[n, g] * q[n, k] - M[n, g]      q in [0, 15] (Q5_K: [0, 31]), g = k / 32 (a group)
//   S[n, g] = d[n, b] * sc[n, g],  M[n, g] = dmin[n, b] * m[n, g]      b = k / B (a block of B = 32 or 256 inputs)
//   y[m, n] = sum_g ((float(sum_{k in g} q[n, k] x[m, k]) * S[n, g] - M[n, g] * float(xsum[m, g])) * x_scale[m, g])
//
// d and dmin are float16, sc and m bytes: Q4_K's and Q5_K's super-blocks as they are (B = 256, 6-bit sc and m), and Q4_0 /
// Q4_1 with B = 32, sc = m = 1 and dmin = 8 d (Q4_0) or -min (Q4_1). S and M are exact products (11 x 8 bits), so
// the weights are exactly the file's. xsum[m, g] is the sum of the row's int8 inputs over the group; the group's
// dot product is exact in int32; then five float operations per group (no fused multiply-add, so a float32
// reference gives the same floats), each lane taking its own channel's groups in order: a row's result never
// depends on the other rows, the tile shape, the chunking of K or the instruction set.
//
//   wp [N/16][K/32][256] uint8: per group, 4 chunks of 8 inputs, each 16 channels x 4 bytes, byte j of channel c
//                               holding inputs 8t + j (low nibble) and 8t + 4 + j (high nibble); 5-bit quants
//                               ([N/16][K/32][320]) add 16 channels x 4 bytes of their fifth bits, byte j of channel
//                               c holding that of input 8t + 4h + j in bit 2t + h
//   sp [N/16][K/B][64 + B] uint8:    per block, d[16] and dmin[16] as float16, then per group sc[16] and m[16];
//                                    [N/16][K/32][64] (unit) where B = 32 and every sc and m is 1: d and dmin alone
//
// The instruction sets' loops: w4a8_avx2.cpp (maddubs) and w4a8_avx512.cpp (dpbusd); block_linear.cpp picks one.
#pragma once
#include "block_panels.h"

#include <cstdint>

namespace w4a8 {

constexpr int64_t kGroup = 32, kBlockHead = 64, kFifthBits = 256;

// The bytes of one group of a panel: 4-bit or 5-bit quants.
template <bool Five>
constexpr int64_t kGroupBytes = Five ? 320 : 256;

}  // namespace w4a8

// Panels [p0, p1) of the call on one instruction set; five: 5-bit quants (Q5_0, Q5_1, Q5_K).
void w4a8_maddubs_panels(bool five, const BlockCall& call, int64_t p0, int64_t p1);
void w4a8_dpbusd_panels(bool five, const BlockCall& call, int64_t p0, int64_t p1);
