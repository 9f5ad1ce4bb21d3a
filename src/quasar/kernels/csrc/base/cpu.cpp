// The CPU's features and the kernel paths' settings (cpu.h): detection asked once per process, then three atomic
// slots the kernels read with relaxed loads (a setting is a whole value; no kernel needs it ordered with others).
#include "cpu.h"
#include "targets.h"


#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>

namespace {

// "a, b, c"
std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

namespace {

bool supports_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 24 & 1) && (d >> 22 & 1);  // AMX-TILE, AMX-BF16
}

// Linux keeps the 8 KB tile state off until a process asks for it (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool tiles_granted() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

}  // namespace

bool cpu_has_avx512() {
  static const bool has = supports_avx512();
  return has;
}

bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}

bool cpu_has_avx512_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

bool cpu_is_amd() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd");
  }();
  return amd;
}

bool amx_bf16_usable() {
  static const bool usable = cpu_has_amx_bf16() && tiles_granted();
  return usable;
}

// ---- int8 path --------------------------------------------------------------------------------------------------

std::vector<std::string> int8_paths() {
  std::vector<std::string> paths;
  if (cpu_has_avx512_vnni()) paths.push_back("dpbusd");
  paths.push_back("maddubs");
  paths.push_back("dpbusd-emulated");
  return paths;
}

Int8Path parse_int8_path(const std::string& name) {
  const auto paths = int8_paths();
  const std::string chosen = name == "auto" ? paths.front() : name;
  KERNEL_CHECK(std::find(paths.begin(), paths.end(), chosen) != paths.end(), "int8 path '", name,
              "' is not available on this CPU; available: auto, ", joined(paths));
  if (chosen == "dpbusd") return Int8Path::Dpbusd;
  if (chosen == "dpbusd-emulated") return Int8Path::DpbusdEmulated;
  return Int8Path::Maddubs;
}

namespace {

// The path every W8A8 linear runs on: the fastest this CPU has, unless a benchmark chose another (to
// measure on this machine what a CPU without VNNI would run; every path gives the same results).
std::atomic<int>& int8_path_slot() {
  static std::atomic<int> slot{static_cast<int>(parse_int8_path("auto"))};
  return slot;
}

}  // namespace

Int8Path linear_path() { return static_cast<Int8Path>(int8_path_slot().load(std::memory_order_relaxed)); }

std::string int8_path() {
  const Int8Path p = linear_path();
  return p == Int8Path::Dpbusd ? "dpbusd" : p == Int8Path::Maddubs ? "maddubs" : "dpbusd-emulated";
}

std::string use_int8_path(const std::string& name) {
  const Int8Path chosen = parse_int8_path(name);
  int8_path_slot().store(static_cast<int>(chosen));
  return int8_path();
}

// ---- float path -------------------------------------------------------------------------------------------------

// Seconds for n rounds of 24 independent chains of madd(acc, x) (pair_fma_faster's probe; compiled where both
// vdpbf16ps and the AVX-512 FMAs are allowed).
QUASAR_TARGET_PUSH(QUASAR_AVX512_BF16)
namespace {

template <typename X, typename F>
double chain_seconds(int64_t n, X x, F madd) {
  __m512 acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));  // distinct: no chain is merged
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
#pragma GCC unroll 24
    for (auto& a : acc) a = madd(a, x);
    __asm__ volatile("" : "+v"(x));  // opaque to the compiler: every round runs
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int i = 1; i < 24; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);  // every chain is used
  volatile float sink = _mm512_reduce_add_ps(acc[0]);
  (void)sink;
  return seconds;
}

double dpbf16_seconds(int64_t n) {
  return chain_seconds(n, (__m512bh)_mm512_set1_epi32(0x3F803F80), [](__m512 a, __m512bh x) { return _mm512_dpbf16_ps(a, x, x); });
}

double fma_seconds(int64_t n) {
  return chain_seconds(n, _mm512_set1_ps(1.0f), [](__m512 a, __m512 x) { return _mm512_fmadd_ps(x, x, a); });
}

}  // namespace
QUASAR_TARGET_POP

namespace {

// Whether two vfmadd231ps per bfloat16 pair (the avx512 path) outrun one vdpbf16ps on this CPU. They give the
// same floats; what differs between CPUs is the rate (docs/kernels.md has the figures): where vdpbf16ps issues
// at a fraction of vfmadd231ps's rate, the FMAs do more of its multiply-adds in the same time. A probe of both
// (well under 1 ms, once per process, best of three) decides; the FMAs also widen the weights, so they must do
// 1.25x its multiply-adds in peak to be picked.
bool pair_fma_faster() {
  double dpbf16 = 1e9, fma = 1e9;
  for (int round = 0; round < 3; ++round) {
    dpbf16 = std::min(dpbf16, dpbf16_seconds(10000));
    fma = std::min(fma, fma_seconds(10000));
  }
  return 2 * fma * 1.25 < dpbf16;  // a vdpbf16ps does the multiply-adds of two FMAs
}

// The paths this CPU runs, fastest first.
const std::vector<FloatPath>& available_paths() {
  static const std::vector<FloatPath> paths = [] {
    const bool avx512 = cpu_has_avx512();
    std::vector<FloatPath> found;
    if (avx512 && amx_bf16_usable()) found.push_back(FloatPath::Amx);
    if (cpu_has_avx512_bf16())
      for (FloatPath p : pair_fma_faster() ? std::vector{FloatPath::Avx512, FloatPath::Avx512Bf16}
                                           : std::vector{FloatPath::Avx512Bf16, FloatPath::Avx512})
        found.push_back(p);
    else if (avx512)
      found.push_back(FloatPath::Avx512);
    found.push_back(FloatPath::Avx2);
    return found;
  }();
  return paths;
}

const char* path_name(FloatPath p) {
  return p == FloatPath::Amx ? "amx" : p == FloatPath::Avx512Bf16 ? "avx512bf16" : p == FloatPath::Avx512 ? "avx512" : "avx2";
}

std::atomic<int>& float_path_slot() {
  static std::atomic<int> slot{static_cast<int>(available_paths().front())};
  return slot;
}

}  // namespace

FloatPath current_float_path() { return static_cast<FloatPath>(float_path_slot().load(std::memory_order_relaxed)); }

FloatPath lanes_path() { return current_float_path() == FloatPath::Amx ? FloatPath::Avx512 : current_float_path(); }

std::vector<std::string> float_paths() {
  std::vector<std::string> names;
  for (FloatPath p : available_paths()) names.push_back(path_name(p));
  return names;
}

std::string float_path() { return path_name(current_float_path()); }

std::string float_path_for(bool bf16_pairs) { return path_name(bf16_pairs ? current_float_path() : lanes_path()); }

bool float_path_avx512() { return current_float_path() != FloatPath::Avx2; }

std::string use_float_path(const std::string& name) {
  for (FloatPath p : available_paths())
    if (name == "auto" || name == path_name(p)) {
      float_path_slot().store(static_cast<int>(p));
      return path_name(p);
    }
  KERNEL_CHECK(false, "float path '", name, "' is not available on this CPU; available: auto, ", joined(float_paths()));
}

// ---- prefetch policy --------------------------------------------------------------------------------------------

namespace {

// The setting: a fixed policy, or "auto" (kAuto): the vendor's rule, per loop (prefetch_policy(rows, maddubs)).
constexpr int kAuto = 2;

std::atomic<int>& prefetch_slot() {
  static std::atomic<int> slot{kAuto};
  return slot;
}

}  // namespace

Prefetch prefetch_policy(int64_t rows, bool maddubs) {
  const int setting = prefetch_slot().load(std::memory_order_relaxed);
  if (setting != kAuto) return static_cast<Prefetch>(setting);
  if (!cpu_is_amd()) return Prefetch::L1;
  return maddubs && rows <= 1 ? Prefetch::L1 : Prefetch::L2;
}

Prefetch prefetch_policy() { return prefetch_policy(2, false); }

std::string prefetch() {
  const int setting = prefetch_slot().load(std::memory_order_relaxed);
  if (setting != kAuto) return setting == static_cast<int>(Prefetch::L2) ? "l2" : "l1";
  return cpu_is_amd() ? "auto: l2, l1 at one row on maddubs" : "auto: l1";
}

std::string use_prefetch(const std::string& name) {
  const bool automatic = name == "auto" || name.rfind("auto:", 0) == 0;  // what prefetch() says restores it
  KERNEL_CHECK(automatic || name == "l1" || name == "l2", "prefetch policy '", name, "' unknown; choose auto, l1 or l2");
  prefetch_slot().store(automatic ? kAuto : static_cast<int>(name == "l2" ? Prefetch::L2 : Prefetch::L1));
  return prefetch();
}
