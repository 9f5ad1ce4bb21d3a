// The packed-panel tile of float_dot_avx512.cpp, included inside each AVX-512 target region so that the template is
// compiled for that instruction set (see dpbusd_path.h). The includer defines P: the input and weight element
// types X and T, the weights' register type W, the inputs one step takes (kStep), weights(panel) -> W,
// input(x) -> the row's inputs broadcast, and madd(acc, inputs, weights). No include guard and no includes of
// its own, on purpose.

// Rows m0.. (R <= 6) times panels p0.. (C <= 4) of 16 channels over inputs [k0, k1): 24 accumulators and 4
// weight registers of the 32; the partial sums come from y after the first chunk of K.
template <int R, int C, typename X, typename T>
void panel_tile(const X* x, const T* wp, float* y, int64_t m0, int64_t p0, int64_t N, int64_t K, int64_t k0,
                int64_t k1) {
  __m512 acc[R][C];
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = k0 ? _mm512_loadu_ps(y + (m0 + r) * N + 16 * (p0 + c)) : _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += P::kStep) {
    typename P::W wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const T* panel = wp + (p0 + c) * K * 16 + k * 16;
      prefetch_row(panel);
      wv[c] = P::weights(panel);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const auto xv = P::input(x + (m0 + r) * K + k);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = P::madd(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + (m0 + r) * N + 16 * (p0 + c), acc[r][c]);
}

// Rows [0, M) times panels [p0, p1).
template <typename X, typename T>
void panel_dot(const X* x, const T* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
  panel_tiles<6, 4>(M, p0, p1, K, 16 * sizeof(T), 2, [&](auto rows, auto panels, int64_t m, int64_t p, int64_t k0, int64_t k1) {
    panel_tile<decltype(rows)::value, decltype(panels)::value>(x, wp, y, m, p, N, K, k0, k1);
  });
}
