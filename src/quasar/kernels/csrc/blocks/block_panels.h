// The panel kernels of GGUF's quantized blocks (w4a8_layout.h: Q4_0, Q4_1, Q4_K, Q5_K; w6a8_layout.h: Q6_K), as
// block_linear.cpp sees them: plain pointers and sizes, no torch types.
#pragma once
#include "cpu.h"

#include <cstdint>
#include <cstring>

// A row's 4 int8 inputs at x as one int32, for a broadcast.
inline int32_t four_inputs(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, sizeof four);
  return four;
}

// One product of int8 inputs x [M, K] (one scale per 32 inputs: x_scale [M, K/32]; their sums per 32 and per 16
// inputs: xsum [M, K/32], xsum16 [M, K/16]) with a weight's panels wp and block scales sp (the kernel files have
// their layouts), into y [M, N]. B: the inputs of one block of scales; unit: 4- and 5-bit blocks of 32 whose sc and m
// are all 1 (Q4_0, Q4_1, Q5_0, Q5_1), packed with d and dmin alone.
struct BlockCall {
  const int8_t* x;
  const int32_t* xsum;
  const int32_t* xsum16;
  const float* x_scale;
  const uint8_t* wp;
  const uint8_t* sp;
  int64_t B;
  bool unit;
  float* y;
  int64_t M, N, K;
};

// xsum [M, K/G] = the sum of x [M, K] over each group of G inputs.
void group_sums(const int8_t* x, int64_t M, int64_t K, int64_t G, int32_t* xsum);
// Panels [p0, p1) of the call (channels 16 p0 .. 16 p1) on `path`: dpbusd on AVX-512 VNNI, the AVX2 maddubs loop on the
// others (the same floats on both). 4-bit and 5-bit blocks with scales and mins (w4a8_layout.h) and Q6_K's 6-bit ones
// (w6a8_layout.h); block_linear.cpp dispatches by path.
void w4a8_panels(Int8Path path, const BlockCall& call, int64_t p0, int64_t p1);
void w5a8_panels(Int8Path path, const BlockCall& call, int64_t p0, int64_t p1);
void w6a8_panels(Int8Path path, const BlockCall& call, int64_t p0, int64_t p1);
