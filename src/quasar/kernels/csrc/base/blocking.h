// Loop helpers shared by the linear kernels (w8a8_linear.cpp, norm_quant.cpp, the int8, float and block kernels of
// every instruction set).
#pragma once
#include "runtime.h"
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>

// Weights stream from memory once per call; hardware prefetch alone left the int8 loops at about half the
// read bandwidth, so each loop also asks for the bytes this far ahead.
constexpr int64_t kPrefetch = 1024;

// Where the int8 panel loops (int8_panel_avx2.cpp, int8_panel_avx512.cpp) and dpbusd_block.h prefetch their weights: into L1
// kPrefetch bytes ahead (tuned on Intel Xeons), or into L2 kPrefetchL2 bytes ahead. On AMD EPYC the L2 policy
// streams faster (T0 prefetches hold the few L1 miss buffers that the loads need), except one row on the maddubs
// panels, where L1 does; docs/kernels.md has the figures. prefetch_policy(rows, maddubs) (cpu.cpp) picks
// by vendor, path and rows until use_prefetch() fixes one; every policy gives the same results.
enum class Prefetch { L1, L2 };
constexpr int64_t kPrefetchL2 = 4096;

template <Prefetch P>
inline void prefetch_weights(const void* p) {
  if constexpr (P == Prefetch::L1) _mm_prefetch(static_cast<const char*>(p) + kPrefetch, _MM_HINT_T0);
  else _mm_prefetch(static_cast<const char*>(p) + kPrefetchL2, _MM_HINT_T1);
}

// f(std::integral_constant<Prefetch, P>{}) for the policy p: one compiled loop per policy.
template <typename F>
decltype(auto) with_prefetch(Prefetch p, F f) {
  if (p == Prefetch::L2) return f(std::integral_constant<Prefetch, Prefetch::L2>{});
  return f(std::integral_constant<Prefetch, Prefetch::L1>{});
}

// Rows [0, M) in blocks of MAX rows and one last block of the rest: block(rows, m0) is called with rows a
// std::integral_constant, so each block size gets its own unrolled kernel.
template <int R, typename F>
void last_block(int64_t rest, int64_t m0, F& block) {
  if constexpr (R > 0) {
    if (rest == R) block(std::integral_constant<int, R>{}, m0);
    else last_block<R - 1>(rest, m0, block);
  }
}

template <int MAX, typename F>
void row_blocks(int64_t M, F block) {
  int64_t m = 0;
  for (; m + MAX <= M; m += MAX) block(std::integral_constant<int, MAX>{}, m);
  last_block<MAX - 1>(M - m, m, block);
}

// Weights packed in panels of 16 channels: panels per block, and bytes of one panel per chunk of K. A block's
// outputs stay in cache while K passes in chunks, and a chunk of the block's weights (16 panels x 32 KB: 1,024
// bf16, 512 fp32 or 2,048 int8 inputs) in L2 while every row passes (the fastest of the chunk sizes measured).
constexpr int64_t kPanelBlock = 16, kChunkBytes = 32 * 1024;

// Rows [0, M) times panels [p0, p1) of 16 channels, K in chunks: tile(rows, panels, m, p, k0, k1), rows and
// panels std::integral_constant. k_bytes: one input of one panel (32 bf16, 64 fp32, 16 int8); chunks are whole
// steps of `step` inputs (a bf16 pair, an int8 scale group).
template <int RMAX, int CMAX, typename F>
void panel_tiles(int64_t M, int64_t p0, int64_t p1, int64_t K, int64_t k_bytes, int64_t step, F tile) {
  const int64_t chunk = std::max(step, kChunkBytes / k_bytes / step * step);
  for (int64_t b = p0; b < p1; b += kPanelBlock) {
    const int64_t b1 = std::min(b + kPanelBlock, p1);
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
      const int64_t k1 = std::min(K, k0 + chunk);
      row_blocks<RMAX>(M, [&](auto rows, int64_t m) {
        row_blocks<CMAX>(b1 - b, [&](auto panels, int64_t c) { tile(rows, panels, m, b + c, k0, k1); });
      });
    }
  }
}

// fn(m0, m1) over the rows [0, M) of a [M, K] float32 or int8 array, split between the threads where there
// are rows enough to pay for it (a decode row runs on the calling thread). Every row is computed alone, so
// the split changes no result; it keeps the other threads from waiting while one quantizes or normalizes
// a busy batch's rows.
template <typename F>
void over_rows(int64_t M, int64_t K, const F& fn) {
  constexpr int64_t kRowsWork = 8192;  // values per thread at least
  parallel_for(0, M, std::max<int64_t>(1, kRowsWork / std::max<int64_t>(K, 1)), fn);
}
