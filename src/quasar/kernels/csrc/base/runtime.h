// What a kernel file needs besides the CPU's own instructions, in plain C++: a failed check as an exception, and the
// threads. The kernel files include this instead of torch's headers (ATen's core header alone costs a translation unit
// about 4 s to compile); tensors.cpp takes the tensors, checks them and calls the kernels with their pointers and sizes.
#pragma once
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>

// Throws std::runtime_error (RuntimeError in Python) with the message's parts written one after another; they are
// evaluated only when the check fails.
#define KERNEL_CHECK(cond, ...)                                 \
  do {                                                          \
    if (!(cond)) ::kernel_runtime::fail(__VA_ARGS__);           \
  } while (0)

namespace kernel_runtime {

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}

// Whether this thread runs inside a parallel_for already (then a nested one runs inline).
inline bool& in_parallel() {
  static thread_local bool inside = false;
  return inside;
}

struct InParallel {
  bool before = in_parallel();
  InParallel() { in_parallel() = true; }
  ~InParallel() { in_parallel() = before; }
};

}  // namespace kernel_runtime

// The threads torch runs its operators on (torch.set_num_threads; tensors.cpp asks ATen).
int64_t kernel_threads();

// fn(b0, b1) over [begin, end) split between the threads in chunks of at least `grain`, as at::parallel_for
// splits it on its OpenMP backend (the same chunks, so the same work per thread); inline where there is one chunk,
// one thread, or the caller already runs inside a parallel region. The first exception a chunk throws is rethrown.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (begin >= end) return;
  const int64_t count = end - begin;
  if (count <= grain || count <= 1 || kernel_runtime::in_parallel() || omp_in_parallel() || kernel_threads() <= 1) {
    kernel_runtime::InParallel inside;
    fn(begin, end);
    return;
  }
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::exception_ptr error;
#pragma omp parallel
  {
    int64_t threads = omp_get_num_threads();
    if (grain > 0) threads = std::min(threads, (count + grain - 1) / grain);
    const int64_t chunk = (count + threads - 1) / threads, b0 = begin + omp_get_thread_num() * chunk;
    if (b0 < end) {
      try {
        kernel_runtime::InParallel inside;
        fn(b0, std::min(end, b0 + chunk));
      } catch (...) {
        if (!failed.test_and_set()) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}
