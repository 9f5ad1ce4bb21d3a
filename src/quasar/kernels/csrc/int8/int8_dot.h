// The int8 dot-product kernels, as w8a8_linear.cpp and bindings.cpp see them, and the instruction sets' loops behind
// them. The exact int8 dot products behind every W8A8 linear (int8_dot.cpp): rows of quantized activations q [M, K]
// times output channels [n0, n1) of an int8 weight w [N, K], int32 sums. Two instruction sets:
//
// - "maddubs" (AVX2, every x86 CPU this package builds for): _mm256_maddubs_epi16(|w|, sign(x, w)) then
//   _mm256_madd_epi16 by ones, 32 products per instruction pair. Needs |x| <= 127 (pair sums of at most
//   2 * 128 * 127 < 2^15 never saturate); int8_mm handles x = -128 with a second pass.
// - "dpbusd" (AVX-512 VNNI: Cascade Lake and newer Xeons, Zen 4 and newer): one vpdpbusd multiplies 64
//   unsigned bytes by 64 signed bytes and adds each group of 4 products to an int32 lane, without
//   saturation. The activations go in as u = x + 128 (x ^ 0x80, every int8 value), so
//   sum_k x[k] w[k] = sum_k u[k] w[k] - 128 * sum_k w[k], the weight sums taken in the same pass.
//   "dpbusd-emulated" runs the same code with 256-bit registers and vpdpbusd emulated exactly in AVX2:
//   slower than maddubs, it exists so that the VNNI path's arithmetic is tested on machines without VNNI.
//
// All integer arithmetic of these paths is exact, so every path gives the same int32 results bit for bit, and a
// row never depends on the other rows. The loops: int8_dot_avx2.cpp (maddubs, dpbusd-emulated) and
// int8_dot_avx512.cpp (dpbusd); int8_dot.cpp picks one.
#pragma once
#include "blocking.h"
#include "cpu.h"

#include <cstdint>
#include <string>
#include <vector>

// What a path needs besides q [count bytes]: the dpbusd paths read u = q + 128 as uint8.
void prepare_rows(Int8Path path, const int8_t* q, int64_t count, std::vector<uint8_t>& u);
// acc [M, N] int32, channels [n0, n1) = q [M, K] . w [N, K]^T, exactly; q in [-127, 127] for "maddubs".
void int8_dot(Int8Path path, const int8_t* q, const uint8_t* u, const int8_t* w, int32_t* acc, int64_t M, int64_t N,
              int64_t K, int64_t n0, int64_t n1);
// int8_dot on one instruction set, rows in blocks of at most 8: maddubs reads q, the dpbusd loops read u and
// prefetch the weights as `prefetch` says.
void int8_dot_maddubs(const int8_t* q, const int8_t* w, int32_t* acc, int64_t M, int64_t N, int64_t K, int64_t n0,
                      int64_t n1);
void int8_dot_dpbusd_emulated(Prefetch prefetch, const uint8_t* u, const int8_t* w, int32_t* acc, int64_t M, int64_t N,
                              int64_t K, int64_t n0, int64_t n1);
void int8_dot_dpbusd(Prefetch prefetch, const uint8_t* u, const int8_t* w, int32_t* acc, int64_t M, int64_t N,
                     int64_t K, int64_t n0, int64_t n1);
// out [M, N] float32, channels [n0, n1) = sum over groups g of G inputs of x_scale [M, K/G] * w_scale [N, K/G]
// times the exact int32 dot of the group (int8_group.cpp); G a multiple of 32 dividing K, |q| <= 127.
// The same on AVX-512 VNNI with weights packed in panels of 16 channels (int8_panel_avx512.cpp): wp [N/16][K/4][16][4]
// uint8 = w + 128, wsp [N/16][K/G][16], start [M, K/G] = group_starts(q); the panels that start in [n0, n1).
void int8_panel_dot(const int8_t* q, const int32_t* start, const float* x_scale, const uint8_t* wp, const float* wsp,
                    float* out, int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1);
// The same panels on AVX2 with the weights as signed bytes (int8_panel_avx2.cpp): wp [N/16][K/4][16][4] int8 = w,
// |q| <= 127; the same floats as int8_panel_dot.
void int8_panel_dot_maddubs(const int8_t* q, const float* x_scale, const int8_t* wp, const float* wsp, float* out,
                            int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1);
// The panels of a packed W8A8 linear that start in [n0, n1) into out [M, N]: int8_panel_dot for uint8 w + 128
// (unsigned_bytes), int8_panel_dot_maddubs for int8 w, then bias [N] (or nullptr) added on those panels' channels
// (w8a8_linear.cpp; the W8A8 linears and packed_w8a8_step.cpp).
void packed_panel_range(const void* wp, bool unsigned_bytes, const float* wsp, const float* bias, const int8_t* q,
                        const int32_t* start, const float* x_scale, float* out, int64_t M, int64_t N, int64_t K,
                        int64_t G, int64_t n0, int64_t n1);
// start [M, K/G] = -128 * the sum of q [M, K] over each group of G inputs.
void group_starts(const int8_t* q, int64_t M, int64_t K, int64_t G, int32_t* start);
void int8_group_dot(Int8Path path, const int8_t* q, const uint8_t* u, const float* x_scale, const int8_t* w,
                    const float* w_scale, float* out, int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0,
                    int64_t n1);
