// One start-up per host at a time, against the ManagerDaemon in-process on
// its own event loop and the real clock: SimCluster's agents and workers
// over loopback TCP (sim_daemon_harness.h), and a host's start-up held on
// its launch thread by SimHostLauncher (a slow SSH connection) while the loop
// and time go on, which a fake clock cannot show (it holds still while a
// start-up is under way). The other host cases run on a fake clock:
// tests/unit/daemon_hosts_test.cpp. Also: a notifier whose host's agent
// was replaced after its handshake (the revocation checked again).
#include <catch2/catch.hpp>
#include <atomic>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "sim_daemon_harness.h"
#include "varuna/common/certificate_credential.h"
#include "varuna/common/control_client.h"
#include "varuna/manager/credentials.h"

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


TEST_CASE("daemon: a notifier whose agent was replaced after its handshake has its notice refused",
          "[daemon][hosts][security]") {
  ReturnFixture f("daemon_notice_revoked_since");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  const std::string first = f.cluster->agentCredential("127.0.0.2");
  REQUIRE(tls::isCertificateCredential(first));
  // The notifier of the host's first agent start connects (its handshake and
  // hello accepted) and waits; meanwhile run_varuna replaces that agent.
  std::atomic<bool> ready{false}, go{false}, done{false};
  std::optional<proto::Message> answer;
  std::thread notifier([&, address = "127.0.0.1:" + std::to_string(f.daemon->port())] {
    try {
      auto client = proto::ControlClient::connectAs(
          address, 10s, {proto::kVersion, credentials::notifier(first), "notifier", "127.0.0.2", -1, -1});
      ready = true;
      while (!go) std::this_thread::sleep_for(10ms);
      client.send(proto::PreemptNotice{"127.0.0.2", 0}, 10s);
      answer = client.receive(10s);
    } catch (const std::exception&) {
    }
    done = true;
  });
  REQUIRE(f.runUntil([&] { return ready.load(); }));
  f.cluster->dropAgent("127.0.0.2", /*withWorkers=*/true);  // lost: its agent is started again
  const bool replaced = f.runUntil([&] {
    return f.cluster->agentCredential("127.0.0.2") != first && f.state()["hosts"]["127.0.0.2"]["agent"] == "up";
  });
  go = true;
  f.runUntil([&] { return done.load(); }, 15000ms);
  notifier.join();
  REQUIRE(replaced);
  REQUIRE(answer);
  const auto* ack = std::get_if<proto::Ack>(&*answer);
  REQUIRE(ack);
  CHECK_FALSE(ack->ok);
  CHECK(ack->error.find("earlier start") != std::string::npos);
  CHECK(f.events("preempt_notice").empty());
}
