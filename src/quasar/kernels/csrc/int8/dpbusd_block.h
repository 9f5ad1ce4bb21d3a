// The dpbusd kernel's loop, included twice: by int8_dot_avx2.cpp for AVX2 (Emulated256) and by int8_dot_avx512.cpp
// inside a `#pragma GCC target` region for AVX-512 (Vnni512), so each copy is compiled for its own instruction set
// (GCC gives one template one target for all its instantiations). The includer defines V, the register
// type's traits (kBytes, zero, ones, load, load_tail, dpbusd, sum). No include guard and no includes of
// its own, on purpose.

// Rows m0 .. m0 + MB of u = q + 128 (uint8) times channels [n0, n1), as sum u w - 128 sum w.
// Zero-padded tail bytes are zero weights: they add nothing to either sum.
template <int MB, Prefetch P>
void dpbusd_block(const uint8_t* u, const int8_t* w, int32_t* acc_out, int64_t m0, int64_t N, int64_t K, int64_t n0,
                  int64_t n1) {
  using reg = typename V::reg;
  const reg ones = V::ones();
  const int64_t full = K / V::kBytes * V::kBytes;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    reg acc[MB], wsum = V::zero();
    for (int i = 0; i < MB; ++i) acc[i] = V::zero();
    for (int64_t k = 0; k < full; k += V::kBytes) {
      prefetch_weights<P>(wn + k);
      const reg wv = V::load(wn + k);
      wsum = V::dpbusd(wsum, ones, wv);
      for (int i = 0; i < MB; ++i) acc[i] = V::dpbusd(acc[i], V::load(u + (m0 + i) * K + k), wv);
    }
    if (full < K) {
      const reg wv = V::load_tail(wn + full, K - full);
      wsum = V::dpbusd(wsum, ones, wv);
      for (int i = 0; i < MB; ++i) acc[i] = V::dpbusd(acc[i], V::load_tail(u + (m0 + i) * K + full, K - full), wv);
    }
    const int32_t offset = 128 * V::sum(wsum);
    for (int i = 0; i < MB; ++i) acc_out[(m0 + i) * N + n] = V::sum(acc[i]) - offset;
  }
}

