// Hosts that come back, against the ManagerDaemon in-process on a FakeClock:
// SimHostLauncher starts simulated agents and workers (sim_cluster.h) that
// heartbeat and answer orders; a host can be made to fail its next start-ups.
// A lost host is started again with backoff; a preempted one comes back after
// the notice's deadline or when the machine list is written again; the manager
// heartbeats its agents. (One start-up per host at a time, which needs a
// start-up held on its launch thread while time passes, stays on the real
// clock: tests/integration/manager_daemon_hosts_test.cpp.)
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "loop/event_log.h"  // unixMillisNow
#include "sim_daemon_harness.h"

using namespace varuna;
using namespace std::chrono_literals;
using sim::PeerKind;

namespace {

const std::vector<std::string> kTwoHosts = {"127.0.0.1", "127.0.0.2"};

// Two hosts of one slot each, one replica per host; lost hosts are retried
// after 0.3 s, doubling up to 5 s.
struct ReturnFixture : test::SimDaemonHarness {
  explicit ReturnFixture(const std::string& name, const std::function<void(JobConfig&)>& tweak = {})
      : SimDaemonHarness(name, 10000ms) {
    writeList();
    JobConfig config = test::hostReturnTestConfig(dir, tweak);
    auto options = sim::fastSimOptions();
    options.globalStore = config.globalStore;  // checkpoint orders write real (tiny) checkpoints
    useFakeClock();  // and in-memory streams to the daemon: no socket
    simulate(options);
    startSimulated(config);
  }
  ~ReturnFixture() { CHECK(noSockets() == ""); }  // the whole test ran without a socket

  // The same text written again (truncated and rewritten in place).
  void writeList() { test::writeMachineList(dir / "machines.txt", kTwoHosts, 1); }
  // The hosts of the newest launch.
  std::vector<std::string> launchedOn() {
    const auto launches = events("launch");
    if (launches.empty()) return {};
    return launches.back()["plan"]["hosts"].get<std::vector<std::string>>();
  }
  size_t launches() { return events("launch").size(); }
  bool hostBack(const std::string& host) {
    for (const auto& e : events("host_back")) {
      if (e["host"] == host) return true;
    }
    return false;
  }
  // notify_manager_preempt for `host`; true once the manager acknowledged it.
  bool preemptNotice(const std::string& host, int64_t deadlineUnixMs) {
    const size_t acks = cluster->count(PeerKind::kNotifier, "ack");
    cluster->sendPreemptNotice(host, deadlineUnixMs);
    return runUntil([&] { return cluster->count(PeerKind::kNotifier, "ack") > acks; });
  }
};

double secondsFrom(Clock::TimePoint a, Clock::TimePoint b) { return std::chrono::duration<double>(b - a).count(); }

}  // namespace

TEST_CASE("daemon: a lost host is started again with backoff and the job grows back", "[daemon][hosts]") {
  ReturnFixture f("daemon_host_retry");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  f.cluster->failNextStarts("127.0.0.2", 2);  // unreachable for its next two start-ups
  const auto lostAt = f.now();
  f.cluster->dropAgent("127.0.0.2", /*withWorkers=*/true);  // the agent goes away
  REQUIRE(f.runUntil([&] { return f.hostBack("127.0.0.2"); }));
  const auto calls = f.cluster->agentStartTimes("127.0.0.2");
  REQUIRE(calls.size() == 4);  // at start-up, then two failures, then up
  const double first = secondsFrom(lostAt, calls[1]), second = secondsFrom(calls[1], calls[2]),
               third = secondsFrom(calls[2], calls[3]);
  INFO("waits " << first << " s, " << second << " s, " << third << " s");
  CHECK(first >= 0.3);  // --host_retry_s
  CHECK(second >= 0.6);  // doubling after each failure
  CHECK(third >= 1.2);
  CHECK(second > first);
  CHECK(third < 4);  // not stuck
  const auto back = f.events("host_back").front();
  CHECK(back["why"] == "lost");
  CHECK(back["attempts"] == 3);
  CHECK(f.events("agent_failed").size() == 2);
  // The job ran on the one host meanwhile and grows back to both.
  REQUIRE(f.runUntil([&] { return f.launches() >= 3 && f.launchedOn() == kTwoHosts; }));
  const auto launches = f.events("launch");
  CHECK(launches[1]["plan"]["hosts"] == nlohmann::json{"127.0.0.1"});
  REQUIRE(f.runUntil([&] {
    const auto hosts = f.state()["hosts"];
    return hosts["127.0.0.2"]["agent"] == "up" && hosts["127.0.0.2"]["out"].is_null();
  }));
  // Lost again soon after (within --host_retry_max_s): a flapping host, whose
  // backoff goes on (1.2 s was the last wait, so 2.4 s) instead of starting over.
  const auto lostAgainAt = f.now();
  f.cluster->dropAgent("127.0.0.2", /*withWorkers=*/true);
  REQUIRE(f.runUntil([&] { return f.cluster->agentStarts("127.0.0.2") == 5; }));
  CHECK(secondsFrom(lostAgainAt, f.cluster->agentStartTimes("127.0.0.2")[4]) >= 2.4);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("daemon: a preempted host comes back when the machine list is written with the same text",
          "[daemon][hosts]") {
  ReturnFixture f("daemon_preempted_back");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  // The cloud takes 127.0.0.2 in ten minutes.
  REQUIRE(f.preemptNotice("127.0.0.2", unixMillisNow() + 600000));
  // Checkpoint, relaunch without it, its agent released.
  REQUIRE(f.runUntil([&] { return f.launches() == 2 && !f.cluster->agentUp("127.0.0.2"); }));
  CHECK(f.launchedOn() == std::vector<std::string>{"127.0.0.1"});
  REQUIRE(f.runUntil([&] { return f.state()["hosts"]["127.0.0.2"]["agent"] == "gone"; }));
  auto out = f.state()["hosts"]["127.0.0.2"]["out"];
  CHECK(out["why"] == "preempted");
  CHECK(out["back_when"] == "the preemption deadline has passed");
  CHECK(f.cluster->agentStarts("127.0.0.2") == 1);  // not retried before the deadline
  // The operator writes the list again, unchanged: the host is there.
  f.writeList();
  REQUIRE(f.runUntil([&] { return f.hostBack("127.0.0.2"); }));
  CHECK(f.cluster->agentStarts("127.0.0.2") == 2);
  CHECK(f.events("hosts_readmitted").size() == 1);
  CHECK(f.events("host_back").front()["why"] == "preempted");
  REQUIRE(f.runUntil([&] { return f.launches() == 3 && f.launchedOn() == kTwoHosts; }));
  REQUIRE(f.runUntil([&] { return f.state()["hosts"]["127.0.0.2"]["preempted"] == false; }));
}

TEST_CASE("daemon: a preempted host is tried again after the notice's deadline", "[daemon][hosts]") {
  ReturnFixture f("daemon_preempted_deadline");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  const int64_t deadlineUnixMs = unixMillisNow() + 1500;
  const auto deadline = f.now() + 1500ms;
  REQUIRE(f.preemptNotice("127.0.0.2", deadlineUnixMs));
  REQUIRE(f.runUntil([&] { return f.hostBack("127.0.0.2"); }));
  const auto calls = f.cluster->agentStartTimes("127.0.0.2");
  REQUIRE(calls.size() == 2);
  CHECK(calls[1] >= deadline - 50ms);  // the clocks differ by the notice's round trip at most
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts && f.launches() >= 3; }));
}

TEST_CASE("daemon: a notice whose deadline lies at the end of time counts a day ahead", "[daemon][hosts]") {
  ReturnFixture f("daemon_preempted_far_deadline");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  REQUIRE(f.preemptNotice("127.0.0.2", INT64_MAX));  // no overflow: acknowledged like any notice
  REQUIRE(f.runUntil([&] { return f.launches() == 2 && !f.cluster->agentUp("127.0.0.2"); }));
  CHECK(f.launchedOn() == std::vector<std::string>{"127.0.0.1"});
  const auto out = f.state()["hosts"]["127.0.0.2"]["out"];
  CHECK(out["why"] == "preempted");
  // Out for at most a day (24 h from now, not the year 292277026596).
  const double backIn = out["deadline_in_s"].get<double>();
  CHECK(backIn > 23 * 3600.0);
  CHECK(backIn <= 24 * 3600.0);
  CHECK(f.state()["phase"] != "finished");
}

TEST_CASE("daemon: an agent's report of another host's worker exit is ignored", "[daemon][hosts][security]") {
  ReturnFixture f("daemon_foreign_exit");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  const auto placement = f.state()["plan"]["placement"];
  int foreignRank = -1;  // a rank of 127.0.0.2
  for (const auto& p : placement) {
    if (p["host"] == "127.0.0.2") foreignRank = p["rank"].get<int>();
  }
  REQUIRE(foreignRank >= 0);
  proto::WorkerExited exited;
  exited.host = "127.0.0.2";  // what it claims; the connection is 127.0.0.1's agent
  exited.rank = foreignRank;
  exited.exitCode = 1;
  exited.generation = f.cluster->generation();
  REQUIRE(f.cluster->reportAsAgentOf("127.0.0.1", exited));
  const auto launchesSent = f.cluster->count(PeerKind::kAgent, "launch_workers");
  // The job goes on: no failure handled, no relaunch, while time passes.
  const auto until = f.now() + 3s;
  f.runUntil([&] { return f.now() >= until; });
  CHECK(f.launches() == 1);
  CHECK(f.cluster->count(PeerKind::kAgent, "launch_workers") == launchesSent);
  CHECK(f.events("worker_exited").empty());
}

TEST_CASE("daemon: the manager heartbeats its agents and hands them the lost-manager deadline", "[daemon][hosts]") {
  ReturnFixture f("daemon_agent_heartbeats", [](JobConfig& c) {
    c.heartbeatTimeoutS = 4;
    c.agentGraceS = 2.5;
  });
  REQUIRE(f.runUntil([&] { return f.cluster->agentUp("127.0.0.1") && f.cluster->agentUp("127.0.0.2"); }));
  REQUIRE(f.runUntil([&] {
    return f.cluster->count(PeerKind::kAgent, "heartbeat", "127.0.0.1") >= 3 &&
           f.cluster->count(PeerKind::kAgent, "heartbeat", "127.0.0.2") >= 3;
  }));
  const auto commands = f.launcher->commands();
  REQUIRE(commands.size() == 2);
  for (const auto& command : commands) {
    CHECK_THAT(command, Catch::Contains(" --lost_manager_ms 6500 "));
    CHECK_THAT(command, Catch::Contains(" --beat_relay_ms 200 "));  // a twentieth of the 4 s heartbeat timeout
  }
}

TEST_CASE("daemon: with many agents each hears a heartbeat a second, not all of them in the same tick",
          "[daemon][hosts]") {
  // 25 hosts: a 100 ms tick sends to a tenth of them (2.5: 2 or 3), so no
  // tick holds the loop for all; over time each gets one a second.
  std::vector<std::string> hosts;
  for (int i = 1; i <= 25; ++i) hosts.push_back("127.0.1." + std::to_string(i));
  struct ManyHosts : test::SimDaemonHarness {
    explicit ManyHosts(const std::vector<std::string>& hosts) : SimDaemonHarness("daemon_heartbeat_spread", 10000ms) {
      test::writeMachineList(dir / "machines.txt", hosts, 1);
      JobConfig config = test::hostReturnTestConfig(dir, {});
      useFakeClock();
      simulate(sim::fastSimOptions());
      startSimulated(config);
    }
  } f(hosts);
  auto beats = [&](const std::string& host) { return f.cluster->count(PeerKind::kAgent, "heartbeat", host); };
  REQUIRE(f.runUntil([&] { return std::all_of(hosts.begin(), hosts.end(), [&](auto& h) { return beats(h) >= 1; }); }));
  std::map<std::string, size_t> before;
  for (const auto& h : hosts) before[h] = beats(h);
  const auto start = f.now();
  f.runUntil([&] { return f.now() >= start + 300ms; });
  size_t heard = 0;
  for (const auto& h : hosts) heard += beats(h) > before[h] ? 1 : 0;
  CHECK(heard >= 3);   // three ticks' worth: about 8
  CHECK(heard <= 15);  // not all at once
  f.runUntil([&] { return f.now() >= start + 5s; });
  for (const auto& h : hosts) {
    INFO(h);
    CHECK(beats(h) - before[h] >= 4);  // 5 in 5 s (give or take the round's phase): none starved ...
    CHECK(beats(h) - before[h] <= 6);  // ... none sent twice per round
  }
}

TEST_CASE("daemon: an agent's credential and the env_file's values go on its stdin, never its command line",
          "[daemon][hosts][security]") {
  ReturnFixture f("daemon_agent_stdin", [](JobConfig& c) {
    const auto envFile = std::filesystem::path(c.stateDir).parent_path() / "job.env";
    std::ofstream(envFile) << "SECRET_KEY=s3cr3t value\n";
    c.envFile = envFile.string();
  });
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  const auto commands = f.launcher->commands();
  const auto inputs = f.launcher->inputs();
  REQUIRE(commands.size() == 2);
  REQUIRE(inputs.size() == 2);
  for (size_t i = 0; i < commands.size(); ++i) {
    CHECK_THAT(commands[i], !Catch::Contains("s3cr3t") && Catch::Contains(" --token_stdin --env_stdin "));
    const auto firstLine = inputs[i].substr(0, inputs[i].find('\n'));
    CHECK(firstLine.size() == 64);  // the host's credential, not the job's secret
    CHECK_THAT(commands[i], !Catch::Contains(firstLine));
    const auto env = nlohmann::json::parse(inputs[i].substr(firstLine.size() + 1));
    CHECK(std::find(env.begin(), env.end(), nlohmann::json::array({"SECRET_KEY", "s3cr3t value"})) != env.end());
  }
  CHECK(inputs[0].substr(0, 64) != inputs[1].substr(0, 64));  // one credential per host
}
