// Group-wise W8A8 dot products' entry point (int8_group.h has the arithmetic): int8_group_dot runs the path's loops
// (int8_group_avx2.cpp, int8_group_avx512.cpp).
#include "int8_dot.h"
#include "int8_group.h"

void int8_group_dot(Int8Path path, const int8_t* q, const uint8_t* u, const float* x_scale, const int8_t* w,
                    const float* w_scale, float* out, int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0,
                    int64_t n1) {
  switch (path) {
    case Int8Path::Maddubs: return int8_group_maddubs(q, x_scale, w, w_scale, out, M, N, K, G, n0, n1);
    case Int8Path::DpbusdEmulated: return int8_group_dpbusd_emulated(u, x_scale, w, w_scale, out, M, N, K, G, n0, n1);
    case Int8Path::Dpbusd: return int8_group_dpbusd(u, x_scale, w, w_scale, out, M, N, K, G, n0, n1);
  }
}
