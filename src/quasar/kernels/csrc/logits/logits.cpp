// The verifier's logits rows to tokens: the greedy token of each row (argmax_rows), and at temperature > 0 the
// sampling weights, the filters' cut and one draw (sampling_weights, filter_cuts, keep_weights, draw_index;
// quasar.decoding.sampling).
//
// torch.argmax on one 49k-vocabulary row took 90 us warm and 140 us right after a forward on a 2-core VM
// (a parallel reduction's dispatch and fork for a few microseconds of work); a verify step takes it over
// k + 1 rows. Here: two passes over each row in the calling thread, 16 floats per step, with torch's
// answer: the first index of the largest value, and the first NaN where a row holds one (torch orders NaN
// above every number).
#include "kernel_ops.h"
#include "simd_lanes.h"

#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// The first index of the largest value of row[0, V), or of the first NaN.
int64_t argmax_row(const float* row, int64_t V) {
  __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 x = _mm256_loadu_ps(row + v);
    top = _mm256_max_ps(top, x);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  float best = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (float lane : lanes) best = std::max(best, lane);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t t = v; t < V; ++t) {
    any_nan = any_nan || std::isnan(row[t]);
    best = std::max(best, row[t]);
  }
  if (any_nan) {
    for (int64_t t = 0; t < V; ++t)
      if (std::isnan(row[t])) return t;
  }
  const __m256 best8 = _mm256_set1_ps(best);
  for (v = 0; v + 8 <= V; v += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v), best8, _CMP_EQ_OQ));
    if (hits) return v + __builtin_ctz(hits);
  }
  for (; v < V; ++v)
    if (row[v] == best) return v;
  return 0;  // a row of -inf only: every value ties at the first
}

}  // namespace

void argmax_into(const float* logits, int64_t R, int64_t V, int64_t* out) {
  for (int64_t r = 0; r < R; ++r) out[r] = argmax_row(logits + r * V, V);
}

// ---- sampling (quasar.decoding.sampling): the filtered weights of a row and one draw from them ----------------------

namespace {

// A float64 sum of float32 vectors in 8 lanes (two registers of 4), read out in a fixed order.
struct LaneSum {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  void add(__m256 x) {
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
  }
  double sum() const {
    alignas(32) double s[4];
    _mm256_store_pd(s, _mm256_add_pd(lo, hi));
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
};

}  // namespace

// out[r, v] = exp((logits[r, v] - max_v logits[r]) * inv_t), float32, each product rounded as torch's
// (logits - top).mul_(inv_t); returns each row's sum (float64): quasar.decoding.sampling's weights before its filters.
std::vector<double> sampling_weights_into(const float* logits, float* out, int64_t R, int64_t V, double inv_t) {
  const float scale = static_cast<float>(inv_t);
  std::vector<double> sums(R);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = logits + r * V;
    float* w = out + r * V;
    __m256 top_lanes = _mm256_set1_ps(-INFINITY);
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) top_lanes = _mm256_max_ps(top_lanes, _mm256_loadu_ps(row + v));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top_lanes);
    float top = -INFINITY;
    for (float lane : lanes) top = std::max(top, lane);
    for (; v < V; ++v) top = std::max(top, row[v]);
    const __m256 top8 = _mm256_set1_ps(top), scale8 = _mm256_set1_ps(scale);
    LaneSum acc;
    for (v = 0; v + 8 <= V; v += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + v), top8), scale8);
      // exp8 stops at exp(-87.3); below that (a -inf logit among them) the weight is 0, as a filtered-out token's
      const __m256 e = _mm256_and_ps(exp8(x), _mm256_cmp_ps(x, _mm256_set1_ps(cephes_exp::kLowest), _CMP_GE_OQ));
      _mm256_storeu_ps(w + v, e);
      acc.add(e);
    }
    double sum = acc.sum();
    for (; v < V; ++v) {
      const float x = (row[v] - top) * scale;
      w[v] = x >= cephes_exp::kLowest ? std::exp(x) : 0.f;
      sum += w[v];
    }
    sums[r] = sum;
  }
  return sums;
}

// weights[r, v] = 0 where logits[r, v] < keep_from[r] (the filters' lowest kept logit); returns the rows' new sums.
std::vector<double> keep_weights_into(const float* logits, float* weights, const float* keep_from, int64_t R,
                                      int64_t V) {
  std::vector<double> sums(R);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = logits + r * V;
    float* w = weights + r * V;
    const float from = keep_from[r];
    const __m256 from8 = _mm256_set1_ps(from);
    LaneSum acc;  // the sums in sampling_weights' order
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
      const __m256 kept = _mm256_and_ps(_mm256_loadu_ps(w + v),
                                        _mm256_cmp_ps(_mm256_loadu_ps(row + v), from8, _CMP_NLT_UQ));
      _mm256_storeu_ps(w + v, kept);
      acc.add(kept);
    }
    double sum = acc.sum();
    for (; v < V; ++v) {
      if (row[v] < from) w[v] = 0.f;
      sum += w[v];
    }
    sums[r] = sum;
  }
  return sums;
}

// ---- the filters' cut (top-k, then top-p over what top-k keeps) without sorting the vocabulary -------------

namespace {

// A token as a cut walks the row: its logit and what it adds to the running measure (its weight, or 1).
struct Walked {
  float logit;
  double measure;
};

// The logit of the token at which the running measure, walking `tokens` in descending logit order, first
// reaches `target` (the tokens tying with it share its logit); the lowest logit when it never does (rounding).
// Selection by three-way partitions around a pivot logit: O(n) expected, no sort.
float reach(std::vector<Walked>& tokens, double target) {
  Walked* t = tokens.data();
  size_t n = tokens.size();
  float lowest = INFINITY;
  while (n > 0) {
    float a = t[0].logit, b = t[n / 2].logit, c = t[n - 1].logit;
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of three
    size_t above = 0, i = 0, below = n;  // [0, above) > pivot, [above, i) == pivot, [below, n) < pivot
    double above_measure = 0, equal_measure = 0;
    float above_lowest = INFINITY;
    while (i < below) {
      if (t[i].logit > pivot) {
        above_measure += t[i].measure;
        above_lowest = std::min(above_lowest, t[i].logit);
        std::swap(t[i++], t[above++]);
      } else if (t[i].logit < pivot) {
        std::swap(t[i], t[--below]);
      } else {
        equal_measure += t[i++].measure;
      }
    }
    if (above_measure >= target) {
      n = above;
      lowest = above_lowest;
      continue;
    }
    if (above_measure + equal_measure >= target) return pivot;
    target -= above_measure + equal_measure;
    lowest = pivot;
    t += below;
    n -= below;
  }
  return lowest;
}

// The weight at which octave `band` of the weights starts: 2^(band - 127), a float's exponent field; band 0 also
// holds the denormals and zeros.
float band_start(int band) {
  const uint32_t bits = static_cast<uint32_t>(band) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// What the tokens with a logit >= floor and a weight in [from, to) add up to: their weights (by_mass), or their
// count; float64 lanes summed in a fixed order.
double measure_between(const float* logits, const float* weights, int64_t V, float floor, float from, float to,
                       bool by_mass) {
  const __m256 floor8 = _mm256_set1_ps(floor), from8 = _mm256_set1_ps(from), to8 = _mm256_set1_ps(to);
  const bool all_logits = floor == -INFINITY;
  LaneSum acc;
  int64_t count = 0, v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 w = _mm256_loadu_ps(weights + v);
    __m256 in = _mm256_and_ps(_mm256_cmp_ps(w, from8, _CMP_GE_OQ), _mm256_cmp_ps(w, to8, _CMP_LT_OQ));
    if (!all_logits) in = _mm256_and_ps(in, _mm256_cmp_ps(_mm256_loadu_ps(logits + v), floor8, _CMP_GE_OQ));
    if (by_mass) {
      const __m256 m = _mm256_and_ps(w, in);
      acc.add(m);
    } else {
      count += __builtin_popcount(_mm256_movemask_ps(in));
    }
  }
  double sum = acc.sum();
  for (; v < V; ++v) {
    if (weights[v] >= from && weights[v] < to && logits[v] >= floor) {
      sum += by_mass ? weights[v] : 0.0;
      ++count;
    }
  }
  return by_mass ? sum : static_cast<double>(count);
}

// Gathers the tokens with a logit >= floor and a weight in [from, to) into `tokens`, in index order; false (and
// `tokens` incomplete) as soon as more than `limit` are found.
bool gather(const float* logits, const float* weights, int64_t V, float floor, float from, float to, bool by_mass,
            std::vector<Walked>& tokens, size_t limit) {
  tokens.clear();
  const __m256 floor8 = _mm256_set1_ps(floor), from8 = _mm256_set1_ps(from), to8 = _mm256_set1_ps(to);
  auto take = [&](int64_t i) {
    if (weights[i] >= from && weights[i] < to && logits[i] >= floor)
      tokens.push_back({logits[i], by_mass ? weights[i] : 1.0});
  };
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 w = _mm256_loadu_ps(weights + v);
    const __m256 band = _mm256_and_ps(_mm256_cmp_ps(w, from8, _CMP_GE_OQ), _mm256_cmp_ps(w, to8, _CMP_LT_OQ));
    const __m256 in = _mm256_and_ps(band, _mm256_cmp_ps(_mm256_loadu_ps(logits + v), floor8, _CMP_GE_OQ));
    for (int bits = _mm256_movemask_ps(in); bits; bits &= bits - 1) take(v + __builtin_ctz(bits));
    if (tokens.size() > limit) return false;
  }
  for (; v < V; ++v) take(v);
  return tokens.size() <= limit;
}

// The lowest logit a cut keeps in one row: walking the tokens with a logit >= floor in descending logit order,
// the one at which the running measure reaches the target, where the measure is each token's weight (by_mass:
// the target is top_p of the walked tokens' mass) or 1 (the target is k). The weights (exp((logit - max) / T) <= 1)
// are in the logits' order, so the tokens weighing at least some w form the walk's start. First the head, the
// tokens weighing at least 2^-12 (top-p) or 2^-24 (top-k) of the top one: where it reaches the target (it mostly
// does), the cut is selected in it. Otherwise the weights fall into octaves by their float exponent: a binary
// search over octaves, one pass a step, finds the octave where the target falls, and the cut is selected there.
float cut_row(const float* logits, const float* weights, int64_t V, float floor, bool by_mass, double top) {
  constexpr size_t kMaxHead = 4096;
  const float none = INFINITY;
  const double all = measure_between(logits, weights, V, floor, 0.f, none, by_mass);
  const double target = by_mass ? top * all : top;
  if (!(all >= target) || !(target > 0)) return floor;  // k beyond the walked tokens: keep them all
  static thread_local std::vector<Walked> tokens;
  const float head_from = band_start(by_mass ? 127 - 12 : 127 - 24);  // k tokens reach further down
  if (gather(logits, weights, V, floor, head_from, none, by_mass, tokens, kMaxHead)) {
    double head = 0;
    for (const Walked& t : tokens) head += t.measure;
    if (head >= target) return reach(tokens, target);
  }
  // The measure from octave `found` on reaches the target, from `past` on it does not.
  int found = 0, past = 128;
  double from_past = 0;
  while (past - found > 1) {
    const int mid = (found + past) / 2;
    const double from_mid = measure_between(logits, weights, V, floor, band_start(mid), none, by_mass);
    if (from_mid >= target)
      found = mid;
    else
      past = mid, from_past = from_mid;
  }
  gather(logits, weights, V, floor, found ? band_start(found) : 0.f, past < 128 ? band_start(past) : none, by_mass,
         tokens, SIZE_MAX);
  return reach(tokens, target - from_past);
}

}  // namespace

// The lowest logit the filters top-k (top_k > 0) and then top-p (top_p < 1, over the tokens top-k keeps) keep in each
// row of logits [R, V], given its weights exp((logits - max) * inv_t) (sampling_weights) -> float32 [R, 1]; -inf
// where neither filter is on. In descending logit order a token is kept while fewer than k tokens / less than
// top_p of the mass lie ahead of it; tokens tying with the last one kept are kept too. Sums in float64.
void filter_cuts_into(const float* logits, const float* weights, int64_t R, int64_t V, int64_t top_k, double top_p,
                      float* out) {
  for (int64_t r = 0; r < R; ++r) {
    const float *row = logits + r * V, *w = weights + r * V;
    float floor = -INFINITY;
    if (top_k > 0 && top_k < V) floor = cut_row(row, w, V, floor, false, static_cast<double>(top_k));
    if (top_p < 1) floor = cut_row(row, w, V, floor, true, top_p);
    out[r] = floor;
  }
}

// One index from weights [V] (>= 0) at the uniform number u in [0, 1): the first v whose running float64 sum
// passes u * total, as torch.searchsorted(torch.cumsum(weights, 0, dtype=float64), u * total, right=True) (the
// total summed in lanes); the last nonzero weight's index where rounding carries u * total past the running sum's
// end; -1 when every weight is 0.
int64_t draw_index_at(const float* w, int64_t V, double u) {
  LaneSum acc;
  int64_t last = -1, v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 x = _mm256_loadu_ps(w + v);
    acc.add(x);
    const int nonzero = _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NEQ_UQ));
    if (nonzero) last = v + 31 - __builtin_clz(nonzero);
  }
  double total = acc.sum();  // in lanes; the running sum below is torch's sequential one
  for (; v < V; ++v) {
    total += w[v];
    if (w[v] != 0.f) last = v;
  }
  if (!(total > 0)) return -1;
  const double at = u * total;
  double running = 0;
  for (int64_t v = 0; v < V; ++v) {
    running += w[v];
    if (running > at) return v;
  }
  return last;
}
