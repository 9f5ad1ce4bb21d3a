// The attention paths over the rows of one kv head, as attention.cpp's AttentionSteps calls them: float32 on AVX2
// (attention_avx2.cpp) or AVX-512 (attention_avx512.cpp), the same floats, and the bf16 verifier's on Intel AMX
// tiles (attention_amx.cpp).
#pragma once
#include <cstdint>
#include <vector>

// One query row of a kv head: its query (float32, D values), its first and last visible keys (first > 0 only in a
// sliding-window layer), where its output goes. A row of a draft tree sees the keys before its step in place and
// then its ancestors' (`tail`: key j >= tail_from is the one in slot tail[j - tail_from], slots >= keys), so that
// it reads the same keys, in the same order, as the same path verified as a chain, and gets the same floats.
struct AttentionRow {
  const float* q;
  int64_t first, last;
  float* out;
  const int64_t* tail = nullptr;
  int64_t tail_from = 0;
};

// The end of the keys a row reads in place: [first, in_place_end(r)), the rest (a tree row's tail) slot by slot.
inline int64_t in_place_end(const AttentionRow& r) {
  return r.tail && r.tail_from < r.last + 1 ? r.tail_from : r.last + 1;
}

// Rows sharing one kv head against keys first..last of each (keys, values [n, D] float32; scores: the caller's
// scratch): s_j = (q . k_j) * scale, e_j = exp(s_j - max s), out = (sum_j e_j v_j) / (sum_j e_j), in a fixed order
// from the row's first key, so a row's output never depends on the other rows. Keys before the rows' first are never
// read. The AVX-512 one needs D % 64 == 0.
void attend_rows_avx2(const std::vector<AttentionRow>& rows, const float* keys, const float* values, int64_t D,
                      float scale, std::vector<float>& scores);
void attend_rows_avx512(const std::vector<AttentionRow>& rows, const float* keys, const float* values, int64_t D,
                        float scale, std::vector<float>& scores);

// Whether a step's attention runs on the tiles: its linears take bfloat16 inputs (bf16_products: the bf16 verifier),
// the bf16 products run on AMX now (the float path "amx") and head_dim % 64 == 0. Every forward of a model asks
// this the same way, so its decode, verify and prefill steps agree.
bool bf16_attention(bool bf16_products, int64_t head_dim);

// Keys and values [32 b, 32 b + 32) of one kv head (float32 [n, D]; rows outside [first, end) are not read, and
// packed as 0) rounded to bfloat16 into the tiles amx_attend_rows reads: kp [n/16][D/32][16 pairs][16 keys][2] (keys
// as B tiles of Q K^T), vp [n/32][D/16][16 key pairs][16 dims][2] (values as B tiles of P V).
void amx_pack_block(const float* keys, const float* values, int64_t first, int64_t end, int64_t b, int64_t D,
                    uint16_t* kp, uint16_t* vp);

// Rows sharing one kv head (at most 32) against keys first..last of each, from the packed tiles, with bf16 products
// and float32 sums: s = bf16(q) . bf16(k_j), e_j = exp(s_j * scale - max), out = sum_j bf16(e_j) bf16(v_j) /
// sum_j e_j. Every output is the tile unit's function of its own row and the keys, dims walked from 0 and keys from
// the rows' first block of 32 in whole tiles (a row's keys outside first..last count 0 exactly, whole tiles of them
// add nothing), so a row gets the same floats alone (decode), in a verify step or in a prefill. Blocks before the
// rows' first need not be packed.
void amx_attend_rows(const std::vector<AttentionRow>& rows, const uint16_t* kp, const uint16_t* vp, int64_t D,
                     float scale);
