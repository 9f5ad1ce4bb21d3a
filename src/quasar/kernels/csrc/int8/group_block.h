// The group-wise W8A8 loop, included once per instruction set by int8_group_avx2.cpp and int8_group_avx512.cpp
// (like dpbusd_block.h): the includer defines V, the path's traits (kBytes, kRows, W, wload, group_start, dot) and
// F, the float traits of the same register width (zero, cvt, set1, mul, fmadd, sum). No include guard, on purpose.

// out[m, n] = sum_g (x_scale[m, g] * w_scale[n, g]) * (q[m, gG:(g+1)G] . w[n, gG:(g+1)G]) for rows
// m0 .. m0 + MB and channels [n0, n1). The dot of a group is exact in int32 lanes; each lane of a row's
// float accumulator takes one fused multiply-add per group, and the lanes are summed in a fixed order at
// the end, so a row's result never depends on the other rows (or on MB).
template <int MB>
void group_block(const uint8_t* x, const float* x_scale, const int8_t* w, const float* w_scale, float* out,
                 int64_t m0, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    const float* sn = w_scale + n * groups;
    typename F::reg facc[MB];
    for (int i = 0; i < MB; ++i) facc[i] = F::zero();
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* wg = wn + g * G;
      _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetch), _MM_HINT_T0);
      const typename V::reg start = V::group_start(wg, G);
      typename V::reg acc[MB];
      for (int i = 0; i < MB; ++i) acc[i] = start;
      for (int64_t c = 0; c < G; c += V::kBytes) {
        const typename V::W wc = V::wload(wg + c);
        for (int i = 0; i < MB; ++i) acc[i] = V::dot(acc[i], wc, x + (m0 + i) * K + g * G + c);
      }
      const typename F::reg ws = F::set1(sn[g]);
      for (int i = 0; i < MB; ++i)
        facc[i] = F::fmadd(F::cvt(acc[i]), F::mul(ws, F::set1(x_scale[(m0 + i) * groups + g])), facc[i]);
    }
    for (int i = 0; i < MB; ++i) out[(m0 + i) * N + n] = F::sum(facc[i]);
  }
}
