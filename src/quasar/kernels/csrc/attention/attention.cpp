// Attention of new tokens over their sequences' KV caches (decode, verify, prefill chunks): the plan of a step's
// work (AttentionSteps), rope and the cache writes, and the choice of the path each kv head's rows run on
// (attention_avx2.cpp, attention_avx512.cpp, attention_amx.cpp).
//
// For new tokens t = 0..T-1 at positions start + t: rotate q and k (rotate-half RoPE, each product and
// sum rounded like the torch reference), write k and v into the layer's cache at [start, start + T), then
// for every (token, head) attend over keys 0 .. start + t with float32 sums in a fixed order:
//   s_j = (q . k_j) * D^-1/2,  e_j = exp(s_j - max s),  out = (sum_j e_j v_j) / (sum_j e_j).
// A sliding-window layer (Gemma 3's, `window` > 0) attends over keys start + t - window + 1 .. start + t instead and
// reads no key before them; a model may set its own scale (Gemma's query_pre_attn_scalar^-1/2) for D^-1/2.
// Such a layer may keep its keys in a ring (Segment::ring): position p in slot p % R and again in slot p % R + R of
// 2R slots, so that any R consecutive positions lie side by side; R is a multiple of 32, so a key's place in its block
// of 32 is the same in the ring as in a plain cache, and the rows get the same floats either way.
// A row reads only its own query and the keys up to its position, so a token scored alone (decode)
// and inside [last, *draft] (verify) gets bitwise the same output, whatever T and the cache size are:
// the property that makes greedy speculative decoding equal plain decoding, without padding.
// A draft tree's rows (Segment::parents) are the same rows with their keys elsewhere: a row at depth d is rotated
// for position start + d, writes its key at slot start + its row, and attends to keys 0 .. start - 1 in place and
// then to its ancestors' slots in order of depth (AttentionRow::tail), the keys a chain of its path reads at
// start .. start + d: bitwise the output of that chain's last row.
// The rows that share a kv head (its query heads, every new token) go through the keys together, in
// blocks that stay in the L1 cache (attend_rows): that changes the cache traffic, not a single result.
// Where the float path is AVX-512 (float_path_avx512), the same arithmetic runs on 512-bit registers
// (attention_avx512.cpp), the same floats.
// The bf16 verifier on the float path amx attends on AMX tiles instead (bf16 products: attention_amx.cpp), from
// keys and values AttentionSteps packs for it once per layer.
#include "attention_rows.h"
#include "kernel_ops.h"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

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

}  // namespace

AttentionSteps::AttentionSteps(const std::vector<Segment>& segments, int64_t T, int64_t H, int64_t threads,
                               bool bf16_products, AttentionWindow shape, bool ring)
    : row_view_(T, -1), H_(H), window_(shape.window) {
  const CacheView& first = ring ? segments.at(0).ring : segments.at(0).cache;
  H_kv_ = first.H_kv;
  D_ = first.D;
  KERNEL_CHECK(D_ % 8 == 0 && H % H_kv_ == 0, "bad head shapes");
  KERNEL_CHECK(window_ >= 0, "a window of at least one key, or 0 for none");
  scale_ = shape.scale > 0 ? static_cast<float>(shape.scale) : 1.f / std::sqrt(static_cast<float>(D_));
  int64_t row = 0;
  KERNEL_CHECK(!ring || window_ > 0, "only a sliding-window layer keeps its keys in a ring");
  for (const Segment& s : segments) {
    const CacheView& cache = ring ? s.ring : s.cache;
    KERNEL_CHECK(cache.k && cache.v, "every segment needs its ring");
    const int64_t S = cache.S, R = ring ? S / 2 : 0, origin = first_key(s.start) / 32 * 32;
    KERNEL_CHECK(s.start >= 0 && (ring ? s.start + s.rows - origin <= R : s.start + s.rows <= S),
                ring ? "the new tokens and their window do not fit the ring" : "the new tokens do not fit the cache");
    KERNEL_CHECK(row + s.rows <= T, "the sequences' rows are not q's rows");
    std::fill(row_view_.begin() + row, row_view_.begin() + row + s.rows, static_cast<int64_t>(views_.size()));
    views_.push_back(View{cache.k, cache.v, H_kv_ * S * D_, S, s.start, row, s.rows, R, origin, {}, {}, {}});
    KERNEL_CHECK(!s.parents || !ring, "a draft tree's rows need a cache without rings");
    if (s.parents) plant(views_.back(), s.parents);
    row += s.rows;
  }
  KERNEL_CHECK(row == T, "the segments' rows are q's rows");
  const int64_t group = H / H_kv_;
  // Work items: the rows of one kv head of one sequence, split in parts of at most kItemRows rows (a
  // prefill's scores stay small), and further only when there are fewer items than threads; rows of an item
  // share every key block read. A decode or verify step finds its keys and values in memory, not in the caches
  // (the weights' stream evicted them), so each part of a kv head's rows reads them again: two parts per thread
  // made forwards slower than one item per kv head, the more so the longer the cache. How rows are grouped never
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
        for (int64_t r = first_row; r < first_row + count; ++r) {
          const int64_t pos = view.position(r / group);
          keys += pos + 1 - first_key(pos);
        }
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
  for (const View& view : views_) KERNEL_CHECK(view.depth.empty(), "a draft tree's rows attend on the float32 paths only");
  // The keys and values a view's rows read, rounded and packed once per layer for all of them: by the pack phase
  // (packs(), into one buffer of the thread that built the steps) where a kv head's rows make several items (a
  // prefill), else by the item itself before it attends (decode, verify: no parallel phase more per layer).
  int64_t size = 0;
  for (size_t v = 0; v < views_.size(); ++v) {
    const int64_t padded = (views_[v].start + views_[v].rows - views_[v].origin + 31) / 32 * 32;
    const bool shared = std::count_if(items_.begin(), items_.end(), [&](const Item& i) {
      return i.view == static_cast<int64_t>(v) && i.kv == 0; }) > 1;
    packed_.push_back(Packed{padded * D_, shared ? size : -1});
    if (!shared) continue;
    for (int64_t kv = 0; kv < H_kv_; ++kv)
      for (int64_t b = 0; b < padded / 32; ++b) packs_.push_back(Pack{static_cast<int64_t>(v), kv, b});
    size += 2 * H_kv_ * padded * D_;
  }
  thread_local std::vector<uint16_t> buffer;  // grows to the largest step's, never given back: no page faults per layer
  KERNEL_CHECK(live_on_thread() == 0, "one AttentionSteps on AMX at a time per thread: they share its pack buffer");
  buffer.resize(std::max<size_t>(buffer.size(), size));
  shared_ = buffer.data();
  ++live_on_thread();  // last: a constructor that throws has no destructor to undo it
}

std::vector<int64_t> tree_depths(const int64_t* parents, int64_t rows) {
  std::vector<int64_t> depth;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t parent = parents[r];
    KERNEL_CHECK(r == 0 ? parent == -1 : parent >= 0 && parent < r, "a tree row's parent is an earlier row (row 0: -1)");
    depth.push_back(r ? depth[parent] + 1 : 0);
  }
  return depth;
}

void AttentionSteps::plant(View& view, const int64_t* parents) {
  view.depth = tree_depths(parents, view.rows);
  for (int64_t r = 0; r < view.rows; ++r) {
    const int64_t parent = parents[r];
    view.path_at.push_back(static_cast<int64_t>(view.paths.size()));
    for (int64_t i = 0; r && i <= view.depth[parent]; ++i) view.paths.push_back(view.paths[view.path_at[parent] + i]);
    view.paths.push_back(view.start + r - view.origin);
  }
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
  const int64_t at = from_origin(view, layer, p.kv);
  uint16_t* k = shared_ + into.at + 2 * p.kv * into.size;
  amx_pack_block(view.k + at, view.v + at, first_key(view.start) - view.origin, view.start + view.rows - view.origin,
                 p.block, D_, k, k + into.size);
}

void AttentionSteps::rope(int64_t layer, const float* q, const float* k, const float* v, const float* cos,
                          const float* sin, float* q_rot, int64_t t0, int64_t t1) const {
  for (int64_t t = t0; t < t1; ++t) {
    const View& view = views_[row_view_[t]];
    const int64_t pos = view.start + t - view.row0;  // its slot: the position of a chain's row, not a tree's
    float *k_cache = view.k + layer * view.layer_size, *v_cache = view.v + layer * view.layer_size;
    for (int64_t h = 0; h < H_; ++h) ::rope(q + (t * H_ + h) * D_, cos + t * D_, sin + t * D_, q_rot + (t * H_ + h) * D_, D_);
    const int64_t slot = view.ring ? pos % view.ring : pos;
    for (int64_t h = 0; h < H_kv_; ++h) {
      float *key = k_cache + (h * view.S + slot) * D_, *value = v_cache + (h * view.S + slot) * D_;
      ::rope(k + (t * H_kv_ + h) * D_, cos + t * D_, sin + t * D_, key, D_);
      std::copy(v + (t * H_kv_ + h) * D_, v + (t * H_kv_ + h + 1) * D_, value);
      if (view.ring) {  // and its mirror R slots on
        std::copy(key, key + D_, key + view.ring * D_);
        std::copy(value, value + D_, value + view.ring * D_);
      }
    }
  }
}

void AttentionSteps::attend(int64_t layer, int64_t i, const float* q_rot, float* out, std::vector<float>& scores) const {
  const Item& item = items_[i];
  const View& view = views_[item.view];
  const int64_t group = H_ / H_kv_;
  thread_local std::vector<AttentionRow> rows;  // reused: a step runs tens of items per thread
  rows.clear();
  for (int64_t r = item.first; r < item.first + item.count; ++r) {
    const int64_t t = view.row0 + r / group, h = item.kv * group + r % group;
    const int64_t pos = view.position(r / group);  // keys counted from the view's origin
    const int64_t* tail = view.depth.empty() ? nullptr : view.paths.data() + view.path_at[r / group];
    rows.push_back(AttentionRow{q_rot + (t * H_ + h) * D_, first_key(pos) - view.origin, pos - view.origin,
                                out + (t * H_ + h) * D_, tail, view.start - view.origin});
  }
  const int64_t at = from_origin(view, layer, item.kv);
  const float scale = scale_;
  if (amx_) {
    const Packed& from = packed_[item.view];
    thread_local std::vector<uint16_t> own;
    if (from.at < 0) {  // this item is all of its kv head's rows: it packs their keys and values itself
      own.resize(std::max<size_t>(own.size(), 2 * from.size));
      const int64_t first = first_key(view.start) - view.origin, end = view.start + view.rows - view.origin;
      for (int64_t b = 0; b < from.size / D_ / 32; ++b)
        amx_pack_block(view.k + at, view.v + at, first, end, b, D_, own.data(), own.data() + from.size);
    }
    const uint16_t* k = from.at < 0 ? own.data() : shared_ + from.at + 2 * item.kv * from.size;
    amx_attend_rows(rows, k, k + from.size, D_, scale);
  } else if (wide_) {
    attend_rows_avx512(rows, view.k + at, view.v + at, D_, scale, scores);
  } else {
    attend_rows_avx2(rows, view.k + at, view.v + at, D_, scale, scores);
  }
}

void attend_steps(const AttentionSteps& steps, int64_t layer, const float* q, const float* k, const float* v,
                  const float* cos, const float* sin, float* q_rot, float* out, int64_t T) {
  const int64_t H = steps.heads(), H_kv = steps.kv_heads(), D = steps.head_dim();
  // Each row on its own (a batch's rows split between the threads: none waits while one rotates).
  const int64_t per_row = (H + 2 * H_kv) * D;
  parallel_for(0, T, std::max<int64_t>(1, 8192 / per_row), [&](int64_t t0, int64_t t1) {
    steps.rope(layer, q, k, v, cos, sin, q_rot, t0, t1);
  });
  parallel_for(0, steps.packs(), 1, [&](int64_t i0, int64_t i1) {  // none unless the attention runs on AMX
    for (int64_t i = i0; i < i1; ++i) steps.pack(layer, i);
  });
  std::atomic<int64_t> next{0};
  const int64_t n_items = steps.items();
  parallel_for(0, std::min<int64_t>(kernel_threads(), n_items), 1, [&](int64_t, int64_t) {
    std::vector<float> scores;
    for (int64_t i = next++; i < n_items; i = next++) steps.attend(layer, i, q_rot, out, scores);
  });
}
