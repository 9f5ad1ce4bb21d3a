// The bf16 verifier's linears on Intel AMX (float_amx.cpp), for float_dot.cpp's "amx" path.
#pragma once
#include <cstdint>

// Whether this process may run AMX-BF16: the CPU has AMX-TILE and AMX-BF16 and the kernel granted the tile
// state (arch_prctl, asked once).
bool amx_bf16_usable();

// y [M, N] float32 for panels [p0, p1) = x [M, K] bfloat16 bits times w packed [N/16, K/2, 16, 2], as
// tdpbf16ps sums them (K % 32 == 0). Row m of y depends on x[m] only.
void amx_bf16_panels(const uint16_t* x, const uint16_t* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0,
                     int64_t p1);
