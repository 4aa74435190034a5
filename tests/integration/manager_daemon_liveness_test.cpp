// Liveness is progress, and the loop never waits on the store: the
// ManagerDaemon in-process on its own event loop, FlakyLauncher's fake agents
// and FakeWorkers that heartbeat (step, waiting) and report steps
// (manager_daemon_fakes.h). A generation whose steps stall is hung
// (--hang_timeout_s) and the rank computing while its peers wait is named; a
// slow checkpoint store delays no ping and no heartbeat.
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

TEST_CASE("daemon: a generation whose steps stall is hung; the rank computing while its peers wait is named",
          "[daemon][liveness]") {
  LivenessFixture f("daemon_hang", 3, [](JobConfig& c) {
    c.hangTimeoutS = 1;
    c.startupTimeoutS = 60;
  });
  const int generation = f.launchedGeneration();
  std::vector<std::unique_ptr<FakeWorker>> workers;
  for (int rank = 0; rank < 3; ++rank) {
    workers.push_back(std::make_unique<FakeWorker>(f.address(), f.token(), rank, generation));
  }
  // Before the first step (rendezvous, loading) the startup timeout applies, not the hang timeout.
  f.runFor(2000ms);
  CHECK(f.events("hang").empty());
  // Steps advancing: alive, however long it runs.
  for (auto& w : workers) w->advancing = true;
  f.runFor(2500ms);
  CHECK(f.events("hang").empty());
  CHECK(workers[1]->step() >= 5);
  // Rank 1 stops finishing steps while computing; ranks 0 and 2 wait on it.
  workers[0]->waiting = true;
  workers[2]->waiting = true;
  for (auto& w : workers) w->advancing = false;
  const auto stalledAt = std::chrono::steady_clock::now();
  REQUIRE(f.runUntil([&] { return !f.events("hang").empty(); }, 5000ms));
  const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - stalledAt).count();
  INFO("hang declared " << after << " s after the last step");
  CHECK(after >= 0.7);  // the timeout (1 s) from the last step, up to 0.2 s before the stall
  CHECK(after < 2.5);
  const auto hang = f.events("hang").front();
  REQUIRE(hang["ranks"].size() == 1);
  CHECK(hang["ranks"][0]["rank"] == 1);
  CHECK(hang["ranks"][0]["step"] == workers[1]->step());
  CHECK(hang["ranks"][0]["waiting"] == false);
  CHECK(hang["stalled_s"].get<double>() >= 1.0);
  CHECK(hang["before_first_step"] == false);
  CHECK(hang["waiting_ranks"] == nlohmann::json{0, 2});
  CHECK_THAT(hang["reason"].get<std::string>(), Catch::Contains("rank(s) 1 on 127.0.0.1") &&
                                                     Catch::Contains("--hang_timeout_s 1"));
  // Handled as a hung worker: rank 1 is ordered out, every worker killed,
  // the job relaunched (here, with no checkpoint, from the start).
  REQUIRE(f.runUntil([&] { return workers[1]->exitOrdered(); }, 2000ms));
  REQUIRE(f.runUntil([&] { return f.events("launch").size() == 2; }, 5000ms));
  CHECK_THAT(f.events("kill_all").front()["reason"].get<std::string>(), Catch::Contains("rank(s) 1 on 127.0.0.1"));
  CHECK(f.events("worker_hung").empty());  // its heartbeats never stopped
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("daemon: a stall where no rank waits names every rank; hang_timeout_s 0 turns it off",
          "[daemon][liveness]") {
  for (const double timeout : {1.0, 0.0}) {
    INFO("hang_timeout_s " << timeout);
    LivenessFixture f(timeout > 0 ? "daemon_hang_all" : "daemon_hang_off", 2, [timeout](JobConfig& c) {
      c.hangTimeoutS = timeout;
      c.startupTimeoutS = 60;
    });
    const int generation = f.launchedGeneration();
    FakeWorker a(f.address(), f.token(), 0, generation), b(f.address(), f.token(), 1, generation);
    a.advancing = b.advancing = true;
    REQUIRE(f.runUntil([&] { return a.step() >= 3 && b.step() >= 3; }));
    a.advancing = b.advancing = false;
    if (timeout > 0) {
      REQUIRE(f.runUntil([&] { return !f.events("hang").empty(); }, 5000ms));
      CHECK(f.events("hang").front()["ranks"].size() == 2);
      CHECK_THAT(f.events("hang").front()["reason"].get<std::string>(),
                 Catch::Contains("none of the ranks waits on a peer"));
    } else {
      f.runFor(2500ms);
      CHECK(f.events("hang").empty());
    }
  }
}

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
