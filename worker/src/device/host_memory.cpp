#include "device/host_memory.h"

#include <cstdlib>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace varuna {

namespace {

// The weight-gradient temporaries of a CPU backward pass (one matrix each,
// megabytes) are what glibc's dynamic threshold keeps in the heap once freed:
// a step's peak then depends on how they fragmented it (1.18x-1.39x the
// floor across runs of bench/memory). At 4 MiB they get their own mappings
// and the peak is what is live (1.16x-1.18x); the price is a page fault per
// 4 KiB of each such block, every time (about 18 % of a CPU step at
// d_model 1024, docs/python.md).
constexpr int kCompactMmapThreshold = 4 << 20;
constexpr int kCompactTrimThreshold = 32 << 20;

}  // namespace

std::string applyHostMemory(HostMemory mode) {
  if (mode == HostMemory::kFast) return "host memory: the C library's default allocator";
#if defined(__GLIBC__)
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr) {
    return "host memory: compact asked for, but MALLOC_MMAP_THRESHOLD_ is set in the environment and is kept";
  }
  if (mallopt(M_MMAP_THRESHOLD, kCompactMmapThreshold) != 1 || mallopt(M_TRIM_THRESHOLD, kCompactTrimThreshold) != 1) {
    return "host memory: compact asked for, but glibc refused the thresholds; the default allocator stays";
  }
  return "host memory: compact (blocks of 4 MiB and more are returned to the system when freed)";
#else
  return "host memory: compact asked for, but this C library is not glibc; its default allocator stays";
#endif
}

}  // namespace varuna
