// Group-wise W8A8 on AVX-512 VNNI (int8_group.h has the arithmetic and the entry points): the "dpbusd" path,
// on 512-bit registers where G is a multiple of 64 (two groups a register where G = 32), else VNNI's ymm form.
#include "int8_group.h"
#include "blocking.h"
#include "vnni.h"
#include "targets.h"
#include "simd_lanes.h"

#include <immintrin.h>
#include <vector>

using namespace int8_group;

namespace {

constexpr int64_t kGroupPrefetch = 4096;

QUASAR_TARGET_PUSH(QUASAR_AVX512_VNNI)
namespace vnni {

// The emulated base with the real instruction (AVX2 helpers inline into AVX-512 code; not the reverse), and
// twice the rows: AVX-512 has 32 registers.
struct Vnni256Base : Emulated256Base {
  static constexpr int kRows = 8;
  static reg dpbusd(reg acc, reg a, reg b) { return _mm256_dpbusd_epi32(acc, a, b); }
};

struct Vnni512Base {
  using reg = __m512i;
  static constexpr int64_t kBytes = 64;
  static constexpr int kRows = 8;
  static reg zero() { return _mm512_setzero_si512(); }
  static reg c128() { return _mm512_set1_epi8(static_cast<char>(0x80)); }
  static reg load(const void* p) { return _mm512_loadu_si512(p); }
  static reg sub(reg a, reg b) { return _mm512_sub_epi32(a, b); }
  static reg dpbusd(reg acc, reg a, reg b) { return dpbusd512(acc, a, b); }
};

struct Float512 {
  using reg = __m512;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg cvt(__m512i v) { return _mm512_cvtepi32_ps(v); }
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(reg v) { return hsum16(v); }
};

#include "dpbusd_path.h"

namespace wide {
using V = DpbusdPath<Vnni512Base>;
using F = Float512;
#include "group_block.h"
}  // namespace wide

namespace narrow {
using V = DpbusdPath<Vnni256Base>;
using F = Float256;
#include "group_block.h"
}  // namespace narrow

// G = 32 on 512-bit registers: one register holds two groups (lanes 0-7 and 8-15), so a row costs one
// vpdpbusd, one conversion and one fused multiply-add per 64 inputs, as with G = 64. The row scales come
// expanded to one float per lane (x_scale2 [M, K / 4]: x_scale[m, 2p] in lanes 0-7 of pair p, x_scale[m,
// 2p + 1] in lanes 8-15); the weight scales of a pair are spread the same way once per channel and pair.
template <int MB>
void pair_block(const uint8_t* x, const float* x_scale2, const int8_t* w, const float* w_scale, float* out,
                int64_t m0, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  using V = DpbusdPath<Vnni512Base>;
  const int64_t groups = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    const float* sn = w_scale + n * groups;
    __m512 even[MB], odd[MB];  // alternate pairs in two accumulators: half the fmadd chain's latency
    for (int i = 0; i < MB; ++i) even[i] = odd[i] = _mm512_setzero_ps();
    const auto pair = [&](int64_t c, __m512* facc) {
      _mm_prefetch(reinterpret_cast<const char*>(wn + c + kGroupPrefetch), _MM_HINT_T0);
      const __m512i start = V::group_start(wn + c, 64), wc = V::wload(wn + c);
      const __m512 ws = _mm512_insertf32x8(_mm512_set1_ps(sn[c / 32]), _mm256_set1_ps(sn[c / 32 + 1]), 1);
      for (int i = 0; i < MB; ++i) {
        const __m512i acc = V::dot(start, wc, x + (m0 + i) * K + c);
        const __m512 xs = _mm512_loadu_ps(x_scale2 + (m0 + i) * (K / 4) + c / 4);
        facc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(ws, xs), facc[i]);
      }
    };
    int64_t c = 0;
    for (; c + 128 <= K; c += 128) {
      pair(c, even);
      pair(c + 64, odd);
    }
    if (c < K) pair(c, even);
    for (int i = 0; i < MB; ++i) out[(m0 + i) * N + n] = Float512::sum(_mm512_add_ps(even[i], odd[i]));
  }
}

}  // namespace vnni
QUASAR_TARGET_POP

}  // namespace

void int8_group_dpbusd(const uint8_t* u, const float* x_scale, const int8_t* w, const float* w_scale, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  if (G == 32 && K % 64 == 0) {
    std::vector<float> x_scale2(M * K / 4);  // each row scale once per lane of its group
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < K / 4; ++j) x_scale2[m * (K / 4) + j] = x_scale[m * (K / 32) + j / 8];
    return tiles<vnni::Vnni512Base::kRows>(M, n0, n1, [&](auto rows, int64_t m, int64_t a, int64_t b) {
      vnni::pair_block<decltype(rows)::value>(u, x_scale2.data(), w, w_scale, out, m, N, K, a, b);
    });
  }
  if (G % 64 == 0)
    return tiles<vnni::Vnni512Base::kRows>(M, n0, n1, [&](auto rows, int64_t m, int64_t a, int64_t b) {
      vnni::wide::group_block<decltype(rows)::value>(u, x_scale, w, w_scale, out, m, N, K, G, a, b);
    });
  return tiles<vnni::Vnni256Base::kRows>(M, n0, n1, [&](auto rows, int64_t m, int64_t a, int64_t b) {
    vnni::narrow::group_block<decltype(rows)::value>(u, x_scale, w, w_scale, out, m, N, K, G, a, b);
  });
}
