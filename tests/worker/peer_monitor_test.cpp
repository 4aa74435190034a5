// PeerMonitor's heartbeats in the rendezvous store: a rank whose store
// answers fail for a while (a slow or briefly unreachable store host) keeps
// beating once the store answers again, instead of falling silent for good
// and being named as the lost peer by the next diagnosis.
// libtorch's headers (through comm.h) define a CHECK of their own: Catch2's
// comes after them.
#include "comm/comm.h"

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

// A diagnosis waits a few heartbeat intervals to see which rank fell silent.
// When run_varuna has already stopped the generation for a salvage
// (Communicator::interrupt), that wait is on the salvage's path: interrupt()
// ends it, and the diagnosis says it was interrupted instead of naming a rank.
TEST_CASE("peer monitor: interrupt() ends a diagnosis's wait for heartbeats", "[peer_monitor]") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  // Rank 1 never beats. Not interrupted, the diagnosis would return after 4
  // intervals (20 s) naming rank 1 as lost, which the checks below refuse.
  PeerMonitor monitor(store, /*rank=*/0, /*worldSize=*/2, 5s,
                      [](int rank) { return std::to_string(rank); });
  std::thread interrupter([&] {
    std::this_thread::sleep_for(100ms);  // (the interruption may come before the wait or during it: both must end it)
    monitor.interrupt();
  });
  const PeerLostError lost = monitor.diagnose("testing", "connection reset");
  interrupter.join();
  CHECK(lost.lostRank() == -1);
  CHECK(std::string(lost.what()).find("diagnosis interrupted") != std::string::npos);
  // Later diagnoses do not wait either.
  CHECK(std::string(monitor.diagnose("testing again", "reset").what()).find("interrupted") != std::string::npos);
}
