// The exact int8 dot products on AVX2 (int8_dot.h has the arithmetic and the entry points): the "maddubs" path,
// and "dpbusd-emulated", the dpbusd path's loop (dpbusd_block.h) with vpdpbusd emulated exactly on 256-bit registers.
#include "int8_dot.h"
#include "blocking.h"
#include "simd_lanes.h"

#include <immintrin.h>
#include <cstring>

namespace {

// ---- maddubs ---------------------------------------------------------------------------------------------------

inline __m256i dot32(__m256i abs_w, __m256i w, __m256i x, __m256i ones) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x, w)), ones);
}

// Rows m0 .. m0 + MB of q times channels [n0, n1): one weight load serves all MB rows. K is a multiple
// of 16; a last half step of 16 runs on 128-bit registers.
template <int MB>
void maddubs_block(const int8_t* q, const int8_t* w, int32_t* acc_out, int64_t m0, int64_t N, int64_t K, int64_t n0,
                   int64_t n1) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t K32 = K / 32 * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    __m256i acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K32; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(wn + k + kPrefetch), _MM_HINT_T0);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + k)), aw = _mm256_abs_epi8(wv);
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (m0 + i) * K + k));
        acc[i] = _mm256_add_epi32(acc[i], dot32(aw, wv, xv, ones));
      }
    }
    if (K32 < K) {
      const __m128i wv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + K32)), aw = _mm_abs_epi8(wv);
      for (int i = 0; i < MB; ++i) {
        const __m128i xv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (m0 + i) * K + K32));
        const __m128i p = _mm_madd_epi16(_mm_maddubs_epi16(aw, _mm_sign_epi8(xv, wv)), _mm256_castsi256_si128(ones));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_inserti128_si256(_mm256_setzero_si256(), p, 0));
      }
    }
    for (int i = 0; i < MB; ++i) acc_out[(m0 + i) * N + n] = hsum8_epi32(acc[i]);
  }
}

// ---- dpbusd, emulated (int8_dot_avx512.cpp runs the instruction itself) ----------------------------------------

// vpdpbusd on 256-bit registers in plain AVX2: acc[j] += sum_{i<4} uint8(a[4j+i]) * int8(b[4j+i]).
// Bytes widen to int16 (a zero-extended, b sign-extended, in the same order), madd sums pairs into int32
// (at most 2 * 255 * 128, exact), hadd sums adjacent pairs: per 128-bit lane, [lo0+lo1, lo2+lo3, hi0+hi1,
// hi2+hi3] is exactly the four groups of four bytes.
struct Emulated256 {
  using reg = __m256i;
  static constexpr int64_t kBytes = 32;
  static reg zero() { return _mm256_setzero_si256(); }
  static reg ones() { return _mm256_set1_epi8(1); }
  static reg load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static reg load_tail(const void* p, int64_t count) {  // count < 32 bytes, zero-padded
    alignas(32) uint8_t buf[32] = {};
    std::memcpy(buf, p, count);
    return load(buf);
  }
  static reg dpbusd(reg acc, reg a, reg b) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i lo = _mm256_madd_epi16(_mm256_unpacklo_epi8(a, z), _mm256_srai_epi16(_mm256_unpacklo_epi8(b, b), 8));
    const __m256i hi = _mm256_madd_epi16(_mm256_unpackhi_epi8(a, z), _mm256_srai_epi16(_mm256_unpackhi_epi8(b, b), 8));
    return _mm256_add_epi32(acc, _mm256_hadd_epi32(lo, hi));
  }
  static int32_t sum(reg v) { return hsum8_epi32(v); }
};

namespace emulated {
using V = Emulated256;
#include "dpbusd_block.h"
}  // namespace emulated

}  // namespace

void int8_dot_maddubs(const int8_t* q, const int8_t* w, int32_t* acc, int64_t M, int64_t N, int64_t K, int64_t n0,
                      int64_t n1) {
  row_blocks<8>(M, [&](auto rows, int64_t m) {
    constexpr int MB = decltype(rows)::value;
    maddubs_block<MB>(q, w, acc, m, N, K, n0, n1);
  });
}

void int8_dot_dpbusd_emulated(Prefetch prefetch, const uint8_t* u, const int8_t* w, int32_t* acc, int64_t M, int64_t N,
                              int64_t K, int64_t n0, int64_t n1) {
  with_prefetch(prefetch, [&](auto policy) {
    constexpr Prefetch P = decltype(policy)::value;
    row_blocks<8>(M, [&](auto rows, int64_t m) {
      constexpr int MB = decltype(rows)::value;
      emulated::dpbusd_block<MB, P>(u, w, acc, m, N, K, n0, n1);
    });
  });
}
