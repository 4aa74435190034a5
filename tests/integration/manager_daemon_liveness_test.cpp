// The loop never waits on the store, on the real clock: the ManagerDaemon
// in-process on its own event loop, FlakyLauncher's fake agents and a
// FakeWorker that heartbeats and reports steps (manager_daemon_fakes.h),
// while a store scan stalls its thread for seconds of real time; a fake clock
// would hold still while it does. The hang cases run on a fake clock:
// tests/unit/daemon_liveness_test.cpp.
#include <catch2/catch.hpp>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon_harness.h"
#include "manager_daemon_fakes.h"

using namespace varuna;
using namespace std::chrono_literals;
using test::FakeWorker;

namespace {

// One host with `slots` ranks (one stage, a replica per slot) on FlakyLauncher's
// agents (they heartbeat and answer orders), and a store scan of the test's choosing.
struct LivenessFixture : test::DaemonHarness {
  LivenessFixture(const std::string& name, int slots, const std::function<void(JobConfig&)>& tweak,
                  StoreScanner scanner = {})
      : DaemonHarness(name, 10000ms) {
    test::writeMachineList(dir / "machines.txt", {"127.0.0.1"}, slots);
    JobConfig config = test::daemonTestConfig(dir, "daemon-test", slots);
    config.restartBackoffS = 0.05;
    if (tweak) tweak(config);
    startDaemon(config, std::make_unique<test::FlakyLauncher>(), {}, std::move(scanner));
  }

  // The generation of the newest launch, once there is one.
  int launchedGeneration() {
    REQUIRE(runUntil([&] { return !events("launch").empty(); }));
    return events("launch").back()["generation"].get<int>();
  }
};

}  // namespace

TEST_CASE("daemon: a slow checkpoint store never delays a ping or a heartbeat", "[daemon][liveness]") {
  // The store on a stalled network filesystem: every scan takes 2 s once `slow`.
  auto slow = std::make_shared<std::atomic<bool>>(false);
  auto scanning = std::make_shared<std::atomic<bool>>(false);
  auto scans = std::make_shared<std::atomic<int>>(0);
  StoreScanner scanner = [slow, scanning, scans](const StoreScanRequest& request) {
    ++*scans;
    *scanning = true;
    const auto until = std::chrono::steady_clock::now() + 2s;
    while (*slow && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
    *scanning = false;
    return scanCheckpointStore(request);
  };
  LivenessFixture f("daemon_slow_store", 1, [](JobConfig& c) { c.heartbeatTimeoutS = 1; }, scanner);
  const int generation = f.launchedGeneration();
  FakeWorker worker(f.address(), f.token(), 0, generation);
  worker.advancing = true;
  REQUIRE(f.runUntil([&] { return worker.step() >= 2; }));
  *slow = true;
  const int scansBefore = *scans;
  REQUIRE(f.runUntil([&] { return scanning->load(); }, 3000ms));  // the next periodic scan is stuck
  worker.requestPing();
  REQUIRE(f.runUntil([&] { return worker.pongAfterMs() >= 0; }, 3000ms));
  CHECK(scanning->load());  // answered while the scan still hangs
  CHECK(worker.pongAfterMs() < 500);
  // Heartbeats keep being read meanwhile: the 1 s heartbeat timeout never fires,
  // and the steps keep being counted.
  const int64_t stepBefore = worker.step();
  f.runFor(3000ms);
  CHECK(f.events("worker_hung").empty());
  CHECK(worker.step() > stepBefore);
  CHECK_FALSE(worker.exitOrdered());
  CHECK(*scans - scansBefore <= 3);  // one scan at a time, not one queued per second
  CHECK(f.daemon->handlerFailures() == 0);
  *slow = false;  // lets the scan under way end, so the daemon's destruction does not wait for it
}
