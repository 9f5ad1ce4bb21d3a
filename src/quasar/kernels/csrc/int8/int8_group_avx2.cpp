// Group-wise W8A8 on AVX2 (int8_group.h has the arithmetic and the entry points): "maddubs", and "dpbusd-emulated",
// the dpbusd path's loop with vpdpbusd emulated exactly on 256-bit registers.
#include "int8_group.h"
#include "blocking.h"

#include <immintrin.h>

using namespace int8_group;

namespace {

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

}  // namespace

void int8_group_maddubs(const int8_t* q, const float* x_scale, const int8_t* w, const float* w_scale, float* out,
                        int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  const auto* qb = reinterpret_cast<const uint8_t*>(q);
  tiles<Maddubs256::kRows>(M, n0, n1, [&](auto rows, int64_t m, int64_t a, int64_t b) {
    maddubs::group_block<decltype(rows)::value>(qb, x_scale, w, w_scale, out, m, N, K, G, a, b);
  });
}

void int8_group_dpbusd_emulated(const uint8_t* u, const float* x_scale, const int8_t* w, const float* w_scale,
                                float* out, int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  tiles<Emulated256Base::kRows>(M, n0, n1, [&](auto rows, int64_t m, int64_t a, int64_t b) {
    emulated::group_block<decltype(rows)::value>(u, x_scale, w, w_scale, out, m, N, K, G, a, b);
  });
}
