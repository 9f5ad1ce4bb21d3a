// The instruction sets the kernels compile regions for, beside the AVX2 + FMA baseline every file is built with
// (native.py's flags). A region is `QUASAR_TARGET_PUSH(QUASAR_...)` ... `QUASAR_TARGET_POP`, a single function
// `__attribute__((target(QUASAR_...)))`; such code runs only where cpu.h says the CPU has that set.
//
// GCC inlines a function only into a caller whose set contains the callee's, so the helpers every 512-bit region
// calls (simd_lanes.h, vnni.h) carry the smallest set they need, and each set below contains the ones it extends.
#pragma once

#define QUASAR_AVX512F "avx512f"                                       // simd_lanes.h's 16-lane helpers
#define QUASAR_AVX512 "avx512f,avx512bw,avx512vl,avx512dq"            // float linears and attention on 512 bits
#define QUASAR_AVX512_BF16 QUASAR_AVX512 ",avx512bf16"                // vdpbf16ps
#define QUASAR_AVX512_VNNI QUASAR_AVX512 ",avx512vnni"                // vpdpbusd (the int8 dpbusd path)
#define QUASAR_AMX_BF16 "amx-tile,amx-bf16"                            // the bf16 linears on AMX tiles
#define QUASAR_AMX_BF16_AVX512 QUASAR_AVX512_BF16 ",amx-tile,amx-bf16"  // the bf16 attention on AMX tiles

// A `#pragma GCC target` region for one of the sets above (the pragma itself takes no macro, _Pragma does).
#define QUASAR_PRAGMA(x) _Pragma(#x)
#define QUASAR_TARGET_PUSH(set) QUASAR_PRAGMA(GCC push_options) QUASAR_PRAGMA(GCC target(set))
#define QUASAR_TARGET_POP QUASAR_PRAGMA(GCC pop_options)
