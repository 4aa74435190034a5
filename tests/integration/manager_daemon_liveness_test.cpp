// The loop never waits on the store, on the real clock: the ManagerDaemon
// in-process on its own event loop, SimCluster's agent and worker over
// loopback TCP (sim_daemon_harness.h; the worker heartbeats over its own
// connection and reports steps), while a store scan stalls its thread for
// seconds of real time; a fake clock would hold still while it does. The
// hang cases run on a fake clock: tests/unit/daemon_liveness_test.cpp.
#include <catch2/catch.hpp>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "sim_daemon_harness.h"

using namespace varuna;
using namespace std::chrono_literals;
using sim::PeerKind;

namespace {

// One host with `slots` ranks (one stage, a replica per slot) on SimCluster's
// agent and workers (a step every 0.2 s, a heartbeat every 0.1 s straight to
// the manager), and a store scan of the test's choosing.
struct LivenessFixture : test::SimDaemonHarness {
  LivenessFixture(const std::string& name, int slots, const std::function<void(JobConfig&)>& tweak,
                  StoreScanner scanner = {})
      : SimDaemonHarness(name, 10000ms) {
    test::writeMachineList(dir / "machines.txt", {"127.0.0.1"}, slots);
    JobConfig config = test::daemonTestConfig(dir, "daemon-test", slots);
    config.restartBackoffS = 0.05;
    if (tweak) tweak(config);
    auto options = sim::fastSimOptions(/*step=*/200ms);
    options.beatsThroughAgent = false;  // each worker's beats on its own connection
    simulate(options);
    startSimulated(config, {}, std::move(scanner));
  }

  // The generation of the newest launch, once there is one.
  int launchedGeneration() {
    REQUIRE(runUntil([&] { return !events("launch").empty(); }));
    return events("launch").back()["generation"].get<int>();
  }
  size_t pongs() const { return cluster->count(PeerKind::kWorker, "pong"); }
};

double millisBetween(Clock::TimePoint a, Clock::TimePoint b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

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
  REQUIRE(f.runUntil([&] { return f.cluster->generation() == generation && f.cluster->step(0) >= 2; }));
  *slow = true;
  const int scansBefore = *scans;
  REQUIRE(f.runUntil([&] { return scanning->load(); }, 3000ms));  // the next periodic scan is stuck
  const size_t pongsBefore = f.pongs();
  const auto pingSentAt = f.now();
  REQUIRE(f.cluster->sendFromWorker(0, proto::encode(proto::Ping{1, 0})));
  REQUIRE(f.runUntil([&] { return f.pongs() > pongsBefore; }, 3000ms));
  CHECK(scanning->load());  // answered while the scan still hangs
  CHECK(millisBetween(pingSentAt, f.cluster->ordersTo(PeerKind::kWorker, "", "pong").back().at) < 500);
  // Heartbeats keep being read meanwhile: the 1 s heartbeat timeout never fires,
  // and the steps keep being counted.
  const int64_t stepBefore = f.cluster->step(0);
  f.runFor(3000ms);
  CHECK(f.events("worker_hung").empty());
  CHECK(f.cluster->step(0) > stepBefore);
  CHECK_FALSE(f.cluster->workerGot("exit_now", 0, generation));
  CHECK(*scans - scansBefore <= 3);  // one scan at a time, not one queued per second
  CHECK(f.daemon->handlerFailures() == 0);
  *slow = false;  // lets the scan under way end, so the daemon's destruction does not wait for it
}
