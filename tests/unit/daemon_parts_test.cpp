// The daemon's pure parts on a fake clock: when hosts that are out come back
// (HostAbsences), when ranks are hung (LivenessWatchdog), when a step counts
// (StepProgress), what a machine-list write means (MachineListWatcher),
// which agent starts a host's certificates may speak for (AgentLaunches).
// Their wiring into the real daemon is daemon_sequences_test's.
#include <catch2/catch.hpp>

#include <limits>

#include <filesystem>
#include <fstream>

#include "test_env.h"
#include "daemon/agent_launches.h"
#include "daemon/host_absences.h"
#include "daemon/liveness_watchdog.h"
#include "daemon/machine_list_watcher.h"
#include "daemon/step_progress.h"
#include "daemon/worker_registry.h"
#include "loop/framed_connection.h"

using namespace varuna;
using namespace std::chrono_literals;

namespace {

using TimePoint = std::chrono::steady_clock::time_point;
const TimePoint t0 = TimePoint{} + 1h;

Plan twoRankPlan() {
  Plan plan;
  plan.stages = 2;
  plan.replicas = 1;
  plan.placement = {{0, "a", 0}, {1, "b", 0}};
  plan.hosts = {"a", "b"};
  return plan;
}

}  // namespace

TEST_CASE("a lost host is retried with a backoff that doubles up to the most") {
  HostAbsences absences({2s, 10s});
  absences.markAbsent("h", "lost", t0);
  absences.scheduleRetry("h", t0);
  CHECK_FALSE(absences.retryDue("h", t0 + 1s));
  CHECK(absences.retryDue("h", t0 + 2s));
  absences.scheduleRetry("h", t0 + 2s);  // that start-up failed
  CHECK(absences.find("h")->backoff == 4s);
  absences.scheduleRetry("h", t0 + 6s);
  absences.scheduleRetry("h", t0 + 14s);
  CHECK(absences.find("h")->backoff == 10s);  // capped
  CHECK(absences.find("h")->why == "lost");   // the first reason stays
  absences.markAbsent("h", "agent_failed", t0 + 20s);
  CHECK(absences.find("h")->why == "lost");
}

TEST_CASE("a host that flaps continues its backoff; one back for long starts over") {
  HostAbsences absences({2s, 60s});
  absences.markAbsent("h", "lost", t0);
  absences.scheduleRetry("h", t0);
  absences.scheduleRetry("h", t0 + 2s);  // 4 s
  REQUIRE(absences.back("h", t0 + 6s));
  CHECK_FALSE(absences.find("h"));
  absences.markAbsent("h", "lost", t0 + 10s);  // lost again 4 s after it came back
  absences.scheduleRetry("h", t0 + 10s);
  CHECK(absences.find("h")->backoff == 8s);
  REQUIRE(absences.back("h", t0 + 20s));
  absences.markAbsent("h", "lost", t0 + 200s);  // long after
  absences.scheduleRetry("h", t0 + 200s);
  CHECK(absences.find("h")->backoff == 2s);
}

TEST_CASE("a preempted host is out until the notice's deadline, then tried like a lost one") {
  HostAbsences absences({2s, 60s});
  absences.markPreempted("p", t0 + 30s, t0);
  CHECK(absences.preempted("p"));
  CHECK_FALSE(absences.mayComeBack("p", t0 + 29s));
  CHECK(absences.mayComeBack("p", t0 + 30s));
  CHECK_FALSE(absences.retryDue("p", t0 + 29s));
  CHECK(absences.retryDue("p", t0 + 30s));
  CHECK(absences.describe("p", false, t0 + 1s)["back_when"] == "the preemption deadline has passed");
}

TEST_CASE("a slow host comes back only when the machine list is written") {
  HostAbsences absences({2s, 60s});
  absences.markSlow("s", t0);
  CHECK_FALSE(absences.mayComeBack("s", t0 + 1h));
  CHECK(absences.describe("s", false, t0)["back_when"] == "the machine list is written");
  REQUIRE(absences.readmit("s", t0 + 1h) == std::optional<std::string>("slow"));
  CHECK(absences.mayComeBack("s", t0 + 1h));
  CHECK(absences.retryDue("s", t0 + 1h));
  CHECK_FALSE(absences.readmit("not-out", t0));
}

TEST_CASE("without retries (--host_retry_s 0) a lost host waits for a list write") {
  HostAbsences absences({0ms, 60s});
  absences.markAbsent("h", "lost", t0);
  absences.scheduleRetry("h", t0);
  CHECK_FALSE(absences.retryDue("h", t0 + 1h));
  CHECK(absences.describe("h", false, t0)["back_when"] == "the machine list is written");
  absences.readmit("h", t0 + 1h);
  CHECK(absences.retryDue("h", t0 + 1h));
  CHECK(absences.describe("in", false, t0).is_null());
}

TEST_CASE("a silent rank and one that never connected are named; others are not") {
  LivenessWatchdog watchdog({/*heartbeat*/ 10, /*startup*/ 60, /*hang*/ 600});
  const Plan plan = twoRankPlan();
  WorkerRegistry workers;
  workers.expect(plan);
  watchdog.launched(t0);
  workers.connect(0, nullptr, t0 + 5s);
  CHECK(watchdog.silentRanks({0, 1}, workers, t0 + 14s).empty());
  const auto silent = watchdog.silentRanks({0, 1}, workers, t0 + 61s);
  REQUIRE(silent.size() == 2);
  CHECK(silent[0].rank == 0);
  CHECK_THAT(silent[0].why, Catch::Contains("no heartbeat for 10"));
  CHECK_THAT(silent[1].why, Catch::Contains("never connected within 60"));
}

TEST_CASE("the silence check skips its walk only while no rank can be silent, and finds one on time after") {
  LivenessWatchdog watchdog({/*heartbeat*/ 10, /*startup*/ 60, /*hang*/ 600});
  const Plan plan = twoRankPlan();
  WorkerRegistry workers;
  workers.expect(plan);
  watchdog.launched(t0);
  workers.connect(0, nullptr, t0);
  workers.connect(1, nullptr, t0 + 5s);
  CHECK(watchdog.silentRanks({0, 1}, workers, t0 + 6s).empty());  // a walk: the oldest was heard at t0
  // Until t0 + 10 s it does not walk: a rank silent for longer (which cannot
  // happen, last-heard times only move forward) is not seen in that window.
  workers.find(1)->lastSeen = t0 - 30s;
  CHECK(watchdog.silentRanks({0, 1}, workers, t0 + 9s).empty());
  workers.find(1)->lastSeen = t0 + 9s;
  CHECK(watchdog.silentRanks({0, 1}, workers, t0 + 9500ms).empty());
  const auto silent = watchdog.silentRanks({0, 1}, workers, t0 + 10500ms);  // rank 0: 10.5 s without a word
  REQUIRE(silent.size() == 1);
  CHECK(silent[0].rank == 0);
  workers.find(0)->lastSeen = t0 + 11s;
  CHECK(watchdog.silentRanks({0, 1}, workers, t0 + 12s).empty());
  CHECK(watchdog.silentRanks({0, 1}, workers, t0 + 19500ms).size() == 1);  // rank 1, heard last at 9 s
  // A launch starts over: its ranks not connected yet are looked at every time.
  workers.expect(plan);
  watchdog.launched(t0 + 20s);
  workers.connect(0, nullptr, t0 + 20s);
  CHECK(watchdog.silentRanks({0, 1}, workers, t0 + 21s).empty());
  const auto never = watchdog.silentRanks({0, 1}, workers, t0 + 81s);
  REQUIRE(never.size() == 2);
  CHECK_THAT(never[1].why, Catch::Contains("never connected"));
}

TEST_CASE("the registry counts ranks without a hello through connects, repeats, forgets and orders out") {
  const Plan plan = twoRankPlan();
  WorkerRegistry workers;
  workers.expect(plan);
  CHECK(workers.unconnected() == 2);
  CHECK_FALSE(workers.connect(0, nullptr, t0));
  CHECK_FALSE(workers.connect(0, nullptr, t0 + 1s));  // a second hello counts once
  CHECK(workers.unconnected() == 1);
  CHECK(workers.connect(1, nullptr, t0));
  CHECK(workers.unconnected() == 0);
  workers.forget(1);
  workers.forget(1);
  CHECK(workers.unconnected() == 0);  // a connected rank forgotten: still none waited for
  workers.expect(plan);
  CHECK(workers.unconnected() == 2);
  workers.orderRankOut(0, 1, "test");  // never connected
  CHECK(workers.unconnected() == 1);
  workers.connect(1, nullptr, t0);
  workers.orderHostOut(plan.placement[1].host, plan, 1, "test");
  CHECK(workers.size() == 0);
  CHECK(workers.unconnected() == 0);
  workers.expect(plan);
  workers.connect(0, nullptr, t0);
  workers.orderAllOut(1, "test");
  CHECK(workers.unconnected() == 0);
  CHECK(workers.size() == 0);
}

TEST_CASE("the registry finds a rank while it is expected, never after it is forgotten or the launch is over") {
  const Plan plan = twoRankPlan();
  WorkerRegistry workers;
  CHECK(workers.find(0) == nullptr);
  workers.expect(plan);
  REQUIRE(workers.find(0) != nullptr);
  REQUIRE(workers.find(1) != nullptr);
  CHECK(workers.find(0) != workers.find(1));
  CHECK(workers.find(2) == nullptr);
  CHECK(workers.find(-1) == nullptr);
  CHECK(workers.find(std::numeric_limits<int>::max()) == nullptr);
  workers.connect(1, nullptr, t0);
  CHECK(workers.find(1)->lastSeen == t0);
  CHECK(workers.find(1) == &workers.all().at(1));  // the node the watchdog walks
  workers.forget(1);
  CHECK(workers.find(1) == nullptr);
  CHECK(workers.find(0) != nullptr);
  workers.connect(1, nullptr, t0 + 1s);  // a hello after a forget (ordered out elsewhere): found again
  REQUIRE(workers.find(1) != nullptr);
  CHECK(workers.find(1)->lastSeen == t0 + 1s);
  workers.orderRankOut(0, 1, "test");
  CHECK(workers.find(0) == nullptr);
  workers.connect(std::numeric_limits<int>::max(), nullptr, t0);  // past the index: still found, in the tree
  CHECK(workers.find(std::numeric_limits<int>::max()) != nullptr);
  workers.clear();
  CHECK(workers.find(1) == nullptr);
  CHECK(workers.find(std::numeric_limits<int>::max()) == nullptr);
  // A host ordered out, every rank ordered out, a smaller launch.
  workers.expect(plan);
  workers.orderHostOut(plan.placement[1].host, plan, 1, "test");
  CHECK(workers.find(1) == nullptr);
  CHECK(workers.find(0) != nullptr);
  workers.orderAllOut(1, "test");
  CHECK(workers.find(0) == nullptr);
  workers.expect(plan);
  Plan smaller = plan;
  smaller.placement.pop_back();
  workers.expect(smaller);
  CHECK(workers.find(0) != nullptr);
  CHECK(workers.find(1) == nullptr);
}

TEST_CASE("the hang check walks the running ranks only once the job has stalled, and names those not waiting") {
  LivenessWatchdog watchdog({/*heartbeat*/ 10, /*startup*/ 60, /*hang*/ 30});
  const Plan plan = twoRankPlan();
  WorkerRegistry workers;
  workers.expect(plan);
  watchdog.launched(t0);
  CHECK_FALSE(watchdog.findHang({0, 1}, workers, plan, t0 + 61s));  // rank 1 never connected: the silence check's case
  workers.connect(0, nullptr, t0);
  workers.connect(1, nullptr, t0);
  workers.find(1)->waiting = true;
  CHECK_FALSE(watchdog.findHang({0, 1}, workers, plan, t0 + 59s));
  const auto hang = watchdog.findHang({0, 1}, workers, plan, t0 + 61s);
  REQUIRE(hang);
  CHECK(hang->ranks == std::vector<int>{0});
  CHECK_FALSE(watchdog.findHang({0, 1, 7}, workers, plan, t0 + 61s));  // a running rank the registry lost
}

TEST_CASE("a silent rank whose agent fell silent with it is the agent's case, however late the manager looks") {
  using Silent = LivenessWatchdog::SilentRank;
  const Silent rank{3, "no heartbeat for 2 s", t0};
  // The agent's last frame came with the rank's last relayed beat, or just
  // after: the agent stopped. Looked at 2 s later or 20 s later (a manager
  // descheduled on a loaded machine), the same answer.
  CHECK(LivenessWatchdog::silenceIsTheAgents(rank, t0, t0 + 2s));
  CHECK(LivenessWatchdog::silenceIsTheAgents(rank, t0 + 900ms, t0 + 2s));
  CHECK(LivenessWatchdog::silenceIsTheAgents(rank, t0 + 900ms, t0 + 20s));
  // The agent was heard on since: it is alive and the rank is hung.
  CHECK_FALSE(LivenessWatchdog::silenceIsTheAgents(rank, t0 + 1500ms, t0 + 2s));
  // ...unless it has since fallen silent itself for over 2 s.
  CHECK(LivenessWatchdog::silenceIsTheAgents(rank, t0 + 1500ms, t0 + 4s));
  // No agent connected, or a rank that never said hello: the rank's own case.
  CHECK_FALSE(LivenessWatchdog::silenceIsTheAgents(rank, std::nullopt, t0 + 2s));
  CHECK_FALSE(LivenessWatchdog::silenceIsTheAgents(Silent{1, "never connected", std::nullopt}, t0, t0 + 2s));
}

TEST_CASE("no progress: the rank computing while its peers wait is named hung") {
  LivenessWatchdog watchdog({10, 60, 100});
  const Plan plan = twoRankPlan();
  WorkerRegistry workers;
  workers.expect(plan);
  watchdog.launched(t0);
  workers.connect(0, nullptr, t0);
  CHECK_FALSE(watchdog.findHang({0, 1}, workers, plan, t0 + 1h));  // rank 1 never said hello: silentRanks' case
  workers.connect(1, nullptr, t0);
  // Before the first step: the larger of the startup and hang timeouts, from the launch.
  CHECK_FALSE(watchdog.findHang({0, 1}, workers, plan, t0 + 100s));
  auto hang = watchdog.findHang({0, 1}, workers, plan, t0 + 101s);
  REQUIRE(hang);
  CHECK(hang->event["before_first_step"] == true);
  CHECK(hang->ranks == std::vector<int>{0, 1});  // none waits: both named
  // The first step report starts the hang clock; steps that advance are progress.
  watchdog.noteStep(*workers.find(0), 5, /*report=*/true, t0 + 50s);
  watchdog.noteStep(*workers.find(1), 5, /*report=*/true, t0 + 50s);
  watchdog.noteStep(*workers.find(1), 6, /*report=*/false, t0 + 80s);
  CHECK_FALSE(watchdog.findHang({0, 1}, workers, plan, t0 + 180s));
  watchdog.noteStep(*workers.find(1), 6, /*report=*/false, t0 + 170s);  // no advance: not progress
  workers.find(0)->waiting = true;
  hang = watchdog.findHang({0, 1}, workers, plan, t0 + 181s);
  REQUIRE(hang);
  CHECK(hang->ranks == std::vector<int>{1});
  CHECK(hang->event["last_step"] == 6);
  CHECK_THAT(hang->reason, Catch::Contains("1 on b (step 6)") && Catch::Contains("1 rank(s) wait on it"));
  CHECK_FALSE(LivenessWatchdog({10, 60, 0}).findHang({0, 1}, workers, plan, t0 + 10h));  // 0: rule off
}

TEST_CASE("a step counts once every rank reported it, with its slowest rank's time") {
  StepProgress progress(16);
  proto::StepReport report;
  report.step = 7;
  report.stepSeconds = 0.5;
  report.loss = 2.5;
  CHECK_FALSE(progress.add(report, 2));
  report.stepSeconds = 2.0;
  const auto step = progress.add(report, 2);
  REQUIRE(step);
  CHECK(step->maxStepSeconds == 2.0);
  CHECK(step->firstOfGeneration);
  CHECK(progress.toJson()["samples_per_s"] == 8.0);
  report.step = 8;
  CHECK_FALSE(progress.add(report, 2));
  CHECK_FALSE(progress.add(report, 2)->firstOfGeneration);
  CHECK(progress.lastStep() == 8);
  progress.newGeneration();
  report.step = 8;
  CHECK(progress.add(report, 1)->firstOfGeneration);  // a new generation's first step ends its morph
}

TEST_CASE("the machine list watcher tells an edit from a write of the same text") {
  const std::string path = (varuna::test::scratchDir("machine-list-watcher") / "machines.txt").string();
  auto write = [&](const std::string& text) {
    std::ofstream(path, std::ios::trunc) << text;
  };
  write("a\nb\n");
  MachineListWatcher watcher(path, 1);
  REQUIRE(watcher.read().size() == 2);
  auto change = watcher.poll();
  CHECK_FALSE(change.written);
  CHECK_FALSE(change.edited);
  // The same text again, with another modification time.
  std::filesystem::last_write_time(path, std::filesystem::last_write_time(path) + 1s);
  change = watcher.poll();
  CHECK(change.written);
  CHECK_FALSE(change.edited);
  write("b\nc\n");
  change = watcher.poll();
  CHECK(change.edited);
  CHECK(change.added == std::vector<std::string>{"c"});
  CHECK(change.removed == std::vector<std::string>{"a"});
  write("b\nc:notanumber\n");  // invalid: reported once, ignored
  change = watcher.poll();
  CHECK_FALSE(change.edited);
  CHECK(watcher.machines().size() == 2);
}

TEST_CASE("a second hello of a connected rank replaces its connection and closes the old one") {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  auto accepted = [&] {
    boost::asio::ip::tcp::socket client(io);
    client.connect(acceptor.local_endpoint());
    auto server = std::make_shared<FramedConnection>(acceptor.accept());
    return std::make_pair(std::move(client), server);
  };
  auto [client1, first] = accepted();
  auto [client2, second] = accepted();
  std::string closedWhy;
  first->start([](const proto::Message&) {}, [&](const std::string& why) { closedWhy = why; });
  WorkerRegistry workers;
  workers.expect(twoRankPlan());
  CHECK_FALSE(workers.connect(0, first, t0));
  CHECK_FALSE(workers.connect(0, second, t0 + 1s));
  CHECK_FALSE(first->open());
  CHECK_THAT(closedWhy, Catch::Contains("replaced by a newer connection"));
  CHECK(workers.find(0)->connection == second);
  CHECK(second->open());
  auto [client3, third] = accepted();
  CHECK(workers.connect(1, third, t0 + 1s));  // every rank connected
}

TEST_CASE("a host no longer listed is forgotten, and old returns stop counting as flapping") {
  HostAbsences absences({2s, 10s});
  absences.markAbsent("gone", "lost", t0);
  absences.forget("gone");
  CHECK_FALSE(absences.find("gone"));
  CHECK(absences.empty());
  // A return older than the longest backoff no longer shapes the next one.
  absences.markAbsent("h", "lost", t0);
  absences.scheduleRetry("h", t0);
  absences.scheduleRetry("h", t0 + 2s);  // 4 s
  REQUIRE(absences.back("h", t0 + 6s));
  absences.markAbsent("other", "lost", t0 + 30s);
  REQUIRE(absences.back("other", t0 + 31s));  // prunes h's return (25 s old)
  absences.markAbsent("h", "lost", t0 + 32s);
  absences.scheduleRetry("h", t0 + 32s);
  CHECK(absences.find("h")->backoff == 2s);
}

TEST_CASE("an agent's earlier starts stay valid until the latest one says hello, then are revoked") {
  using Standing = AgentLaunches::Standing;
  AgentLaunches launches;
  CHECK(launches.standing("h", "anything") == Standing::kRevoked);  // a host never started
  const std::string first = launches.start("h");
  CHECK(first.size() == 32);
  CHECK(launches.standing("h", first) == Standing::kLatest);
  CHECK(launches.standing("h", "") == Standing::kRevoked);
  CHECK(launches.standing("other", first) == Standing::kRevoked);  // a nonce speaks for its own host only
  CHECK_FALSE(launches.agentUp("h", first));  // nothing earlier to revoke
  // A second start while the first agent may still run (a lost connection):
  // both valid until the second says hello; a hello of the first changes nothing.
  const std::string second = launches.start("h");
  CHECK(second != first);
  CHECK(launches.standing("h", first) == Standing::kEarlier);
  CHECK(launches.standing("h", second) == Standing::kLatest);
  CHECK_FALSE(launches.agentUp("h", first));
  CHECK(launches.standing("h", first) == Standing::kEarlier);
  CHECK(launches.agentUp("h", second));
  CHECK(launches.standing("h", first) == Standing::kRevoked);
  CHECK(launches.standing("h", second) == Standing::kLatest);
  CHECK(launches.forget("h"));
  CHECK(launches.standing("h", second) == Standing::kRevoked);
}

TEST_CASE("starts that never said hello are kept up to a bound; a restarted manager reads them back as earlier") {
  using Standing = AgentLaunches::Standing;
  AgentLaunches launches;
  std::vector<std::string> starts;
  for (size_t i = 0; i < AgentLaunches::kMaxEarlier + 3; ++i) starts.push_back(launches.start("h"));
  const std::string other = launches.start("g");
  // The latest and kMaxEarlier before it are valid; the oldest are dropped.
  CHECK(launches.standing("h", starts.back()) == Standing::kLatest);
  for (size_t i = 0; i < starts.size() - 1; ++i) {
    CHECK(launches.standing("h", starts[i]) == (i + 1 + AgentLaunches::kMaxEarlier >= starts.size()
                                                    ? Standing::kEarlier
                                                    : Standing::kRevoked));
  }
  const auto saved = launches.toJson();
  CHECK(saved["h"].size() == AgentLaunches::kMaxEarlier + 1);
  CHECK(saved["h"][0] == starts.back());  // newest first
  // What the new manager makes of it: every saved start earlier, none latest.
  AgentLaunches restarted;
  restarted.restore(saved);
  for (size_t i = 0; i < starts.size(); ++i) {
    CHECK(restarted.standing("h", starts[i]) ==
          (launches.standing("h", starts[i]) == Standing::kRevoked ? Standing::kRevoked : Standing::kEarlier));
  }
  CHECK(restarted.standing("g", other) == Standing::kEarlier);
  // Its own first start of h: the predecessor's stay valid until it says hello.
  const std::string mine = restarted.start("h");
  CHECK(restarted.standing("h", starts.back()) == Standing::kEarlier);
  CHECK(restarted.agentUp("h", mine));
  CHECK(restarted.standing("h", starts.back()) == Standing::kRevoked);
  CHECK(restarted.standing("g", other) == Standing::kEarlier);  // g's agent has not said hello yet
  // A damaged file: what is not host -> nonces is skipped.
  AgentLaunches damaged;
  damaged.restore(nlohmann::json::parse(R"({"a": "x", "b": [1, "", "n1"], "c": []})"));
  CHECK(damaged.standing("b", "n1") == Standing::kEarlier);
  CHECK(damaged.toJson() == nlohmann::json::parse(R"({"b": ["n1"]})"));
  damaged.restore(nlohmann::json::array());
  CHECK(damaged.toJson().size() == 1);
}
