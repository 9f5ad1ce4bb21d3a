// Attention of new tokens over one sequence's KV cache (decode, verify, prefill chunks) on x86 CPUs with AVX2.
//
// For new tokens t = 0..T-1 at positions start + t: rotate q and k (rotate-half RoPE, each product and
// sum rounded like the torch reference), write k and v into the layer's cache at [start, start + T), then
// for every (token, head) attend over keys 0 .. start + t with float32 sums in a fixed order:
//   s_j = (q . k_j) * D^-1/2,  e_j = exp(s_j - max s),  out = (sum_j e_j v_j) / (sum_j e_j).
// A row reads only its own query and the keys up to its position, so a token scored alone (decode)
// and inside [last, *draft] (verify) gets bitwise the same output, whatever T and the cache size are:
// the property that makes greedy speculative decoding equal plain decoding, without padding.
// The rows that share a kv head (its query heads, every new token) go through the keys together, in
// blocks that stay in the L1 cache (attend_rows): that changes the cache traffic, not a single result.
// Where the float path is AVX-512 (float_path_avx512), the same arithmetic runs on 512-bit registers: two
// rows' partial sums per register for the scores, 16 dims per register for the values, the same floats.
// The bf16 verifier on the float path amx attends on AMX tiles instead (bf16 products: attention_amx.cpp), from
// keys and values AttentionSteps packs for it once per layer.
#include "attention_amx.h"
#include "simd_lanes.h"
#include "kernels.h"
#include "targets.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <atomic>
#include <climits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return hsum8(acc);
}

// out[D] = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]).
inline void rope(const float* x, const float* cos, const float* sin, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float rotated = i < half ? -x[i + half] : x[i - half];
    const float a = x[i] * cos[i];
    const float b = rotated * sin[i];
    out[i] = a + b;
  }
}

// Scores s_j = (q . k_j) * scale for keys [j0, j1): each one float32 chain of FMAs over d, then hsum8.
// Four keys run at a time for instruction-level parallelism; the grouping does not change any result.
void score_range(const float* q, const float* keys, int64_t j0, int64_t j1, int64_t D, float scale, float* scores) {
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) {
    const float *k0 = keys + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
    }
    scores[j] = hsum8(a0) * scale;
    scores[j + 1] = hsum8(a1) * scale;
    scores[j + 2] = hsum8(a2) * scale;
    scores[j + 3] = hsum8(a3) * scale;
  }
  for (; j < j1; ++j) scores[j] = dot(q, keys + j * D, D) * scale;
}

// scores[0, n) -> e_j = exp(s_j - max s) in place (zero-padded to a multiple of 8); returns sum_j e_j.
float softmax_numerators(float* scores, int64_t n) {
  const int64_t padded = (n + 7) / 8 * 8;
  __m256 top8 = _mm256_set1_ps(-INFINITY);  // the maximum is exact in any order: 8 lanes, then across them
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(scores + j));
  float top = max8(top8);
  for (; j < n; ++j) top = std::max(top, scores[j]);
  for (j = n; j < padded; ++j) scores[j] = top;  // exp(0) = 1, zeroed below
  __m256 total = _mm256_setzero_ps();
  top8 = _mm256_set1_ps(top);
  for (j = 0; j < padded; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top8));
    if (j + 8 > n) {  // the lanes past the last key count zero
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), lane);
      e = _mm256_and_ps(e, _mm256_castsi256_ps(valid));
    }
    _mm256_storeu_ps(scores + j, e);
    total = _mm256_add_ps(total, e);
  }
  return hsum8(total);
}

// acc[W] += sum_{j in [j0, j1)} e_j v_j[d0 : d0 + W], in order of j, one accumulator per 8 dims (kept in
// registers: W is a compile-time 8..64).
template <int W>
void weigh_values(const float* e, const float* values, int64_t j0, int64_t j1, int64_t D, int64_t d0, float* acc_out) {
  __m256 acc[W / 8];
  for (int b = 0; b < W / 8; ++b) acc[b] = _mm256_loadu_ps(acc_out + 8 * b);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 ej = _mm256_set1_ps(e[j]);
    const float* vj = values + j * D + d0;
    for (int b = 0; b < W / 8; ++b) acc[b] = _mm256_fmadd_ps(ej, _mm256_loadu_ps(vj + 8 * b), acc[b]);
  }
  for (int b = 0; b < W / 8; ++b) _mm256_storeu_ps(acc_out + 8 * b, acc[b]);
}

using WeighFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, int64_t, float*);
constexpr WeighFn kWeigh[8] = {weigh_values<8>, weigh_values<16>, weigh_values<24>, weigh_values<32>,
                               weigh_values<40>, weigh_values<48>, weigh_values<56>, weigh_values<64>};

using Row = AttentionRow;

// Rows sharing one kv head against keys 0..last of each, D dims. Keys and values are read in blocks of
// 16 KB, and each block serves every row while it sits in the L1 cache: per row, the same operations in
// the same order as attending to it alone (scores over d, softmax, the weighted sum over j in order), so
// a row's output never depends on the other rows, only the cache traffic does.
void attend_rows(const std::vector<Row>& rows, const float* keys, const float* values, int64_t D, float scale,
                 std::vector<float>& scores) {
  int64_t n_max = 0;
  for (const Row& r : rows) n_max = std::max(n_max, r.last + 1);
  const int64_t stride = (n_max + 7) / 8 * 8, block = std::max<int64_t>(8, 4096 / D);
  scores.resize(rows.size() * stride);
  for (int64_t j0 = 0; j0 < n_max; j0 += block)
    for (size_t r = 0; r < rows.size(); ++r)
      score_range(rows[r].q, keys, j0, std::min(j0 + block, rows[r].last + 1), D, scale, scores.data() + r * stride);
  std::vector<float> norm(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) norm[r] = softmax_numerators(scores.data() + r * stride, rows[r].last + 1);
  constexpr int64_t kBlock = 64;  // output dims per pass: 8 accumulators of 8
  for (int64_t d0 = 0; d0 < D; d0 += kBlock) {
    const int64_t width = std::min(kBlock, D - d0);
    for (const Row& r : rows) std::fill(r.out + d0, r.out + d0 + width, 0.f);
    for (int64_t j0 = 0; j0 < n_max; j0 += block)
      for (size_t r = 0; r < rows.size(); ++r)
        kWeigh[width / 8 - 1](scores.data() + r * stride, values, j0, std::min(j0 + block, rows[r].last + 1), D, d0,
                              rows[r].out + d0);
    for (size_t r = 0; r < rows.size(); ++r) {
      const __m256 n8 = _mm256_set1_ps(norm[r]);
      for (int64_t d = d0; d < d0 + width; d += 8)
        _mm256_storeu_ps(rows[r].out + d, _mm256_div_ps(_mm256_loadu_ps(rows[r].out + d), n8));
    }
  }
}

}  // namespace

// ---- AVX-512: the same floats, twice the lanes --------------------------------------------------------
// Scores: a 512-bit register holds two rows' 8-lane partial sums for one key (each row's query in its half,
// the key broadcast to both), half_sums8 adds each half of eight keys at once in hsum8's order. Weighted
// values: 16 output dims a register, each lane the same chain over keys as the AVX2 code, R rows sharing
// every value load.
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

// attend_rows with AVX-512 (D a multiple of 64): bitwise the same outputs.
void attend_rows(const std::vector<Row>& rows, const float* keys, const float* values, int64_t D, float scale,
                 std::vector<float>& scores) {
  int64_t n_max = 0;
  for (const Row& r : rows) n_max = std::max(n_max, r.last + 1);
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
  for (int64_t j0 = 0; j0 < n_max; j0 += block)
    for (int64_t p = 0; p < pairs; p += 2) {  // two pairs share each key load; a last pair alone
      const int64_t first = 2 * p, end = std::min(2 * p + 4, 2 * pairs);
      int64_t last = 0;
      for (int64_t r = first; r < end; ++r) last = std::max(last, rows[std::min(r, count - 1)].last);
      const float* qs[2] = {qq.data() + p * 2 * D, qq.data() + (p + 1) * 2 * D};
      float* s[4];
      for (int64_t r = first; r < first + 4; ++r) s[r - first] = scores.data() + std::min(r, 2 * pairs - 1) * stride;
      if (end - first == 4) score_pairs<2>(qs, keys, j0, std::min(j0 + block, last + 1), D, scale, s);
      else score_pairs<1>(qs, keys, j0, std::min(j0 + block, last + 1), D, scale, s);
    }
  std::vector<float> norm(count);
  for (int64_t r = 0; r < count; ++r) norm[r] = avx512::softmax_numerators(scores.data() + r * stride, rows[r].last + 1);
  constexpr int R = 4;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    for (const Row& r : rows) std::fill(r.out + d0, r.out + d0 + 64, 0.f);
    for (int64_t r0 = 0; r0 < count; r0 += R) {
      const int64_t n = std::min<int64_t>(R, count - r0);
      const float* e[R];
      float* out[R];
      int64_t shared = INT64_MAX;
      for (int64_t i = 0; i < n; ++i) {
        e[i] = scores.data() + (r0 + i) * stride;
        out[i] = rows[r0 + i].out + d0;
        shared = std::min(shared, rows[r0 + i].last + 1);
      }
      for (int64_t j0 = 0; j0 < shared; j0 += block) {  // the keys every row of the tile sees, together
        const int64_t j1 = std::min(j0 + block, shared);
        switch (n) {
          case 4: weigh_rows<4>(e, values, j0, j1, D, d0, out); break;
          case 3: weigh_rows<3>(e, values, j0, j1, D, d0, out); break;
          case 2: weigh_rows<2>(e, values, j0, j1, D, d0, out); break;
          default: weigh_rows<1>(e, values, j0, j1, D, d0, out);
        }
      }
      for (int64_t i = 0; i < n; ++i)  // then each row's own later keys, still in order
        weigh_rows<1>(e + i, values, shared, rows[r0 + i].last + 1, D, d0, out + i);
    }
    for (int64_t r = 0; r < count; ++r) {
      const __m512 n16 = _mm512_set1_ps(norm[r]);
      for (int64_t d = d0; d < d0 + 64; d += 16)
        _mm512_storeu_ps(rows[r].out + d, _mm512_div_ps(_mm512_loadu_ps(rows[r].out + d), n16));
    }
  }
}

}  // namespace
}  // namespace avx512
QUASAR_TARGET_POP

AttentionSteps::AttentionSteps(const std::vector<Segment>& segments, int64_t T, int64_t H, int64_t threads,
                               bool bf16_products)
    : row_view_(T, -1), H_(H) {
  const auto& first = segments.at(0).cache_k;
  H_kv_ = first.size(1);
  D_ = first.size(3);
  TORCH_CHECK(D_ % 8 == 0 && H % H_kv_ == 0, "bad head shapes");
  int64_t row = 0;
  for (const Segment& s : segments) {
    const int64_t S = s.cache_k.size(2);
    TORCH_CHECK(s.start >= 0 && s.start + s.rows <= S, "the new tokens do not fit the cache");
    TORCH_CHECK(row + s.rows <= T, "the sequences' rows are not q's rows");
    std::fill(row_view_.begin() + row, row_view_.begin() + row + s.rows, static_cast<int64_t>(views_.size()));
    views_.push_back(View{s.cache_k.data_ptr<float>(), s.cache_v.data_ptr<float>(), H_kv_ * S * D_, S, s.start, row, s.rows});
    row += s.rows;
  }
  TORCH_CHECK(row == T, "the segments' rows are q's rows");
  const int64_t group = H / H_kv_;
  // Work items: the rows of one kv head of one sequence, split in parts of at most kItemRows rows (a
  // prefill's scores stay small), and further only when there are fewer items than threads; rows of an item
  // share every key block read. A decode or verify step finds its keys and values in memory, not in the caches
  // (the weights' stream evicted them), so each part of a kv head's rows reads them again: two parts per thread
  // made forwards of the default model 6% / 17% / 23% slower at 256 / 768 / 1,536 cached tokens (one row) and
  // 6% / 4% / 12% (six rows) than one item per kv head, alternated in one process. How rows are grouped never
  // changes a result.
  constexpr int64_t kItemRows = 32;
  int64_t base_items = 0;
  for (const View& view : views_) base_items += H_kv_ * ((view.rows * group + kItemRows - 1) / kItemRows);
  for (size_t v = 0; v < views_.size(); ++v) {
    const View& view = views_[v];
    const int64_t per_kv = view.rows * group;
    int64_t chunks = (per_kv + kItemRows - 1) / kItemRows;
    if (base_items < threads) chunks = std::min(per_kv, std::max(chunks, (threads + H_kv_ - 1) / H_kv_));
    const int64_t chunk = (per_kv + chunks - 1) / chunks;
    for (int64_t kv = 0; kv < H_kv_; ++kv)
      for (int64_t first_row = 0; first_row < per_kv; first_row += chunk) {
        const int64_t count = std::min(chunk, per_kv - first_row);
        int64_t keys = 0;
        for (int64_t r = first_row; r < first_row + count; ++r) keys += view.start + r / group + 1;
        items_.push_back(Item{static_cast<int64_t>(v), kv, first_row, count, keys});
      }
  }
  // The items of a batch differ in cost by orders of magnitude (a decode row over a short cache next to a
  // prefill chunk over a long one), so an even split of the list left one thread waiting for the other
  // about half of the time in a busy batch. Dearest first, each thread takes the next item as it finishes
  // its last: which thread runs an item never changes its result.
  std::stable_sort(items_.begin(), items_.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  wide_ = D_ % 64 == 0 && float_path_avx512();
  amx_ = bf16_attention(bf16_products, D_);
  if (!amx_) return;
  // The keys and values a view's rows read, rounded and packed once per layer for all of them: by the pack phase
  // (packs(), into one buffer of the thread that built the steps) where a kv head's rows make several items (a
  // prefill), else by the item itself before it attends (decode, verify: no parallel phase more per layer).
  int64_t size = 0;
  for (size_t v = 0; v < views_.size(); ++v) {
    const int64_t padded = (views_[v].start + views_[v].rows + 31) / 32 * 32;
    const bool shared = std::count_if(items_.begin(), items_.end(), [&](const Item& i) {
      return i.view == static_cast<int64_t>(v) && i.kv == 0; }) > 1;
    packed_.push_back(Packed{padded * D_, shared ? size : -1});
    if (!shared) continue;
    for (int64_t kv = 0; kv < H_kv_; ++kv)
      for (int64_t b = 0; b < padded / 32; ++b) packs_.push_back(Pack{static_cast<int64_t>(v), kv, b});
    size += 2 * H_kv_ * padded * D_;
  }
  thread_local std::vector<uint16_t> buffer;  // grows to the largest step's, never given back: no page faults per layer
  TORCH_CHECK(live_on_thread() == 0, "one AttentionSteps on AMX at a time per thread: they share its pack buffer");
  buffer.resize(std::max<size_t>(buffer.size(), size));
  shared_ = buffer.data();
  ++live_on_thread();  // last: a constructor that throws has no destructor to undo it
}

int& AttentionSteps::live_on_thread() {
  thread_local int live = 0;
  return live;
}

AttentionSteps::~AttentionSteps() {
  if (amx_) --live_on_thread();
}

void AttentionSteps::pack(int64_t layer, int64_t i) const {
  const Pack& p = packs_[i];
  const View& view = views_[p.view];
  const Packed& into = packed_[p.view];
  const int64_t at = layer * view.layer_size + p.kv * view.S * D_;
  uint16_t* k = shared_ + into.at + 2 * p.kv * into.size;
  amx_pack_block(view.k + at, view.v + at, view.start + view.rows, p.block, D_, k, k + into.size);
}

void AttentionSteps::rope(int64_t layer, const float* q, const float* k, const float* v, const float* cos,
                          const float* sin, float* q_rot, int64_t t0, int64_t t1) const {
  for (int64_t t = t0; t < t1; ++t) {
    const View& view = views_[row_view_[t]];
    const int64_t pos = view.start + t - view.row0;
    float *k_cache = view.k + layer * view.layer_size, *v_cache = view.v + layer * view.layer_size;
    for (int64_t h = 0; h < H_; ++h) ::rope(q + (t * H_ + h) * D_, cos + t * D_, sin + t * D_, q_rot + (t * H_ + h) * D_, D_);
    for (int64_t h = 0; h < H_kv_; ++h) {
      ::rope(k + (t * H_kv_ + h) * D_, cos + t * D_, sin + t * D_, k_cache + (h * view.S + pos) * D_, D_);
      std::copy(v + (t * H_kv_ + h) * D_, v + (t * H_kv_ + h + 1) * D_, v_cache + (h * view.S + pos) * D_);
    }
  }
}

void AttentionSteps::attend(int64_t layer, int64_t i, const float* q_rot, float* out, std::vector<float>& scores) const {
  const Item& item = items_[i];
  const View& view = views_[item.view];
  const int64_t group = H_ / H_kv_;
  thread_local std::vector<Row> rows;  // reused: a step runs tens of items per thread
  rows.clear();
  for (int64_t r = item.first; r < item.first + item.count; ++r) {
    const int64_t t = view.row0 + r / group, h = item.kv * group + r % group;
    rows.push_back(Row{q_rot + (t * H_ + h) * D_, view.start + r / group, out + (t * H_ + h) * D_});
  }
  const int64_t at = layer * view.layer_size + item.kv * view.S * D_;
  const float scale = 1.f / std::sqrt(static_cast<float>(D_));
  if (amx_) {
    const Packed& from = packed_[item.view];
    thread_local std::vector<uint16_t> own;
    if (from.at < 0) {  // this item is all of its kv head's rows: it packs their keys and values itself
      own.resize(std::max<size_t>(own.size(), 2 * from.size));
      for (int64_t b = 0; b < from.size / D_ / 32; ++b)
        amx_pack_block(view.k + at, view.v + at, view.start + view.rows, b, D_, own.data(), own.data() + from.size);
    }
    const uint16_t* k = from.at < 0 ? own.data() : shared_ + from.at + 2 * item.kv * from.size;
    amx_attend_rows(rows, k, k + from.size, D_, scale);
  } else if (wide_) {
    avx512::attend_rows(rows, view.k + at, view.v + at, D_, scale, scores);
  } else {
    attend_rows(rows, view.k + at, view.v + at, D_, scale, scores);
  }
}

namespace {

// The steps' rope and attention of layer `layer` over every row, split between ATen's threads.
void attend_steps(const AttentionSteps& steps, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                  const torch::Tensor& v, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out) {
  for (const auto& t : {q, k, v, cos, sin})
    TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(),
                "contiguous float32 CPU tensors expected");
  const int64_t T = q.size(0), H = steps.heads(), H_kv = steps.kv_heads(), D = steps.head_dim();
  TORCH_CHECK(q.size(1) == H * D && k.size(1) == H_kv * D && v.size(1) == H_kv * D, "bad head shapes");
  auto q_rot = kernel_result(q.sizes(), q.options());
  float* qr = q_rot.data_ptr<float>();
  // Each row on its own (a batch's rows split between the threads: none waits while one rotates).
  const int64_t per_row = (H + 2 * H_kv) * D;
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / per_row), [&](int64_t t0, int64_t t1) {
    steps.rope(layer, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), cos.data_ptr<float>(),
               sin.data_ptr<float>(), qr, t0, t1);
  });
  at::parallel_for(0, steps.packs(), 1, [&](int64_t i0, int64_t i1) {  // none unless the attention runs on AMX
    for (int64_t i = i0; i < i1; ++i) steps.pack(layer, i);
  });
  std::atomic<int64_t> next{0};
  const int64_t n_items = steps.items();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    for (int64_t i = next++; i < n_items; i = next++) steps.attend(layer, i, qr, op, scores);
  });
}

}  // namespace

// q [T, H*D], k and v [T, H_kv*D], cos and sin [T, D], cache_k and cache_v [H_kv, S, D] (one layer, batch
// 0), all float32 -> out [T, H*D]. Writes the rotated k and v at cache positions [start, start + T).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor cache_k, torch::Tensor cache_v, int64_t start,
                               bool bf16_products) {
  TORCH_CHECK(cache_k.dtype() == torch::kFloat32 && cache_v.dtype() == torch::kFloat32 && cache_k.is_contiguous() &&
              cache_v.is_contiguous() && cache_k.device().is_cpu() && cache_k.dim() == 3 && cache_k.sizes() == cache_v.sizes(),
              "contiguous float32 CPU caches [H_kv, S, D] expected");
  auto out = kernel_result(q.sizes(), q.options());
  const int64_t D = cache_k.size(2);
  TORCH_CHECK(q.dim() == 2 && q.size(1) % D == 0, "q [T, H*D] expected");
  const std::vector<Segment> one{Segment{cache_k.unsqueeze(0), cache_v.unsqueeze(0), start, q.size(0)}};
  attend_steps(AttentionSteps(one, q.size(0), q.size(1) / D, at::get_num_threads(), bf16_products), 0, q, k, v, cos, sin, out);
  return out;
}

// The rows of several sequences one after another (q, k, v, cos, sin as decode_attention's, over all rows),
// segment i attending over layer `layer` of its own cache [L, H_kv, S, D] (checked by FusedLayers::forward_segments).
torch::Tensor segment_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                                const std::vector<Segment>& segments, int64_t layer, bool bf16_products) {
  const int64_t D = segments.at(0).cache_k.size(3);
  TORCH_CHECK(q.dim() == 2 && q.size(1) % D == 0, "q [T, H*D] expected");
  auto out = kernel_result(q.sizes(), q.options());
  attend_steps(AttentionSteps(segments, q.size(0), q.size(1) / D, at::get_num_threads(), bf16_products), layer, q, k, v,
               cos, sin, out);
  return out;
}
