// vpdpbusd on 512-bit registers, for the AVX-512 VNNI loops (int8_dot_avx512.cpp, int8_group_avx512.cpp,
// int8_panel_avx512.cpp, w4a8_avx512.cpp and w6a8_avx512.cpp).
//
// Written as inline assembly because GCC 12 compiles _mm512_dpbusd_epi32 in a loop with a register copy of the
// accumulator before and after each instruction, which cost a large share of the tile's throughput with the
// weights in cache. The instruction and its
// exact int32 result are the same.
#pragma once
#include <immintrin.h>
#include "targets.h"

QUASAR_TARGET_PUSH(QUASAR_AVX512_VNNI)
// acc[j] + sum_{i<4} uint8(u[4j+i]) * int8(s[4j+i]) for each of the 16 int32 lanes.
inline __m512i dpbusd512(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
QUASAR_TARGET_POP
