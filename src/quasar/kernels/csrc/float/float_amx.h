// The bf16 verifier's linears on Intel AMX (float_amx.cpp), for float_dot.cpp's "amx" path.
#pragma once
#include <cstdint>

// Whether the CPU may run them: amx_bf16_usable() (cpu.h).
// The 64-byte operand of _tile_loadconfig (palette 1): each tile's rows and bytes a row (float_amx.cpp's linears and
// attention_amx.cpp each configure theirs).
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// y [M, N] float32 for panels [p0, p1) = x [M, K] bfloat16 bits times w packed [N/16, K/2, 16, 2], as
// tdpbf16ps sums them (K % 32 == 0). Row m of y depends on x[m] only.
void amx_bf16_panels(const uint16_t* x, const uint16_t* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0,
                     int64_t p1);
