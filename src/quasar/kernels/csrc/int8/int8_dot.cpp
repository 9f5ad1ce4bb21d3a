// The exact int8 dot products' entry points (int8_dot.h has the arithmetic): int8_dot runs the path's loops
// (int8_dot_avx2.cpp, int8_dot_avx512.cpp) and prepare_rows makes what the dpbusd paths read.
#include "int8_dot.h"

void prepare_rows(Int8Path path, const int8_t* q, int64_t count, std::vector<uint8_t>& u) {
  if (path == Int8Path::Maddubs) return;
  u.resize(count);
  for (int64_t i = 0; i < count; ++i) u[i] = static_cast<uint8_t>(q[i]) ^ 0x80;  // x + 128
}

void int8_dot(Int8Path path, const int8_t* q, const uint8_t* u, const int8_t* w, int32_t* acc, int64_t M, int64_t N,
              int64_t K, int64_t n0, int64_t n1) {
  const Prefetch prefetch = prefetch_policy(M, path == Int8Path::Maddubs);
  switch (path) {
    case Int8Path::Maddubs: return int8_dot_maddubs(q, w, acc, M, N, K, n0, n1);
    case Int8Path::DpbusdEmulated: return int8_dot_dpbusd_emulated(prefetch, u, w, acc, M, N, K, n0, n1);
    case Int8Path::Dpbusd: return int8_dot_dpbusd(prefetch, u, w, acc, M, N, K, n0, n1);
  }
}
