// Group-wise W8A8 dot products: int8 weights with one scale per output channel and group of G inputs,
// int8 activations with one scale per row and group (Q8_0-style scales, on every int8 path):
//
//   y[m, n] = sum_g (x_scale[m, g] * w_scale[n, g]) * sum_{k in g} q[m, k] * w[n, k]
//
// Each group's int8 dot product is exact in int32 lanes (int8_dot.cpp explains the two instruction sets:
// "maddubs" reads q, the dpbusd paths read u = q + 128 and start a group's lanes at -128 * sum w), then
// converted to float and scaled once per group. Register widths: 512 bits on AVX-512 VNNI where G is a
// multiple of 64, else 256 bits (VNNI's ymm form, AVX2's maddubs, or the emulated vpdpbusd).
#include "int8_dot.h"
#include "blocking.h"
#include "vnni.h"
#include "targets.h"
#include "simd_lanes.h"

#include <immintrin.h>
#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kGroupPrefetch = 4096;

struct Float256 {
  using reg = __m256;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(reg v) { return hsum8(v); }
};

// AVX2: |w| times q carrying w's sign, pairs summed by madd (needs |q| <= 127).
struct Maddubs256 {
  using reg = __m256i;
  struct W {
    __m256i v, a;
  };
  static constexpr int64_t kBytes = 32;
  static constexpr int kRows = 4;
  static W wload(const int8_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {v, _mm256_abs_epi8(v)};
  }
  static reg group_start(const int8_t*, int64_t) { return _mm256_setzero_si256(); }
  static reg dot(reg acc, const W& w, const uint8_t* x) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i p = _mm256_maddubs_epi16(w.a, _mm256_sign_epi8(xv, w.v));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
};

// vpdpbusd emulated exactly in AVX2 (see int8_dot.cpp): the VNNI arithmetic, testable without VNNI.
struct Emulated256Base {
  using reg = __m256i;
  static constexpr int64_t kBytes = 32;
  static constexpr int kRows = 4;
  static reg zero() { return _mm256_setzero_si256(); }
  static reg c128() { return _mm256_set1_epi8(static_cast<char>(0x80)); }
  static reg load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static reg sub(reg a, reg b) { return _mm256_sub_epi32(a, b); }
  static reg dpbusd(reg acc, reg a, reg b) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i lo = _mm256_madd_epi16(_mm256_unpacklo_epi8(a, z), _mm256_srai_epi16(_mm256_unpacklo_epi8(b, b), 8));
    const __m256i hi = _mm256_madd_epi16(_mm256_unpackhi_epi8(a, z), _mm256_srai_epi16(_mm256_unpackhi_epi8(b, b), 8));
    return _mm256_add_epi32(acc, _mm256_hadd_epi32(lo, hi));
  }
};

namespace maddubs {
using V = Maddubs256;
using F = Float256;
#include "group_block.h"
}  // namespace maddubs

namespace emulated {
#include "dpbusd_path.h"
using V = DpbusdPath<Emulated256Base>;
using F = Float256;
#include "group_block.h"
}  // namespace emulated

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

// Channels [n0, n1) in tiles small enough to stay in L2 while every row block reads them.
constexpr int64_t kTile = 8;

template <int MAX, typename Block>
void tiles(int64_t M, int64_t n0, int64_t n1, Block block) {
  for (int64_t t = n0; t < n1; t += kTile) {
    const int64_t t1 = std::min(t + kTile, n1);
    row_blocks<MAX>(M, [&](auto rows, int64_t m) { block(rows, m, t, t1); });
  }
}

}  // namespace

void int8_group_dot(Int8Path path, const int8_t* q, const uint8_t* u, const float* x_scale, const int8_t* w,
                    const float* w_scale, float* out, int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0,
                    int64_t n1) {
  const auto* qb = reinterpret_cast<const uint8_t*>(q);
  switch (path) {
    case Int8Path::Maddubs:
      return tiles<Maddubs256::kRows>(M, n0, n1, [&](auto rows, int64_t m, int64_t a, int64_t b) {
        maddubs::group_block<decltype(rows)::value>(qb, x_scale, w, w_scale, out, m, N, K, G, a, b);
      });
    case Int8Path::DpbusdEmulated:
      return tiles<Emulated256Base::kRows>(M, n0, n1, [&](auto rows, int64_t m, int64_t a, int64_t b) {
        emulated::group_block<decltype(rows)::value>(u, x_scale, w, w_scale, out, m, N, K, G, a, b);
      });
    case Int8Path::Dpbusd:
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
}
