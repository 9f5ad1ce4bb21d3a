// What this CPU has and which kernel paths run on it (cpu.cpp): every question to the CPU (cpuid, the kernel's
// grant of the AMX tile state, the vendor, the probe of vdpbf16ps's rate) is asked here, once per process, and the
// three process-wide settings the kernels read (the int8 path, the float path, the prefetch policy) live here.
// Every path of a kind gives the same results (the bf16 products on AMX tiles aside: float_amx.cpp), so the
// settings change speed only; a benchmark may move them to run what another CPU kind runs.
#pragma once
#include "blocking.h"

#include <cstdint>
#include <string>
#include <vector>

// ---- features ----------------------------------------------------------------------------------------------------
bool cpu_has_avx512();       // AVX-512 F, BW, VL and DQ: the float and attention kernels' 512-bit paths
bool cpu_has_avx512_bf16();  // those and AVX512-BF16 (vdpbf16ps)
bool cpu_has_avx512_vnni();  // AVX-512 F, BW, VL and VNNI (vpdpbusd): the int8 kernels' dpbusd path
bool cpu_is_amd();           // the vendor, for the prefetch policy
// Whether this process may run AMX-BF16: the CPU has AMX-TILE and AMX-BF16 and Linux granted the tile state.
bool amx_bf16_usable();

// ---- the int8 path of the W8A8 linears ----------------------------------------------------------------------------
enum class Int8Path { Maddubs, DpbusdEmulated, Dpbusd };
// The paths this CPU runs, fastest first ("dpbusd" only with AVX-512 VNNI).
std::vector<std::string> int8_paths();
// "auto" (the fastest) or one of int8_paths(); anything else is an error that lists them.
Int8Path parse_int8_path(const std::string& name);
Int8Path linear_path();  // the path every W8A8 linear runs on now
std::string int8_path();  // its name
// Chooses the int8 path of every later W8A8 linear ("auto" or one of int8_paths()); returns its name.
std::string use_int8_path(const std::string& name);

// ---- the float path of the float-activation linears and of attention ----------------------------------------------
enum class FloatPath { Avx2, Avx512, Avx512Bf16, Amx };
FloatPath current_float_path();
std::vector<std::string> float_paths();  // this CPU's: "amx", "avx512bf16", "avx512", "avx2", fastest first
std::string use_float_path(const std::string& name);  // "auto" or one of float_paths(); returns its name
std::string float_path();  // the path float-activation linears run on now
// The path the products other than amx's tiles run on: amx's are avx512's.
FloatPath lanes_path();
std::string float_path_for(bool bf16_pairs);  // the path bf16_linear (true) or the other products run on now
bool float_path_avx512();  // whether that path has 512-bit registers (attention follows it)

// ---- the prefetch policy of the int8 weight loops -----------------------------------------------------------------
// The policy of a weight loop over `rows` rows (blocking.h says what each does): the one use_prefetch() fixed, or
// under "auto" L1 on Intel CPUs and L2 on AMD ones, except one row on the maddubs path. Without arguments: several
// rows.
Prefetch prefetch_policy(int64_t rows, bool maddubs);
Prefetch prefetch_policy();
// Chooses how the int8 weight loops prefetch ("auto", or "l1" or "l2" for every loop); returns prefetch(), which
// names the setting now (and is accepted back).
std::string use_prefetch(const std::string& name);
std::string prefetch();
