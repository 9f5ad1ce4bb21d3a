// The float-activation linears' entry points (float_dot.h has the arithmetic): float_act_dot and packed_dot pick
// the instruction set's loops for the float path (float_dot_avx2.cpp, float_dot_avx512.cpp, float_amx.cpp), flush
// denormals where FMAs stand in for vdpbf16ps, and add the scale and bias; round_bf16_to rounds x for bf16_linear.
#include "float_dot.h"
#include "kernel_ops.h"
#include "float_amx.h"
#include "cpu.h"

#include <immintrin.h>

namespace {

// vdpbf16ps treats denormal inputs as zero and flushes denormal results to zero: the FMAs that stand in for
// it do the same while this lives (DAZ and FTZ in this thread's MXCSR, restored after).
struct FlushDenormals {
  const unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

template <typename W>
void act32_dot(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  const FloatPath path = current_float_path();
  parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (path != FloatPath::Avx2) return act32_avx512(x, w, y, M, N, K, n0, n1);
    act32_avx2(x, w, y, M, N, K, n0, n1);
  });
}

// y [M, N] = (y * scale[n]) + bias[n], each step rounded to float32 (scale, bias may be null).
void epilogue(float* y, int64_t M, int64_t N, const float* sp, const float* bp) {
  if (!sp && !bp) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float v = y[m * N + n];
      if (sp) v = v * sp[n];
      if (bp) v = v + bp[n];
      y[m * N + n] = v;
    }
}

}  // namespace

void float_act_dot(const float* x, const void* w, WeightType type, const float* scale, const float* bias, float* y,
                   int64_t M, int64_t N, int64_t K) {
  if (type == WeightType::Int8)
    act32_dot(x, static_cast<const int8_t*>(w), y, M, N, K);
  else if (type == WeightType::Float32)
    act32_dot(x, static_cast<const float*>(w), y, M, N, K);
  else
    act32_dot(x, static_cast<const uint16_t*>(w), y, M, N, K);
  epilogue(y, M, N, scale, bias);
}

namespace {

// Whether the bf16 products of the current path take x rounded as float32 numbers (the avx512 path's FMAs) rather
// than as bfloat16 bits (the tiles, vdpbf16ps, AVX2): the amx path's tiles take K in whole tiles only.
bool amx_takes(int64_t K) { return current_float_path() == FloatPath::Amx && K % 32 == 0; }
bool rounded_as_float(int64_t K) { return !amx_takes(K) && lanes_path() == FloatPath::Avx512; }

}  // namespace

void packed_dot(const void* x, const void* w, bool pairs, bool bf16, const float* bias, float* yp, int64_t M, int64_t N,
                int64_t K) {
  const int64_t P = N / 16;
  const bool widened = !pairs && bf16;
  // The amx path's tiles take bf16 pairs where K is whole tiles; what they do not take runs as on the avx512 path.
  const bool amx = pairs && amx_takes(K);
  const FloatPath path = lanes_path();
  // x rounded to bfloat16: as float32 for the AVX-512 FMAs, as bfloat16 bits for the tiles, vdpbf16ps and AVX2
  const float* xf = pairs && rounded_as_float(K) ? static_cast<const float*>(x) : nullptr;
  const uint16_t* xb = pairs && !xf ? static_cast<const uint16_t*>(x) : nullptr;
  const float* xp = pairs ? nullptr : static_cast<const float*>(x);
  const uint16_t* w16 = bf16 ? static_cast<const uint16_t*>(w) : nullptr;
  const float* w32 = bf16 ? nullptr : static_cast<const float*>(w);
  parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    if (amx) return amx_bf16_panels(xb, w16, yp, M, N, K, p0, p1);
    if (pairs) {
      if (path == FloatPath::Avx512Bf16) return bf16_panels_avx512bf16(xb, w16, yp, M, N, K, p0, p1);
      const FlushDenormals as_vdpbf16ps;
      if (path == FloatPath::Avx512) return bf16_panels_avx512(xf, w16, yp, M, N, K, p0, p1);
      return bf16_panels_avx2(xb, w16, yp, M, N, K, p0, p1);
    }
    if (path != FloatPath::Avx2)
      return widened ? fp32_panels_avx512(xp, w16, yp, M, N, K, p0, p1)
                     : fp32_panels_avx512(xp, w32, yp, M, N, K, p0, p1);
    return widened ? fp32_panels_avx2(xp, w16, yp, M, N, K, p0, p1) : fp32_panels_avx2(xp, w32, yp, M, N, K, p0, p1);
  });
  epilogue(yp, M, N, nullptr, bias);
}

bool bf16_rounded_as_float(int64_t K) { return rounded_as_float(K); }

void round_bf16_to(const float* x, int64_t count, void* out, bool as_float) {
  if (as_float)
    float_dot::round_bf16(x, count, static_cast<float*>(out));
  else
    float_dot::round_bf16(x, count, static_cast<uint16_t*>(out));
}
