// Large kernel results on memory the process has already touched.
//
// A forward asks for the same result sizes layer after layer, and a long prefill's MLP results are tens of MB. glibc hands out blocks above its mmap threshold (32 MB at most, unless
// the user tunes it) as fresh mappings and unmaps them at free, so each of those results page-faults on its first
// write, a zeroed page at a time, a real share of a prefill (docs/kernels.md). Here a dead result's block of 1 MB or more is kept and handed to the
// next result of the same byte size; the blocks least recently given back are freed once more than kKept bytes
// wait. Nothing else changes: a result is written whole by its kernel before anyone reads it.
#include "kernel_ops.h"

#include <cstdlib>
#include <list>
#include <mutex>
#include <utility>

namespace {

constexpr size_t kSmallest = size_t{1} << 20;  // below this malloc reuses its own blocks
constexpr size_t kKept = size_t{512} << 20;    // bytes of dead results kept at most
constexpr size_t kAlign = 64;                  // a cache line: AVX-512 rows and AMX tiles start on one

struct Blocks {
  std::mutex lock;
  std::list<std::pair<size_t, void*>> idle;  // (bytes, block), most recently given back first
  size_t kept = 0;
};

// Never destroyed: results may die after static destructors have run.
Blocks& blocks() {
  static Blocks* b = new Blocks;
  return *b;
}

void free_all(std::list<std::pair<size_t, void*>>& blocks) {
  for (auto& [size, p] : blocks) std::free(p);
}

}  // namespace

void* take_block(size_t bytes) {
  Blocks& b = blocks();
  {
    std::lock_guard<std::mutex> guard(b.lock);
    for (auto it = b.idle.begin(); it != b.idle.end(); ++it)
      if (it->first == bytes) {
        void* block = it->second;
        b.kept -= bytes;
        b.idle.erase(it);
        return block;
      }
  }
  void* block = std::aligned_alloc(kAlign, bytes);
  KERNEL_CHECK(block, "out of memory: a kernel result of ", bytes, " bytes");
  return block;
}

void give_back(void* block, size_t bytes) {
  Blocks& b = blocks();
  std::list<std::pair<size_t, void*>> freed;
  {
    std::lock_guard<std::mutex> guard(b.lock);
    b.idle.emplace_front(bytes, block);
    b.kept += bytes;
    while (b.kept > kKept) {
      b.kept -= b.idle.back().first;
      freed.splice(freed.begin(), b.idle, std::prev(b.idle.end()));
    }
  }
  free_all(freed);
}

size_t pooled_size(size_t size) { return size < kSmallest ? 0 : (size + kAlign - 1) / kAlign * kAlign; }

int64_t release_results() {
  Blocks& b = blocks();
  std::list<std::pair<size_t, void*>> freed;
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> guard(b.lock);
    bytes = static_cast<int64_t>(b.kept);
    freed.splice(freed.begin(), b.idle);
    b.kept = 0;
  }
  free_all(freed);
  return bytes;
}
