// W6A8: Q6_K's 6-bit weights as the GGUF file holds them, times dynamic int8 activations (one scale per 32 inputs),
// with the weights packed in panels of 16 output channels:
//
//   w[n, k] = S[n, s] * (q[n, k] - 32)    q in [0, 63], s = k / 16 (a sub-block), S[n, s] = d[n, k / 256] * sc[n, s]
//   y[m, n] = sum_g (float(D[a]) * S[n, a] + float(D[b]) * S[n, b]) * x_scale[m, g]
//             D[s] = sum_{k in s} q[n, k] x[m, k] - 32 * xsum16[m, s]     a, b: group g's two sub-blocks
//
// d is float16, sc a signed byte (S is exact: 11 x 8 bits), so the weights are exactly the file's; D is exact in
// int32; then four float operations per group and one to accumulate (no fused multiply-add), each lane taking its
// own channel's groups in order, as w4a8_layout.h's.
//
//   wp [N/16][K/32][384] uint8: per group, the low 4 bits of q as w4a8_layout.h packs its quants (4 chunks of 8
//        inputs, 16 channels x 4 bytes), then the high 2 bits in two 64-byte vectors, one per sub-block u: byte j of
//        channel c holds those of inputs 16u + j, 16u + 4 + j, 16u + 8 + j and 16u + 12 + j, two bits each from bit 0
//
// The instruction sets' loops: w6a8_avx2.cpp (maddubs) and w6a8_avx512.cpp (dpbusd); block_linear.cpp picks one.
#pragma once
#include "block_panels.h"

#include <cstdint>

namespace w6a8 {

constexpr int64_t kGroup = 32, kGroupBytes = 384, kHighBits = 256, kBlock = 256, kBlockBytes = 32 + 256;

}  // namespace w6a8

// Panels [p0, p1) of the call on one instruction set.
void w6a8_maddubs_panels(const BlockCall& call, int64_t p0, int64_t p1);
void w6a8_dpbusd_panels(const BlockCall& call, int64_t p0, int64_t p1);
