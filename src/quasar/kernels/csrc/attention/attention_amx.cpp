// The bf16 verifier's attention on Intel AMX tiles: bfloat16 products, float32 sums, as a BF16 model's attention
// runs in transformers (SDPA) and llama.cpp, where the float32 attention (attention_avx2.cpp) runs at the FMAs'
// rate and took a large share of a long bf16 prefill.
//
// A step first rounds the keys and values it reads to bfloat16 into tile layouts, once per kv head and layer for
// all of its rows (amx_pack_block), then each work item (rows of one kv head) computes
//   S = Q K^T  (tiles of 16 rows x 16 keys, head dims walked from 0 in steps of 32),
//   e_j = exp(S_j / sqrt(D) - max S) in float32 over the row's keys 0..last, P = bf16(e),
//   out = P V / sum_j e_j  (tiles of 16 rows x 16 dims, keys walked from 0 in steps of 32).
// An output is the tile unit's function of its own row's inputs (float_amx.cpp), a row's P is 0 past its last key
// (adding 0 products changes no sum) and the keys past a step's own are packed as 0: so a token scored alone
// (decode), in a verify step or in a prefill gets the same floats, and greedy speculative decoding still equals
// plain decoding bit for bit. The floats are not the float32 attention's (about 5e-3 relative on random inputs).
// One exception: a row multiplies the values of the step's later tokens by exactly 0, so a value that is NaN, or
// beyond bfloat16's range (Inf once rounded), in a later token of the same verify block or prefill makes the row NaN
// where scored alone it is not (float32 attention never reads them); a model whose values overflow has no output left.
#include "attention_rows.h"
#include "float_amx.h"
#include "simd_lanes.h"
#include "kernel_ops.h"
#include "targets.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

bool bf16_attention(bool bf16_products, int64_t head_dim) {
  return bf16_products && head_dim % 64 == 0 && float_path_for(true) == "amx";
}

QUASAR_TARGET_PUSH(QUASAR_AMX_BF16_AVX512)
namespace {

// Every tile 16 rows of 64 bytes. Scores: 0, 1 the sums of two row tiles, 2 the keys, 4, 5 the rows' queries.
// P V: 0-3 the sums of four groups of 16 dims, 4 the rows' P, 6, 7 the values.
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// 16 floats -> 16 bfloat16 bits, to nearest even (as torch's .to(torch.bfloat16)).
inline __m256i round16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

// r[i]: row i of a 16 x 16 matrix of 32-bit values -> r[j]: column j.
inline void transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // b[4g + c], 128-bit lane L: column 4L + c of rows 4g .. 4g + 3
    b[4 * g + 0] = _mm512_unpacklo_epi64(a[4 * g + 0], a[4 * g + 2]);
    b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g + 0], a[4 * g + 2]);
    b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
    b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // then the 4 x 4 lanes of b[c], b[4 + c], b[8 + c], b[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44), y1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Per-thread scratch of amx_attend_rows: the rows' queries [32][D] and P [32][keys] in bfloat16, scores [32][keys]
// and sums [32][D] in float32.
struct Scratch {
  std::vector<uint16_t> q, p;
  std::vector<float> s, o, norm;
};

// The lanes of 16 holding the first n (of a row's remaining keys).
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// The largest `last` of rows [first, first + 16) (fewer at the end).
int64_t tile_last(const std::vector<AttentionRow>& rows, int64_t first) {
  int64_t last = 0;
  for (int64_t m = first; m < std::min<int64_t>(first + 16, rows.size()); ++m) last = std::max(last, rows[m].last);
  return last;
}

}  // namespace

void amx_pack_block(const float* keys, const float* values, int64_t first, int64_t end, int64_t b, int64_t D,
                    uint16_t* kp, uint16_t* vp) {
  const auto valid = [&](int64_t key) { return key >= first && key < end; };
  const int64_t chunks = D / 32, dim_blocks = D / 16;
  for (int64_t block = 2 * b; block < 2 * b + 2; ++block)  // two tiles of 16 keys: each 16 keys' dim pairs, transposed
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i r[16];
      for (int n = 0; n < 16; ++n) {
        const int64_t key = 16 * block + n;
        r[n] = _mm512_setzero_si512();
        if (valid(key)) {
          const float* k = keys + key * D + 32 * c;
          r[n] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(k + 16), _mm512_loadu_ps(k));
        }
      }
      transpose16(r);
      auto* out = reinterpret_cast<__m512i*>(kp + (block * chunks + c) * 512);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + p, r[p]);
    }
  for (int64_t j = 32 * b; j < 32 * b + 32; j += 2)  // each pair of keys' values, interleaved dim by dim
    for (int64_t e = 0; e < dim_blocks; ++e) {
      const __m512 v0 = valid(j) ? _mm512_loadu_ps(values + j * D + 16 * e) : _mm512_setzero_ps();
      const __m512 v1 = valid(j + 1) ? _mm512_loadu_ps(values + (j + 1) * D + 16 * e) : _mm512_setzero_ps();
      const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(round16(v0)), _mm512_slli_epi32(_mm512_cvtepu16_epi32(round16(v1)), 16));
      _mm512_storeu_si512(vp + ((b * dim_blocks + e) * 16 + (j % 32) / 2) * 32, pair);
    }
}

void amx_attend_rows(const std::vector<AttentionRow>& rows, const uint16_t* kp, const uint16_t* vp, int64_t D,
                     float scale) {
  thread_local Scratch w;
  const int64_t count = static_cast<int64_t>(rows.size()), tiles = (count + 15) / 16, M = 16 * tiles;
  KERNEL_CHECK(tiles <= 2 && D % 64 == 0, "at most 32 rows and head_dim % 64 == 0");
  int64_t n = 0, lo = INT64_MAX;
  for (const AttentionRow& r : rows) {
    n = std::max(n, r.last + 1);
    lo = std::min(lo, r.first);
  }
  lo = lo / 32 * 32;  // keys are walked from this whole block: those before every row's first are never read
  const int64_t n16 = (n + 15) / 16 * 16, n32 = (n + 31) / 32 * 32, chunks = D / 32, dim_blocks = D / 16;
  w.q.resize(M * D);  // rows past count: whatever is there (their sums are never read)
  w.s.resize(M * n16);
  w.p.resize(M * n32);
  w.o.resize(M * D);
  w.norm.resize(count);  // every allocation before the tiles are configured
  for (int64_t m = 0; m < count; ++m)
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.q.data() + m * D + d), round16(_mm512_loadu_ps(rows[m].q + d)));
  configure_tiles();
  const int64_t last0 = tile_last(rows, 0), last1 = tiles > 1 ? tile_last(rows, 16) : -1;
  for (int64_t b = lo / 16; 16 * b <= std::max(last0, last1); ++b) {  // S, 16 keys at a time, for both row tiles
    const bool first = 16 * b <= last0, second = 16 * b <= last1;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(2, kp + (b * chunks + c) * 512, 64);
      if (first) {
        _tile_loadd(4, w.q.data() + 32 * c, D * 2);
        _tile_dpbf16ps(0, 4, 2);
      }
      if (second) {
        _tile_loadd(5, w.q.data() + 16 * D + 32 * c, D * 2);
        _tile_dpbf16ps(1, 5, 2);
      }
    }
    if (first) _tile_stored(0, w.s.data() + 16 * b, n16 * 4);
    if (second) _tile_stored(1, w.s.data() + 16 * n16 + 16 * b, n16 * 4);
  }
  float* norm = w.norm.data();
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t m = 0; m < count; ++m) {  // e_j over the row's keys in float32; P = bf16(e), else 0 in the walked tiles
    const float* s = w.s.data() + m * n16;
    const int64_t from = rows[m].first, keys = rows[m].last + 1, walked = ((m < 16 ? last0 : last1) + 32) / 32 * 32;
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    for (int64_t j = from; j < keys; j += 16) {
      const __mmask16 in = first_lanes(keys - j);
      top16 = _mm512_mask_max_ps(top16, in, top16, _mm512_maskz_loadu_ps(in, s + j));
    }
    const __m512 top = _mm512_set1_ps(max16(top16) * scale);  // the largest scaled score
    __m512 total = _mm512_setzero_ps();
    uint16_t* p = w.p.data() + m * n32;
    std::fill(p + lo, p + from, 0);
    for (int64_t j = from; j < keys; j += 16) {
      const __mmask16 in = first_lanes(keys - j);
      const __m512 e = _mm512_maskz_mov_ps(in, exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(in, s + j), scale16), top)));
      total = _mm512_add_ps(total, e);
      _mm256_mask_storeu_epi16(p + j, in, round16(e));
    }
    std::fill(p + keys, p + walked, 0);
    norm[m] = _mm512_reduce_add_ps(total);
  }
  for (int64_t t = 0; t < tiles; ++t) {  // P V, 32 keys and 64 dims at a time
    const int64_t last = t ? last1 : last0;
    for (int64_t g = 0; g < dim_blocks; g += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = lo / 32; 32 * c <= last; ++c) {
        const uint16_t* v = vp + (c * dim_blocks + g) * 512;
        _tile_loadd(4, w.p.data() + 16 * t * n32 + 32 * c, n32 * 2);
        _tile_loadd(6, v, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, v + 512, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, v + 1024, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, v + 1536, 64);
        _tile_dpbf16ps(3, 4, 7);
      }
      float* o = w.o.data() + 16 * t * D + 16 * g;
      _tile_stored(0, o, D * 4);
      _tile_stored(1, o + 16, D * 4);
      _tile_stored(2, o + 32, D * 4);
      _tile_stored(3, o + 48, D * 4);
    }
  }
  _tile_release();
  for (int64_t m = 0; m < count; ++m) {
    const __m512 norm16 = _mm512_set1_ps(norm[m]);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(rows[m].out + d, _mm512_div_ps(_mm512_loadu_ps(w.o.data() + m * D + d), norm16));
  }
}
QUASAR_TARGET_POP
