// The exact int8 dot products on AVX-512 VNNI (int8_dot.h has the arithmetic and the entry points): the "dpbusd"
// path, the loop of dpbusd_block.h on 512-bit registers, one vpdpbusd per 64 bytes.
#include "int8_dot.h"
#include "blocking.h"
#include "vnni.h"
#include "targets.h"

#include <immintrin.h>

namespace {

QUASAR_TARGET_PUSH(QUASAR_AVX512_VNNI)
namespace vnni {
struct Vnni512 {
  using reg = __m512i;
  static constexpr int64_t kBytes = 64;
  static reg zero() { return _mm512_setzero_si512(); }
  static reg ones() { return _mm512_set1_epi8(1); }
  static reg load(const void* p) { return _mm512_loadu_si512(p); }
  static reg load_tail(const void* p, int64_t count) {  // count < 64 bytes, zero-padded
    return _mm512_maskz_loadu_epi8((__mmask64{1} << count) - 1, p);
  }
  static reg dpbusd(reg acc, reg a, reg b) { return dpbusd512(acc, a, b); }
  static int32_t sum(reg v) { return _mm512_reduce_add_epi32(v); }
};

using V = Vnni512;
#include "dpbusd_block.h"
}  // namespace vnni
QUASAR_TARGET_POP

}  // namespace

void int8_dot_dpbusd(Prefetch prefetch, const uint8_t* u, const int8_t* w, int32_t* acc, int64_t M, int64_t N,
                     int64_t K, int64_t n0, int64_t n1) {
  with_prefetch(prefetch, [&](auto policy) {
    constexpr Prefetch P = decltype(policy)::value;
    row_blocks<8>(M, [&](auto rows, int64_t m) {
      constexpr int MB = decltype(rows)::value;
      vnni::dpbusd_block<MB, P>(u, w, acc, m, N, K, n0, n1);
    });
  });
}
