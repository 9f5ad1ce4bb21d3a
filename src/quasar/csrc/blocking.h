// Loop helpers shared by the linear kernels (linear_avx2.cpp, int8_dot.cpp).
#pragma once
#include <cstdint>
#include <type_traits>

// Weights stream from memory once per call; hardware prefetch alone left the int8 loops at about half the
// read bandwidth, so each loop also asks for the bytes this far ahead.
constexpr int64_t kPrefetch = 1024;

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
