// PeerMonitor's heartbeats in the rendezvous store: a rank whose store
// answers fail for a while (a slow or briefly unreachable store host) keeps
// beating once the store answers again, instead of falling silent for good
// and being named as the lost peer by the next diagnosis.
// libtorch's headers (through comm.h) define a CHECK of their own: Catch2's
// comes after them.
#include "comm.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <catch2/catch.hpp>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

using namespace varuna;
using namespace std::chrono_literals;

namespace {

// A store whose `add` fails while `failing` is set, as a TCPStore's does on a
// timeout.
class FlakyStore : public c10d::HashStore {
 public:
  std::atomic<bool> failing{false};
  std::atomic<int> failedCalls{0};

  int64_t add(const std::string& key, int64_t value) override {
    if (failing.load()) {
      ++failedCalls;
      throw std::runtime_error("store timed out");
    }
    return c10d::HashStore::add(key, value);
  }
};

template <typename F>
bool waitUntil(F&& done, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

}  // namespace

TEST_CASE("peer monitor: a rank keeps beating after the store failed for a while", "[peer_monitor]") {
  auto store = c10::make_intrusive<FlakyStore>();
  PeerMonitor monitor(store, /*rank=*/1, /*worldSize=*/2, 10ms, [](int rank) { return std::to_string(rank); });
  auto beats = [&] { return monitor.readHeartbeats().at(1); };  // only while the store answers
  REQUIRE(waitUntil([&] { return beats() >= 3; }, 10s));
  store->failing = true;
  REQUIRE(waitUntil([&] { return store->failedCalls.load() >= 3; }, 10s));  // several failures in a row
  store->failing = false;
  const int64_t before = beats();
  // Back off at most 32 intervals (320 ms) after a failure, then beat on.
  CHECK(waitUntil([&] { return beats() >= before + 3; }, 10s));
}
