// Attention for decode and verify steps (a few new tokens, batch 1) on x86 CPUs with AVX2.
//
// For new tokens t = 0..T-1 at positions start + t: rotate q and k (rotate-half RoPE, each product and
// sum rounded like the torch reference), write k and v into the layer's cache at [start, start + T), then
// for every (token, head) attend over keys 0 .. start + t with float32 sums in a fixed order:
//   s_j = (q . k_j) * D^-1/2,  e_j = exp(s_j - max s),  out = (sum_j e_j v_j) / (sum_j e_j).
// A row reads only its own query and the keys up to its position, so a token scored alone (decode)
// and inside [last, *draft] (verify) gets bitwise the same output, whatever T and the cache size are:
// the property that makes greedy speculative decoding equal plain decoding, without padding.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <algorithm>
#include <vector>

namespace {

// exp on 8 floats (Cephes expf polynomial; inputs here are <= 0).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.f));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

// One query row against keys 0..last of one kv head: out[D]. Independent dot products run four at a
// time and the weighted sum of values keeps one accumulator per 8 dims, for instruction-level parallelism;
// every sum still runs in one fixed order (over d for a score, over j for an output dim).
void attend(const float* q, const float* keys, const float* values, int64_t last, int64_t D, float scale,
            float* scores, float* out) {
  const int64_t n = last + 1, padded = (n + 7) / 8 * 8;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
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
  for (; j < n; ++j) scores[j] = dot(q, keys + j * D, D) * scale;
  float top = -INFINITY;
  for (j = 0; j < n; ++j) top = std::max(top, scores[j]);
  for (j = n; j < padded; ++j) scores[j] = top;  // exp(0) = 1, zeroed below
  __m256 total = _mm256_setzero_ps();
  const __m256 top8 = _mm256_set1_ps(top);
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
  const __m256 norm = _mm256_set1_ps(hsum8(total));
  constexpr int64_t kBlock = 64;  // 8 accumulators of 8 dims
  for (int64_t d0 = 0; d0 < D; d0 += kBlock) {
    const int64_t width = std::min(kBlock, D - d0);
    __m256 acc[kBlock / 8];
    for (int64_t b = 0; b < width / 8; ++b) acc[b] = _mm256_setzero_ps();
    for (j = 0; j < n; ++j) {
      const __m256 e = _mm256_set1_ps(scores[j]);
      const float* vj = values + j * D + d0;
      for (int64_t b = 0; b < width / 8; ++b) acc[b] = _mm256_fmadd_ps(e, _mm256_loadu_ps(vj + 8 * b), acc[b]);
    }
    for (int64_t b = 0; b < width / 8; ++b) _mm256_storeu_ps(out + d0 + 8 * b, _mm256_div_ps(acc[b], norm));
  }
}

}  // namespace

// q [T, H*D], k and v [T, H_kv*D], cos and sin [T, D], cache_k and cache_v [H_kv, S, D] (one layer, batch
// 0), all float32 -> out [T, H*D]. Writes the rotated k and v at cache positions [start, start + T).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor cache_k, torch::Tensor cache_v, int64_t start) {
  for (const auto& t : {q, k, v, cos, sin, cache_k, cache_v})
    TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(),
                "contiguous float32 CPU tensors expected");
  const int64_t T = q.size(0), H_kv = cache_k.size(0), S = cache_k.size(1), D = cache_k.size(2);
  const int64_t H = q.size(1) / D;
  TORCH_CHECK(D % 8 == 0 && H % H_kv == 0 && q.size(1) == H * D && k.size(1) == H_kv * D, "bad head shapes");
  TORCH_CHECK(start >= 0 && start + T <= S, "the new tokens do not fit the cache");
  auto out = torch::empty_like(q);
  auto q_rot = torch::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *ck = cache_k.data_ptr<float>(), *cv = cache_v.data_ptr<float>(), *qr = q_rot.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) rope(qp + (t * H + h) * D, cp + t * D, sp + t * D, qr + (t * H + h) * D, D);
    for (int64_t h = 0; h < H_kv; ++h) {
      float* slot = ck + (h * S + start + t) * D;
      rope(kp + (t * H_kv + h) * D, cp + t * D, sp + t * D, slot, D);
      std::copy(vp + (t * H_kv + h) * D, vp + (t * H_kv + h + 1) * D, cv + (h * S + start + t) * D);
    }
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t group = H / H_kv;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores((start + T + 7) / 8 * 8);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H, kv = h / group;
      attend(qr + i * D, ck + kv * S * D, cv + kv * S * D, start + t, D, scale, scores.data(), op + i * D);
    }
  });
  return out;
}
