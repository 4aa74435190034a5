// HostMemory (worker/src/device/host_memory.h): compact gives large host blocks
// their own mappings, which go back to the system when freed; fast changes
// nothing; a MALLOC_MMAP_THRESHOLD_ the user set is kept. A process of its
// own: the setting is process-wide.
#include "device/host_memory.h"

#include <malloc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <catch2/catch.hpp>

using namespace varuna;

namespace {

size_t mappedBytes() { return mallinfo2().hblkhd; }

// Allocates and touches a block the compiler cannot elide (an unused
// malloc/memset/free is removed at -O2).
void* volatile gSink = nullptr;
void* touchedBlock(size_t size) {
  void* block = std::malloc(size);
  REQUIRE(block != nullptr);
  std::memset(block, 1, size);
  gSink = block;
  return block;
}

// A block over the compact threshold (4 MiB) that the heap's free memory
// cannot hold (the thresholds only decide how the allocator grows: a free
// chunk that fits is used first), under glibc's dynamic maximum (32 MiB).
size_t blockSize() { return std::max<size_t>(6 << 20, mallinfo2().fordblks + (1 << 20)); }

// Whether a large block, allocated after one of its size was freed, lives in
// a mapping of its own. glibc's default raises its threshold to the size of
// a freed mapped block, so the second block comes from the heap.
bool secondBlockIsMapped() {
  const size_t size = blockSize();
  std::free(touchedBlock(size));
  const size_t before = mappedBytes();
  void* second = touchedBlock(size);
  const bool mapped = mappedBytes() >= before + size;
  std::free(second);
  return mapped;
}

}  // namespace

TEST_CASE("fast leaves glibc's allocator as it is", "[host_memory]") {
  REQUIRE(::unsetenv("MALLOC_MMAP_THRESHOLD_") == 0);
  CHECK(applyHostMemory(HostMemory::kFast).find("default allocator") != std::string::npos);
  CHECK_FALSE(secondBlockIsMapped());
}

TEST_CASE("a threshold set in the environment is kept", "[host_memory]") {
  REQUIRE(::setenv("MALLOC_MMAP_THRESHOLD_", "1", 1) == 0);  // read by glibc at start-up only: nothing changes
  CHECK(applyHostMemory(HostMemory::kCompact).find("is kept") != std::string::npos);
  CHECK_FALSE(secondBlockIsMapped());
  REQUIRE(::unsetenv("MALLOC_MMAP_THRESHOLD_") == 0);
}

TEST_CASE("compact maps large blocks by themselves and returns them when freed", "[host_memory]") {
  REQUIRE(::unsetenv("MALLOC_MMAP_THRESHOLD_") == 0);
  CHECK(applyHostMemory(HostMemory::kCompact).find("compact (") != std::string::npos);
  CHECK(secondBlockIsMapped());
  const size_t size = blockSize();
  const size_t before = mappedBytes();
  void* block = touchedBlock(size);
  CHECK(mappedBytes() >= before + size);
  std::free(block);
  CHECK(mappedBytes() == before);  // unmapped at once
}
