// Liveness is progress, against the ManagerDaemon in-process on a FakeClock
// with simulated agents and workers (sim_cluster.h) that heartbeat (step,
// waiting) and report steps: a generation whose steps stall is hung
// (--hang_timeout_s) and the rank computing while its peers wait is named.
// (A slow checkpoint store, which stalls a thread in real time while the loop
// must go on, stays on the real clock: tests/integration/manager_daemon_liveness_test.cpp.)
#include <catch2/catch.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "sim_daemon_harness.h"

using namespace varuna;
using namespace std::chrono_literals;

namespace {

// One host with `slots` ranks (one stage, a replica per slot). Every rank of
// the first generation starts with its progress frozen (connected, beating,
// no step: rendezvous or loading) until thawed.
struct LivenessFixture : test::SimDaemonHarness {
  int slots;

  LivenessFixture(const std::string& name, int slots, const std::function<void(JobConfig&)>& tweak)
      : SimDaemonHarness(name, 10000ms), slots(slots) {
    test::writeMachineList(dir / "machines.txt", {"127.0.0.1"}, slots);
    JobConfig config = test::daemonTestConfig(dir, "daemon-test", slots);
    config.restartBackoffS = 0.05;
    if (tweak) tweak(config);
    sim::SimOptions options;  // as a worker paces itself: a beat every 0.1 s, a step every 0.2 s
    options.tick = 5ms;
    options.agentHeartbeat = 200ms;
    options.workerHeartbeat = 100ms;
    options.step = 200ms;
    options.agentGrace = 1000ms;
    options.globalStore = config.globalStore;
    useFakeClock();  // and in-memory streams to the daemon: no socket
    sim::SimCluster::Callbacks callbacks;
    callbacks.onAllWorkersConnected = [this](int generation, int worldSize) {
      if (generation != 1) return;
      for (int rank = 0; rank < worldSize; ++rank) cluster->freezeProgress(rank);
    };
    simulate(options).setCallbacks(std::move(callbacks));
    startSimulated(config);
  }
  ~LivenessFixture() { CHECK(noSockets() == ""); }  // the whole test ran without a socket

  // Generation 1, every rank connected (progress frozen).
  void waitConnected() {
    REQUIRE(runUntil([&] { return cluster->generation() == 1 && cluster->connectedWorkers(1) == slots; }));
  }
  void advance(bool on) {
    for (int rank = 0; rank < slots; ++rank) on ? cluster->thawProgress(rank) : cluster->freezeProgress(rank);
  }
};

}  // namespace

TEST_CASE("daemon: a generation whose steps stall is hung; the rank computing while its peers wait is named",
          "[daemon][liveness]") {
  LivenessFixture f("daemon_hang", 3, [](JobConfig& c) {
    c.hangTimeoutS = 1;
    c.startupTimeoutS = 60;
  });
  f.waitConnected();
  // Before the first step (rendezvous, loading) the startup timeout applies, not the hang timeout.
  f.runFor(2000ms);
  CHECK(f.events("hang").empty());
  // Steps advancing: alive, however long it runs.
  f.advance(true);
  f.runFor(2500ms);
  CHECK(f.events("hang").empty());
  CHECK(f.cluster->step(1) >= 5);
  // Rank 1 stops finishing steps while computing; ranks 0 and 2 wait on it.
  f.cluster->freezeProgress(1);
  const auto stalledAt = f.now();
  const int64_t stuckStep = f.cluster->step(1);  // it finishes none while frozen (and it is gone once ordered out)
  REQUIRE(f.runUntil([&] { return !f.events("hang").empty(); }, 5000ms));
  const double after = std::chrono::duration<double>(f.now() - stalledAt).count();
  INFO("hang declared " << after << " s after the last step");
  CHECK(after >= 0.7);  // the timeout (1 s) from the last step, up to 0.2 s before the stall
  CHECK(after < 2.5);
  const auto hang = f.events("hang").front();
  REQUIRE(hang["ranks"].size() == 1);
  CHECK(hang["ranks"][0]["rank"] == 1);
  CHECK(hang["ranks"][0]["step"] == stuckStep);
  CHECK(hang["ranks"][0]["waiting"] == false);
  CHECK(hang["stalled_s"].get<double>() >= 1.0);
  CHECK(hang["before_first_step"] == false);
  CHECK(hang["waiting_ranks"] == nlohmann::json{0, 2});
  CHECK_THAT(hang["reason"].get<std::string>(), Catch::Contains("rank(s) 1 on 127.0.0.1") &&
                                                     Catch::Contains("--hang_timeout_s 1"));
  // Handled as a hung worker: rank 1 is ordered out, every worker killed,
  // the job relaunched (here, with no checkpoint, from the start).
  REQUIRE(f.runUntil([&] { return f.cluster->workerGot("exit_now", 1, 1); }, 2000ms));
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
    f.waitConnected();
    f.advance(true);
    REQUIRE(f.runUntil([&] { return f.cluster->step(0) >= 3 && f.cluster->step(1) >= 3; }));
    f.advance(false);  // both compute, neither waits
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
