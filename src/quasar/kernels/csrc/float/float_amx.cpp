// The bf16 verifier's linears on Intel AMX: x [M, K] bfloat16 times bfloat16 weights packed in panels of 16
// channels ([N/16][K/2][16][2], float_dot.h's layout, which is already AMX's B-tile layout: a panel's 32
// inputs are one 16 x 64-byte tile), float32 sums in tiles of up to 16 rows x 16 channels by tdpbf16ps.
//
// tdpbf16ps sums differently from vdpbf16ps (most random outputs differ: docs/kernels.md), so this is a path of its own: its floats are not the other float paths' floats. What the verifier needs
// holds on it too: an output is the tile unit's function of its own row of x and its channel's weights (K
// always walks in steps of 32 from 0, whatever the tile's height), so a row's result does not depend on how
// many rows come with it (decode, verify and prefill give one row the same floats) or on which thread runs it
// (tested for every tile shape). A prefill of many rows runs at the tile unit's rate instead of the FMAs' (several
// times theirs); a decode step's one row gets tiles of one row, no padding, and streams its weights a little faster than the FMA path.
#include "float_amx.h"
#include "blocking.h"
#include "targets.h"

#include <immintrin.h>

#include <algorithm>

QUASAR_TARGET_PUSH(QUASAR_AMX_BF16)
namespace {

// Tiles 0-3: sums of (row tile r, panel c) at 2r + c; 4, 5: the row tiles' inputs; 6, 7: the panels' weights
// (16 rows of 64 bytes). Row tile 0 has rows0 rows, row tile 1 rows1 (16 and 16 in a block of 32 rows; fewer in
// the last block: a row's sums are the same whichever tile shape holds them).
void configure_tiles(int rows0, int rows1) {
  TileConfig config;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(rows[t]);
    config.colsb[t] = rows[t] ? 64 : 0;
  }
  _tile_loadconfig(&config);
}

// RT row tiles (from row m0) times PT panels (from p0) over all of K. STREAM: the weights come from memory, once
// (a step of at most 32 rows): each tile's bytes are also asked for kPrefetch ahead, which made a one-row pass
// faster than no prefetch or prefetches further ahead.
template <int RT, int PT, bool STREAM>
void tile_block(const uint16_t* x, const uint16_t* wp, float* y, int64_t m0, int64_t p0, int64_t N, int64_t K,
                int64_t k0, int64_t k1) {
  const uint16_t* a0 = x + m0 * K;
  const uint16_t* a1 = a0 + 16 * K;
  const uint16_t* b0 = wp + p0 * K * 16;
  const uint16_t* b1 = b0 + K * 16;
  const int64_t a_stride = K * 2;
  float* c = y + m0 * N + 16 * p0;
  const int64_t c_stride = N * 4;
  if (k0 == 0) {
    _tile_zero(0);
    if constexpr (PT == 2) _tile_zero(1);
    if constexpr (RT == 2) _tile_zero(2);
    if constexpr (RT == 2 && PT == 2) _tile_zero(3);
  } else {  // the sums of the chunks before, as stored
    _tile_loadd(0, c, c_stride);
    if constexpr (PT == 2) _tile_loadd(1, c + 16, c_stride);
    if constexpr (RT == 2) _tile_loadd(2, c + 16 * N, c_stride);
    if constexpr (RT == 2 && PT == 2) _tile_loadd(3, c + 16 * N + 16, c_stride);
  }
  for (int64_t k = k0; k < k1; k += 32) {
    if constexpr (STREAM) {
#pragma GCC unroll 16
      for (int line = 0; line < 16; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(b0 + k * 16) + kPrefetch + 64 * line, _MM_HINT_T0);
        if constexpr (PT == 2) _mm_prefetch(reinterpret_cast<const char*>(b1 + k * 16) + kPrefetch + 64 * line, _MM_HINT_T0);
      }
    }
    _tile_loadd(6, b0 + k * 16, 64);
    if constexpr (PT == 2) _tile_loadd(7, b1 + k * 16, 64);
    _tile_loadd(4, a0 + k, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_loadd(5, a1 + k, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (PT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, c_stride);
  if constexpr (PT == 2) _tile_stored(1, c + 16, c_stride);
  if constexpr (RT == 2) _tile_stored(2, c + 16 * N, c_stride);
  if constexpr (RT == 2 && PT == 2) _tile_stored(3, c + 16 * N + 16, c_stride);
}

// Rows [m0, m1) (blocks of 32, the last one maybe fewer) times panels [p0, p1): a block of kBlockPanels panels, K
// in chunks of kChunk inputs, so that a chunk of the block's weights (1 MB) stays in L2 while every row block
// passes; the sums go to y between chunks (a float stored and loaded is the same float). Without chunks a long-K
// block's weights fall out of L2 between row blocks (a large down projection ran markedly slower); the block and
// chunk sizes around these measured alike.
constexpr int64_t kBlockPanels = 32, kChunk = 1024;

template <bool STREAM>
void row_range(const uint16_t* x, const uint16_t* wp, float* y, int64_t m0, int64_t m1, int64_t N, int64_t K,
               int64_t p0, int64_t p1) {
  for (int64_t b = p0; b < p1; b += kBlockPanels) {
    const int64_t b1 = std::min(b + kBlockPanels, p1);
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t k1 = std::min(K, k0 + kChunk);
      for (int64_t m = m0; m < m1; m += 32) {
        const bool two_rows = m1 - m > 16;
        for (int64_t p = b; p < b1; p += 2) {
          const bool two_panels = p + 2 <= b1;
          if (two_rows && two_panels) tile_block<2, 2, STREAM>(x, wp, y, m, p, N, K, k0, k1);
          else if (two_rows) tile_block<2, 1, STREAM>(x, wp, y, m, p, N, K, k0, k1);
          else if (two_panels) tile_block<1, 2, STREAM>(x, wp, y, m, p, N, K, k0, k1);
          else tile_block<1, 1, STREAM>(x, wp, y, m, p, N, K, k0, k1);
        }
      }
    }
  }
}

}  // namespace

void amx_bf16_panels(const uint16_t* x, const uint16_t* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0,
                     int64_t p1) {
  const int64_t whole = M / 32 * 32, rest = M - whole;
  if (whole) {
    configure_tiles(16, 16);
    row_range<false>(x, wp, y, 0, whole, N, K, p0, p1);
  }
  if (rest) {  // the last rows, with tiles of their size (a decode step's one row: no padding rows to sum)
    configure_tiles(std::min<int>(16, rest), std::max<int>(0, rest - 16));
    if (whole) row_range<false>(x, wp, y, whole, M, N, K, p0, p1);
    else row_range<true>(x, wp, y, 0, M, N, K, p0, p1);
  }
  _tile_release();
}
QUASAR_TARGET_POP
