// One start-up per host at a time, against the ManagerDaemon in-process on
// its own event loop and the real clock: SimCluster's agents and workers
// over loopback TCP (sim_daemon_harness.h), and a host's start-up held on
// its launch thread by SimHostLauncher (a slow SSH connection) while the loop
// and time go on, which a fake clock cannot show (it holds still while a
// start-up is under way). The other host cases run on a fake clock:
// tests/unit/daemon_hosts_test.cpp.
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "sim_daemon_harness.h"

using namespace varuna;
using namespace std::chrono_literals;

namespace {

const std::vector<std::string> kTwoHosts = {"127.0.0.1", "127.0.0.2"};

// Two hosts of one slot each, one replica per host, on SimCluster's agents
// and workers; lost hosts are retried after 0.3 s, doubling up to 5 s.
struct ReturnFixture : test::SimDaemonHarness {
  explicit ReturnFixture(const std::string& name, const std::function<void(JobConfig&)>& tweak = {})
      : SimDaemonHarness(name, 10000ms) {
    writeList();
    simulate(sim::fastSimOptions());
    startSimulated(test::hostReturnTestConfig(dir, tweak));
  }

  // The same text written again (truncated and rewritten in place).
  void writeList() { test::writeMachineList(dir / "machines.txt", kTwoHosts, 1); }
  // The hosts of the newest launch.
  std::vector<std::string> launchedOn() {
    const auto launches = events("launch");
    if (launches.empty()) return {};
    return launches.back()["plan"]["hosts"].get<std::vector<std::string>>();
  }
  bool hostBack(const std::string& host) {
    for (const auto& e : events("host_back")) {
      if (e["host"] == host) return true;
    }
    return false;
  }
};

}  // namespace

TEST_CASE("daemon: one start-up per host at a time; the loop is never blocked by one", "[daemon][hosts]") {
  ReturnFixture f("daemon_host_retry_one_at_a_time");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  f.launcher->hold("127.0.0.2");  // its next start-up hangs (a slow SSH connection)
  f.cluster->dropAgent("127.0.0.2", /*withWorkers=*/true);  // the agent goes away
  REQUIRE(f.runUntil([&] { return f.launcher->calls("127.0.0.2") == 2; }));
  REQUIRE(f.runUntil([&] { return f.state()["hosts"]["127.0.0.2"]["agent"] == "starting"; }));
  const auto out = f.state()["hosts"]["127.0.0.2"]["out"];
  CHECK(out["why"] == "lost");
  CHECK(out["back_when"] == "its agent is up");
  // A list write asks for a retry at once, and the backoff passes: still the one start-up.
  f.writeList();
  REQUIRE(f.runUntil([&] { return f.events("hosts_readmitted").size() == 1; }));
  f.runUntil([] { return false; }, 1000ms);  // the loop runs on meanwhile (state.json is written)
  CHECK(f.launcher->calls("127.0.0.2") == 2);
  CHECK(f.daemon->launchThreads() == 1);
  f.launcher->release("127.0.0.2");
  REQUIRE(f.runUntil([&] { return f.hostBack("127.0.0.2"); }));
  CHECK(f.launcher->calls("127.0.0.2") == 2);
  REQUIRE(f.runUntil([&] { return f.daemon->launchThreads() == 0; }));
}

