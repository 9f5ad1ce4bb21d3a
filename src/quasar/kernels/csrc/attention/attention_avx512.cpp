// Attention of rows sharing one kv head on AVX-512, the same floats as attention_avx2.cpp, twice the lanes.
// Scores: a 512-bit register holds two rows' 8-lane partial sums for one key (each row's query in its half,
// the key broadcast to both), half_sums8 adds each half of eight keys at once in hsum8's order. Weighted
// values: 16 output dims a register, each lane the same chain over keys as the AVX2 code, R rows sharing
// every value load.
#include "attention_rows.h"
#include "simd_lanes.h"
#include "targets.h"
#include <immintrin.h>
#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

QUASAR_TARGET_PUSH(QUASAR_AVX512)
namespace avx512 {
namespace {

// The hsum8 of each half of 8 keys' accumulators a[t] (lanes 0-7: row A's partial sums, 8-15: row B's), in
// hsum8's order, three shuffle-and-add steps shared by all 8 keys: (l_i + l_{i+4}), then (s_0 + s_2, s_1 + s_3),
// then their sum. Returns [A's keys 0..7 | B's keys 0..7].
inline __m512 half_sums8(const __m512* a) {
  __m512 s[4], t[2];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // quarters [key 2i A, key 2i B, key 2i+1 A, key 2i+1 B] of s_i = l_i + l_{i+4}
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // each quarter [s[2i]: s0 + s2, s1 + s3, s[2i+1]: s0 + s2, s1 + s3]
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter q (row q & 1): keys (q >> 1) + 0, 2, 4, 6
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm512_permutexvar_ps(order, w);
}

// score_range for P pairs of rows at once: qq[p] [D / 8][16] holds pair p's queries 8 dims each side by side, s[2p]
// and s[2p + 1] its rows' scores. Eight keys at a time (8 P independent FMA chains; each key load serves every
// pair), each pair's sums reduced together (half_sums8).
template <int P>
void score_pairs(const float* const* qq, const float* keys, int64_t j0, int64_t j1, int64_t D, float scale,
                 float* const* s) {
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t j = j0; j < j1; j += 8) {
    const int64_t n = std::min<int64_t>(8, j1 - j);
    __m512 acc[P][8];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p)
      for (int t = 0; t < 8; ++t) acc[p][t] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m512 qv[P];
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) qv[p] = _mm512_loadu_ps(qq[p] + 2 * d);
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t)
        if (t < n) {
          const __m512 key = _mm512_broadcast_f32x8(_mm256_loadu_ps(keys + (j + t) * D + d));
#pragma GCC unroll 2
          for (int p = 0; p < P; ++p) acc[p][t] = _mm512_fmadd_ps(qv[p], key, acc[p][t]);
        }
    }
    const __mmask8 keep = static_cast<__mmask8>((1u << n) - 1);
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      const __m512 sums = _mm512_mul_ps(half_sums8(acc[p]), scale16);
      _mm256_mask_storeu_ps(s[2 * p] + j, keep, _mm512_castps512_ps256(sums));
      _mm256_mask_storeu_ps(s[2 * p + 1] + j, keep, _mm512_extractf32x8_ps(sums, 1));
    }
  }
}

// One key's score before the scale as score_pairs computes it: 8-lane FMA chains over d, then hsum8.
inline float key_score(const float* q, const float* key, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(key + d), acc);
  return hsum8(acc);
}

// softmax_numerators on 16 lanes: the same floats (the maximum is exact in any order; each e_j is exp8's; the
// total adds each 8 keys' lanes to the 8-lane sum in the same order as the 8-lane code).
float softmax_numerators(float* scores, int64_t n) {
  const int64_t padded = (n + 7) / 8 * 8;
  __m512 top16 = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(scores + j));
  float top = max16(top16);
  for (; j < n; ++j) top = std::max(top, scores[j]);
  for (j = n; j < padded; ++j) scores[j] = top;  // exp(0) = 1, zeroed below
  const __m512 top_v = _mm512_set1_ps(top);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m256 total = _mm256_setzero_ps();
  for (j = 0; j < padded; j += 16) {
    const __mmask16 in = j + 16 <= padded ? 0xFFFF : 0x00FF;  // the last 8 of a padded row, alone
    const __mmask16 valid = _mm512_mask_cmpgt_epi32_mask(in, _mm512_set1_epi32(static_cast<int>(n - j)), lane);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, scores + j), top_v)));
    _mm512_mask_storeu_ps(scores + j, in, e);
    total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
    if (in == 0xFFFF) total = _mm256_add_ps(total, _mm512_extractf32x8_ps(e, 1));
  }
  return hsum8(total);
}

// acc_out[r][64] += sum_{j in [j0, j1)} e[r][j] v_j[d0 : d0 + 64] for R rows, j in order (64 dims: 4 registers).
template <int R>
void weigh_rows(const float* const* e, const float* values, int64_t j0, int64_t j1, int64_t D, int64_t d0, float* const* acc_out) {
  __m512 acc[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_loadu_ps(acc_out[r] + 16 * b);
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = values + j * D + d0;
    const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16), v2 = _mm512_loadu_ps(vj + 32),
                 v3 = _mm512_loadu_ps(vj + 48);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 ej = _mm512_set1_ps(e[r][j]);
      acc[r][0] = _mm512_fmadd_ps(ej, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(ej, v1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(ej, v2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(ej, v3, acc[r][3]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < 4; ++b) _mm512_storeu_ps(acc_out[r] + 16 * b, acc[r][b]);
}

}  // namespace
}  // namespace avx512

// attend_rows_avx2 with AVX-512 (D a multiple of 64): bitwise the same outputs.
void attend_rows_avx512(const std::vector<AttentionRow>& rows, const float* keys, const float* values, int64_t D, float scale,
                 std::vector<float>& scores) {
  using namespace avx512;
  int64_t n_max = 0, lo = INT64_MAX;
  for (const AttentionRow& r : rows) {
    n_max = std::max(n_max, r.last + 1);
    lo = std::min(lo, r.first);
  }
  const int64_t stride = (n_max + 7) / 8 * 8 + 8, block = std::max<int64_t>(8, 4096 / D);
  const int64_t count = static_cast<int64_t>(rows.size()), pairs = (count + 1) / 2;
  scores.resize((count + 1) * stride);  // one spare row for the partner of an odd last row
  std::vector<float> qq(pairs * 2 * D);
  for (int64_t p = 0; p < pairs; ++p) {
    const float *qa = rows[2 * p].q, *qb = rows[std::min(2 * p + 1, count - 1)].q;
    for (int64_t d = 0; d < D; d += 8) {
      std::copy(qa + d, qa + d + 8, qq.data() + p * 2 * D + 2 * d);
      std::copy(qb + d, qb + d + 8, qq.data() + p * 2 * D + 2 * d + 8);
    }
  }
  for (int64_t j0 = lo; j0 < n_max; j0 += block)
    for (int64_t p = 0; p < pairs; p += 2) {  // two pairs share each key load; a last pair alone
      const int64_t first = 2 * p, end = std::min(2 * p + 4, 2 * pairs);
      int64_t from = INT64_MAX, last = 0;  // scores outside a row's own keys are computed, never read
      for (int64_t r = first; r < end; ++r) {
        from = std::min(from, rows[std::min(r, count - 1)].first);
        last = std::max(last, in_place_end(rows[std::min(r, count - 1)]) - 1);
      }
      const float* qs[2] = {qq.data() + p * 2 * D, qq.data() + (p + 1) * 2 * D};
      float* s[4];
      for (int64_t r = first; r < first + 4; ++r) s[r - first] = scores.data() + std::min(r, 2 * pairs - 1) * stride;
      const int64_t j = std::max(j0, from), j1 = std::min(j0 + block, last + 1);
      if (end - first == 4) score_pairs<2>(qs, keys, j, j1, D, scale, s);
      else score_pairs<1>(qs, keys, j, j1, D, scale, s);
    }
  for (int64_t r = 0; r < count; ++r)  // a tree row's ancestors, each key's score as score_pairs gives it
    for (int64_t j = std::max(in_place_end(rows[r]), rows[r].first); j <= rows[r].last; ++j)
      scores[r * stride + j] = key_score(rows[r].q, keys + rows[r].tail[j - rows[r].tail_from] * D, D) * scale;
  std::vector<float> norm(count);
  for (int64_t r = 0; r < count; ++r)
    norm[r] = avx512::softmax_numerators(scores.data() + r * stride + rows[r].first, rows[r].last + 1 - rows[r].first);
  constexpr int R = 4;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    for (const AttentionRow& r : rows) std::fill(r.out + d0, r.out + d0 + 64, 0.f);
    for (int64_t r0 = 0; r0 < count; r0 += R) {
      const int64_t n = std::min<int64_t>(R, count - r0);
      const float* e[R];
      float* out[R];
      int64_t from = 0, shared = INT64_MAX;
      for (int64_t i = 0; i < n; ++i) {
        e[i] = scores.data() + (r0 + i) * stride;
        out[i] = rows[r0 + i].out + d0;
        from = std::max(from, rows[r0 + i].first);
        shared = std::min(shared, in_place_end(rows[r0 + i]));
      }
      from = std::min(from, shared);
      for (int64_t i = 0; i < n; ++i)  // each row's own keys before those every row sees, in order
        weigh_rows<1>(e + i, values, rows[r0 + i].first, from, D, d0, out + i);
      for (int64_t j0 = from; j0 < shared; j0 += block) {  // the keys every row of the tile sees, together
        const int64_t j1 = std::min(j0 + block, shared);
        switch (n) {
          case 4: weigh_rows<4>(e, values, j0, j1, D, d0, out); break;
          case 3: weigh_rows<3>(e, values, j0, j1, D, d0, out); break;
          case 2: weigh_rows<2>(e, values, j0, j1, D, d0, out); break;
          default: weigh_rows<1>(e, values, j0, j1, D, d0, out);
        }
      }
      for (int64_t i = 0; i < n; ++i) {  // then each row's own later keys, still in order, a tree row's ancestors last
        const AttentionRow& row = rows[r0 + i];
        weigh_rows<1>(e + i, values, std::max(shared, row.first), in_place_end(row), D, d0, out + i);
        for (int64_t j = std::max(in_place_end(row), row.first); j <= row.last; ++j)
          weigh_rows<1>(e + i, values + (row.tail[j - row.tail_from] - j) * D, j, j + 1, D, d0, out + i);
      }
    }
    for (int64_t r = 0; r < count; ++r) {
      const __m512 n16 = _mm512_set1_ps(norm[r]);
      for (int64_t d = d0; d < d0 + 64; d += 16)
        _mm512_storeu_ps(rows[r].out + d, _mm512_div_ps(_mm512_loadu_ps(rows[r].out + d), n16));
    }
  }
}

QUASAR_TARGET_POP

