// The real varuna_agent against a fake manager: its workers die with it (the
// parent-death signal: a SIGKILLed or OOM-killed agent takes them along), an
// agent that loses the manager kills its workers after its grace and exits,
// one that hears nothing from a connected manager for --lost_manager_ms does
// the same (a silent partition), and workers start with SIGUSR1 blocked (a
// checkpoint request during their start-up waits instead of killing them),
// and their heartbeats on the beat socket reach the manager relayed. With
// --sigterm_notice_s a SIGTERM (a scheduler's) becomes a preemption notice.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "fake_manager.h"
#include "process.h"
#include "test_env.h"
#include "varuna/common/errors.h"
#include "varuna/common/certificate_credential.h"
#include "varuna/manager/credentials.h"

using namespace varuna;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// Process state letter ('R', 'S', 'Z', ...) and parent of `pid`; nullopt once it is gone.
std::optional<std::pair<char, pid_t>> processStat(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  const auto close = text.rfind(')');
  if (close == std::string::npos || close + 4 >= text.size()) return std::nullopt;
  char state = text[close + 2];
  pid_t parent = static_cast<pid_t>(std::atol(text.c_str() + close + 4));
  return std::make_pair(state, parent);
}

// A signal set of /proc/<pid>/status ("SigBlk", "ShdPnd", ...); 0 once gone.
uint64_t signalSet(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1), nullptr, 16);
  }
  return 0;
}

uint64_t bit(int signal) { return uint64_t{1} << (signal - 1); }

// The program a process runs ("" once it is gone).
std::string commOf(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/comm");
  std::string name;
  std::getline(in, name);
  return name;
}

// Gone, or a zombie no one reaped yet (it runs nothing).
bool gone(pid_t pid) {
  const auto stat = processStat(pid);
  return !stat || stat->first == 'Z' || stat->first == 'X';
}

std::set<pid_t> childrenOf(pid_t parent) {
  std::set<pid_t> out;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    const auto stat = processStat(pid);
    if (stat && stat->second == parent && stat->first != 'Z') out.insert(pid);
  }
  return out;
}

// run_varuna's TLS keys for hosts whose agent credential is `agentCredential`.
tls::KeyForIdentity keysOfAgent(std::string agentCredential) {
  return [agentCredential](const tls::PskIdentity& identity) -> std::optional<std::string> {
    const auto credential = credentials::expected(agentCredential, identity.role, identity.rank, identity.generation);
    if (credential.empty()) return std::nullopt;
    return tls::pskKey(credential);
  };
}

// A job's CA, and what run_varuna gives the agent of `host`: its host's CA.
std::shared_ptr<const tls::CertificateCredential> newJobCa() {
  return std::make_shared<const tls::CertificateCredential>(tls::CertificateCredential::makeRoot("agent-test"));
}
std::string hostCaOf(const tls::CertificateCredential& ca, const std::string& host) {
  return ca.issue({"agent", host, -1, -1, ""}, /*isCa=*/true).encode();
}

// An agent with its host's certificate against a manager of the same CA.
struct AgentUnderTest {
  std::shared_ptr<const tls::CertificateCredential> ca = newJobCa();
  std::string credential = hostCaOf(*ca, "127.0.0.1");
  test::FakeManager manager{ca};
  fs::path dir;
  std::optional<test::ChildProcess> agent;
  std::optional<test::FakePeer> link;

  AgentUnderTest(const std::string& name, const std::string& graceS, const std::string& lostManagerMs = "",
                 const std::vector<std::string>& extraArgs = {})
      : dir(test::scratchDir(name)) {
    std::vector<std::string> argv{(test::buildDir() / "bin" / "varuna_agent").string(), "--manager",
                                  manager.address(), "--host", "127.0.0.1", "--job", "agent-test-" + name,
                                  "--run_dir", (dir / "run").string(), "--code_dir", dir.string(),
                                  "--grace_s", graceS};
    if (!lostManagerMs.empty()) argv.insert(argv.end(), {"--lost_manager_ms", lostManagerMs});
    argv.insert(argv.end(), extraArgs.begin(), extraArgs.end());
    agent.emplace(argv, std::map<std::string, std::string>{{"VARUNA_JOB_TOKEN", credential}}, dir / "agent");
    link = manager.accept(20s);
    REQUIRE(link);
    auto hello = link->receive(10s);
    REQUIRE(hello);
    CHECK(std::get<proto::Hello>(*hello).role == "agent");
    CHECK(std::get<proto::Hello>(*hello).token.empty());  // its key never leaves it
    // The hello came over TLS, from the identity its certificate names.
    REQUIRE(link->identity());
    CHECK(link->identity()->certified);
    CHECK(link->identity()->role == "agent");
    CHECK(link->identity()->host == "127.0.0.1");
  }

  // Two workers that only sleep (`exec`: the sleep is the agent's child itself).
  std::set<pid_t> launchSleepers() { return launch({"/bin/sh", "-c", "exec sleep 120"}); }

  std::set<pid_t> launch(const std::vector<std::string>& argv) {
    proto::LaunchWorkers launch;
    launch.workers = {{0, 0}, {1, 1}};
    launch.argv = argv;
    launch.codeDir = dir.string();
    launch.stageToRankMap = "0;1;";
    launch.chunkSize = 1;
    launch.batchSize = 1;
    launch.masterAddr = "127.0.0.1";
    launch.masterPort = 29999;
    launch.worldSize = 2;
    launch.generation = 1;
    REQUIRE(link->send(launch));
    std::set<pid_t> workers;
    REQUIRE(test::waitUntil([&] { return (workers = childrenOf(agent->pid())).size() == 2; }, 10s));
    return workers;
  }
};

}  // namespace

TEST_CASE("agent: a SIGKILLed agent takes its workers along", "[agent]") {
  AgentUnderTest t("agent-sigkill", "30");
  const auto workers = t.launchSleepers();
  t.agent->kill(SIGKILL);
  REQUIRE(t.agent->wait(5s));
  for (const pid_t pid : workers) {
    INFO("worker " << pid);
    CHECK(test::waitUntil([&] { return gone(pid); }, 5s));
  }
}

TEST_CASE("agent: without --sigterm_notice_s a SIGTERM stops it and its workers at once", "[agent]") {
  AgentUnderTest t("agent-sigterm", "30");
  const auto workers = t.launchSleepers();
  t.agent->kill(SIGTERM);
  const auto code = t.agent->wait(10s);
  REQUIRE(code);
  CHECK(*code == 0);
  for (const pid_t pid : workers) CHECK(test::waitUntil([&] { return gone(pid); }, 5s));
  CHECK_FALSE(t.manager.accept(200ms));  // no notice
}

TEST_CASE("agent: with --sigterm_notice_s a SIGTERM is a preemption notice; it leaves once its workers are stopped",
          "[agent][scheduler]") {
  AgentUnderTest t("agent-sigterm-notice", "30", "", {"--sigterm_notice_s", "30"});
  const auto workers = t.launchSleepers();
  const int64_t sentUnixMs =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  // The scheduler signals every process of the job, the workers too.
  for (const pid_t pid : workers) ::kill(pid, SIGTERM);
  t.agent->kill(SIGTERM);
  // The notice comes as a notifier's would: its own connection, the host's
  // notifier certificate (issued by the agent, never its own), the deadline ahead.
  auto notifier = t.manager.accept(10s);
  REQUIRE(notifier);
  const auto hello = notifier->receive(10s);
  REQUIRE(hello);
  const auto& h = std::get<proto::Hello>(*hello);
  CHECK(h.role == "notifier");
  CHECK(h.host == "127.0.0.1");
  CHECK(h.token.empty());
  REQUIRE(notifier->identity());
  CHECK(notifier->identity()->certified);
  CHECK(notifier->identity()->role == "notifier");
  const auto notice = notifier->receive(10s);
  REQUIRE(notice);
  const auto& n = std::get<proto::PreemptNotice>(*notice);
  CHECK(n.host == "127.0.0.1");
  CHECK(n.deadlineUnixMs >= sentUnixMs + 29000);
  CHECK(n.deadlineUnixMs <= sentUnixMs + 31000);
  REQUIRE(notifier->send(proto::Ack{true, ""}));
  // The workers train on until the manager's morph stops them.
  std::this_thread::sleep_for(300ms);
  for (const pid_t pid : workers) CHECK_FALSE(gone(pid));
  CHECK_FALSE(t.agent->wait(0ms));
  REQUIRE(t.link->send(proto::KillWorkers{"morphing off a preempted host"}));
  const auto code = t.agent->wait(10s);
  REQUIRE(code);
  CHECK(*code == 0);
  CHECK_THAT(t.agent->stderrText() + t.agent->stdoutText(), Catch::Contains("the manager moved the job off this host"));
}

TEST_CASE("agent: a notice nobody answers: it stops its workers and leaves just before the scheduler's deadline",
          "[agent][scheduler]") {
  AgentUnderTest t("agent-sigterm-deadline", "30", "", {"--sigterm_notice_s", "6"});
  const auto workers = t.launchSleepers();
  const auto sent = std::chrono::steady_clock::now();
  t.agent->kill(SIGTERM);  // the fake manager never accepts the notifier's connection
  const auto code = t.agent->wait(10s);
  REQUIRE(code);
  CHECK(*code == 0);
  const auto took = std::chrono::steady_clock::now() - sent;
  CHECK(took >= 4900ms);  // 6 s of grace, 1 s kept for the exit
  CHECK(took < 6s);       // before the scheduler's SIGKILL
  for (const pid_t pid : workers) CHECK(test::waitUntil([&] { return gone(pid); }, 5s));
  CHECK_THAT(t.agent->stderrText() + t.agent->stdoutText(), Catch::Contains("grace time is over"));
}

TEST_CASE("agent: a second SIGTERM after the notice stops the workers at once", "[agent][scheduler]") {
  AgentUnderTest t("agent-sigterm-twice", "30", "", {"--sigterm_notice_s", "60"});
  const auto workers = t.launchSleepers();
  t.agent->kill(SIGTERM);
  REQUIRE(test::waitUntil([&] { return (t.agent->stderrText() + t.agent->stdoutText()).find("SIGTERM: the scheduler") !=
                                       std::string::npos; }, 10s));
  t.agent->kill(SIGTERM);
  const auto code = t.agent->wait(10s);
  REQUIRE(code);
  CHECK(*code == 0);
  for (const pid_t pid : workers) CHECK(test::waitUntil([&] { return gone(pid); }, 5s));
}

TEST_CASE("agent: a worker's credential comes on a pipe it reads once; its environment holds none", "[agent][security]") {
  AgentUnderTest t("agent-token-fd", "30");
  // Each worker reads its descriptor twice (the second read finds it drained), then sleeps.
  const auto workers = t.launch({"/bin/sh", "-c",
                                 "cat <&$VARUNA_JOB_TOKEN_FD > token_$RANK.txt; cat <&$VARUNA_JOB_TOKEN_FD > again_$RANK.txt; "
                                 "exec sleep 120"});
  auto readFile = [](const fs::path& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  std::vector<std::string> tokens;
  for (int rank : {0, 1}) {
    const auto path = t.dir / strCat("again_", rank, ".txt");
    REQUIRE(test::waitUntil([&] { return fs::exists(path); }, 10s));
    tokens.push_back(readFile(t.dir / strCat("token_", rank, ".txt")));
    // A certificate the agent issued with its host's CA, for this rank and generation only.
    const auto worker = tls::CertificateCredential::parse(tokens.back());
    CHECK(worker.identity().role == "worker");
    CHECK(worker.identity().rank == rank);
    CHECK(worker.identity().generation == 1);
    CHECK_FALSE(worker.isCa());
    CHECK(readFile(path).empty());
  }
  CHECK(tokens[0] != tokens[1]);      // per rank
  CHECK(tokens[0] != t.credential);  // never the agent's own
  for (const pid_t pid : workers) {
    INFO("worker " << pid);
    const std::string environ = readFile("/proc/" + std::to_string(pid) + "/environ");
    REQUIRE_FALSE(environ.empty());
    CHECK(environ.find("VARUNA_JOB_TOKEN_FD=4") != std::string::npos);
    CHECK(environ.find(std::string("VARUNA_JOB_TOKEN=")) == std::string::npos);
    CHECK(environ.find(t.credential.substr(4, 64)) == std::string::npos);
    for (const auto& token : tokens) CHECK(environ.find(token) == std::string::npos);
  }
}

TEST_CASE("agent: losing the manager, it kills its workers after its grace and exits", "[agent]") {
  AgentUnderTest t("agent-grace", "0.5");
  const auto workers = t.launchSleepers();
  const auto lost = std::chrono::steady_clock::now();
  t.link->close();
  const auto code = t.agent->wait(10s);
  REQUIRE(code);
  CHECK(*code == 1);  // "the manager is gone"
  CHECK(std::chrono::steady_clock::now() - lost >= 400ms);
  for (const pid_t pid : workers) {
    INFO("worker " << pid);
    CHECK(test::waitUntil([&] { return gone(pid); }, 5s));
  }
  CHECK_THAT(t.agent->stderrText() + t.agent->stdoutText(), Catch::Contains("lost the manager"));
}

TEST_CASE("agent: a manager that stays silent on an open connection is lost after --lost_manager_ms", "[agent]") {
  // The grace (30 s) cannot be what ends it: the connection stays up.
  AgentUnderTest t("agent-silent", "30", "1000");
  // The launch is the manager's last frame: the deadline counts from its arrival.
  const auto lastFrame = std::chrono::steady_clock::now();
  const auto workers = t.launchSleepers();
  const auto code = t.agent->wait(10s);
  REQUIRE(code);
  CHECK(*code == 1);
  const auto elapsed = std::chrono::steady_clock::now() - lastFrame;
  CHECK(elapsed >= 950ms);  // not before the deadline (timer granularity aside)
  CHECK(elapsed < 6s);      // the deadline plus reaping, on a loaded machine
  for (const pid_t pid : workers) {
    INFO("worker " << pid);
    CHECK(test::waitUntil([&] { return gone(pid); }, 5s));
  }
  CHECK_THAT(t.agent->stderrText() + t.agent->stdoutText(), Catch::Contains("no word from the manager"));
}

TEST_CASE("agent: the manager's heartbeats keep it alive past --lost_manager_ms; their end is the end", "[agent]") {
  AgentUnderTest t("agent-heartbeats", "30", "500");
  const auto workers = t.launchSleepers();
  // Four deadlines' worth of heartbeats, five per deadline.
  REQUIRE(t.link->sendHeartbeatsFor(2000ms, 100ms));
  CHECK_FALSE(t.agent->wait(0ms));
  for (const pid_t pid : workers) CHECK_FALSE(gone(pid));
  // The heartbeats stop (a partition): it goes.
  const auto silent = std::chrono::steady_clock::now();
  const auto code = t.agent->wait(10s);
  REQUIRE(code);
  CHECK(*code == 1);
  CHECK(std::chrono::steady_clock::now() - silent >= 400ms);
  for (const pid_t pid : workers) CHECK(test::waitUntil([&] { return gone(pid); }, 5s));
  CHECK_THAT(t.agent->stderrText() + t.agent->stdoutText(), Catch::Contains("no word from the manager for 500 ms"));
}

TEST_CASE("agent: workers start with SIGUSR1 blocked, so an early checkpoint request waits for their handler",
          "[agent]") {
  AgentUnderTest t("agent-sigusr1", "30");
  const auto workers = t.launchSleepers();
  for (const pid_t pid : workers) {
    // The agent sees its child from the fork on; the mask is the program's
    // once it runs (`sh` has exec'd `sleep`).
    REQUIRE(test::waitUntil([&] { return commOf(pid) == "sleep"; }, 10s));
    CHECK((signalSet(pid, "SigBlk") & bit(SIGUSR1)) != 0);
  }
  REQUIRE(t.link->send(proto::CheckpointAndExit{}));
  // A program that never installs the runtime's handler (here `sleep`) keeps
  // the request pending; before, SIGUSR1's default action killed it.
  for (const pid_t pid : workers) {
    INFO("worker " << pid);
    CHECK(test::waitUntil([&] { return (signalSet(pid, "ShdPnd") & bit(SIGUSR1)) != 0; }, 5s));
    CHECK_FALSE(gone(pid));
  }
}

TEST_CASE("agent: its workers' beats on the beat socket reach the manager, the newest per rank per relay",
          "[agent]") {
  AgentUnderTest t("agent-beats", "30");
  // Each worker checks that it holds no descriptor of the agent's but the
  // beat socket (3) and its credential's pipe (4), sends a record of the wrong size (ignored), 50 beats back
  // to back (step 100 x rank + i, waiting on odd ranks), then one stamped 10 s
  // ago (stale: dropped), then sleeps. Only the newest fresh beat of each rank
  // is relayed.
  const std::string worker = R"(
import os, socket, struct, time
fd = int(os.environ["VARUNA_AGENT_BEAT_FD"])
assert fd == 3
listed = [int(n) for n in os.listdir("/proc/self/fd")]
assert int(os.environ["VARUNA_JOB_TOKEN_FD"]) == 4
assert [n for n in listed if n > 4 and os.path.exists("/proc/self/fd/%d" % n)] == [], listed
s = socket.socket(fileno=os.dup(fd))
assert s.family == socket.AF_UNIX and s.type == socket.SOCK_DGRAM
rank = int(os.environ["RANK"])
s.send(b"not a beat")
for i in range(50):
    s.send(struct.pack("=iiqq", rank, rank % 2, 100 * rank + i, time.monotonic_ns()))
s.send(struct.pack("=iiqq", rank, 0, 100 * rank + 99, time.monotonic_ns() - 10 * 10**9))
time.sleep(120)
)";
  t.launch({"/usr/bin/python3", "-c", worker});
  std::map<int, proto::WorkerBeat> newest;
  std::map<int, int> relaysWith;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < deadline &&
         !(newest.count(0) && newest.at(0).step == 49 && newest.count(1) && newest.at(1).step == 149)) {
    auto message = t.link->receive(1s);
    if (!message) continue;
    const auto* relay = std::get_if<proto::WorkerBeats>(&*message);
    if (!relay) continue;
    CHECK(relay->generation == 1);
    for (const auto& beat : relay->beats) {
      newest[beat.rank] = beat;
      ++relaysWith[beat.rank];
    }
  }
  // Two more relay periods: the stale beats must not come later either.
  const auto drainEnd = std::chrono::steady_clock::now() + 600ms;
  while (std::chrono::steady_clock::now() < drainEnd) {
    auto message = t.link->receive(100ms);
    const auto* relay = message ? std::get_if<proto::WorkerBeats>(&*message) : nullptr;
    if (relay) {
      for (const auto& beat : relay->beats) newest[beat.rank] = beat;
    }
  }
  REQUIRE(newest.size() == 2);
  CHECK(newest.at(0).step == 49);
  CHECK_FALSE(newest.at(0).waiting);
  CHECK(newest.at(1).step == 149);
  CHECK(newest.at(1).waiting);
  // The stale beat (step ..99) was never relayed: the newest is the last fresh one.
  // Relayed, not forwarded one by one: 50 beats each in a few relays.
  CHECK(relaysWith.at(0) < 25);
  CHECK(relaysWith.at(1) < 25);
}

TEST_CASE("agent: step reports on the beat socket reach the manager, every one in order, before the worker's exit",
          "[agent]") {
  AgentUnderTest t("agent-step-reports", "30");
  // Each worker sends 40 step reports back to back (loss 0.5 x step; the
  // last one's loss is NaN, an overflowed step) two seconds after its start,
  // then exits 0 at once: the
  // agent must relay all of them, the last ones before it reports the exit.
  const std::string worker = R"(
import os, socket, struct, time
s = socket.socket(fileno=os.dup(int(os.environ["VARUNA_AGENT_BEAT_FD"])))
rank = int(os.environ["RANK"])
time.sleep(2)  # (the test sees both workers started first)
for step in range(40):
    loss = float("nan") if step == 39 else 0.5 * step
    s.send(struct.pack("=iiiiqddd", rank, rank, 0, 0, step, loss, 0.25, 0.01))
)";
  t.launch({"/usr/bin/python3", "-c", worker});
  std::map<int, std::vector<proto::StepReport>> reports;
  std::map<int, size_t> reportsAtExit;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < deadline && reportsAtExit.size() < 2) {
    auto message = t.link->receive(1s);
    if (!message) continue;
    if (const auto* relay = std::get_if<proto::WorkerBeats>(&*message)) {
      CHECK(relay->generation == 1);
      for (const auto& r : relay->reports) reports[r.rank].push_back(r);
    } else if (const auto* exited = std::get_if<proto::WorkerExited>(&*message)) {
      CHECK(exited->exitCode == 0);
      reportsAtExit[exited->rank] = reports[exited->rank].size();
    }
  }
  REQUIRE(reportsAtExit.size() == 2);
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    CHECK(reportsAtExit.at(rank) == 40);  // all of them came before its WorkerExited
    REQUIRE(reports[rank].size() == 40);
    for (int step = 0; step < 40; ++step) {
      const auto& r = reports[rank][step];
      CHECK(r.step == step);
      CHECK(r.stage == rank);
      CHECK(r.stepSeconds == 0.25);
      if (step < 39) CHECK(r.loss == 0.5 * step);
    }
    CHECK(std::isnan(reports[rank][39].loss));
  }
}

TEST_CASE("agent: relays every --beat_relay_ms; while relays flow its own heartbeat is left out, then comes back",
          "[agent]") {
  // The fake manager sends nothing after the launch: a lost-manager time past the test's end.
  AgentUnderTest t("agent-relay-interval", "30", "60000", {"--beat_relay_ms", "100"});
  // Each worker beats every 20 ms for 8 s, then sleeps.
  const std::string worker = R"(
import os, socket, struct, time
s = socket.socket(fileno=os.dup(int(os.environ["VARUNA_AGENT_BEAT_FD"])))
rank = int(os.environ["RANK"])
end = time.monotonic() + 8
step = 0
while time.monotonic() < end:
    s.send(struct.pack("=iiqq", rank, 0, step, time.monotonic_ns()))
    step += 1
    time.sleep(0.02)
time.sleep(120)
)";
  t.launch({"/usr/bin/python3", "-c", worker});
  int relays = 0, heartbeats = 0;
  std::optional<std::chrono::steady_clock::time_point> firstRelay;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  // Over the first 6 s of relays: how many relays, how many of the agent's heartbeats.
  while (std::chrono::steady_clock::now() < deadline &&
         (!firstRelay || std::chrono::steady_clock::now() < *firstRelay + 6s)) {
    auto message = t.link->receive(100ms);
    if (!message) continue;
    if (std::get_if<proto::WorkerBeats>(&*message)) {
      if (!firstRelay) firstRelay = std::chrono::steady_clock::now();
      ++relays;
    } else if (const auto* beat = std::get_if<proto::Heartbeat>(&*message)) {
      if (firstRelay && beat->rank == -1) ++heartbeats;
    }
  }
  REQUIRE(firstRelay);
  // 6 s at 100 ms: about 60 (the default 250 ms could not give 25).
  CHECK(relays >= 30);
  // About 6 heartbeat ticks, each less than 200 ms after a relay: left out
  // (two spared for a relay late by 100 ms on a loaded machine).
  CHECK(heartbeats <= 2);
  // The workers fall silent: once no relay came for a second, the agent's
  // own heartbeat comes back (at most a second later).
  auto lastRelaySeen = std::chrono::steady_clock::now();
  bool heartbeatBack = false;
  const auto silentDeadline = std::chrono::steady_clock::now() + 20s;
  while (!heartbeatBack && std::chrono::steady_clock::now() < silentDeadline) {
    auto message = t.link->receive(100ms);
    if (message && std::get_if<proto::WorkerBeats>(&*message)) lastRelaySeen = std::chrono::steady_clock::now();
    const auto* beat = message ? std::get_if<proto::Heartbeat>(&*message) : nullptr;
    heartbeatBack = beat && beat->rank == -1 && std::chrono::steady_clock::now() - lastRelaySeen >= 1s;
  }
  CHECK(heartbeatBack);
}

TEST_CASE("agent: a burst of step reports larger than a frame reaches the manager whole, in order", "[agent]") {
  AgentUnderTest t("agent-report-burst", "30", "60000");
  // 15 000 reports per worker back to back (about 1.5 MiB of JSON for the
  // two, past the 1 MiB a frame may hold), then it exits.
  const std::string worker = R"(
import os, socket, struct, time
s = socket.socket(fileno=os.dup(int(os.environ["VARUNA_AGENT_BEAT_FD"])))
rank = int(os.environ["RANK"])
time.sleep(2)
for step in range(15000):
    s.send(struct.pack("=iiiiqddd", rank, rank, 0, 0, step, 0.123456789012345 * step, 0.25, 0.01))
)";
  t.launch({"/usr/bin/python3", "-c", worker});
  std::map<int, std::vector<int64_t>> steps;
  std::map<int, size_t> reportsAtExit;
  int relays = 0;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline && reportsAtExit.size() < 2) {
    auto message = t.link->receive(1s);
    if (!message) continue;
    if (const auto* relay = std::get_if<proto::WorkerBeats>(&*message)) {
      ++relays;
      CHECK(relay->reports.size() <= 2000);
      for (const auto& r : relay->reports) steps[r.rank].push_back(r.step);
    } else if (const auto* exited = std::get_if<proto::WorkerExited>(&*message)) {
      reportsAtExit[exited->rank] = steps[exited->rank].size();
    }
  }
  REQUIRE(reportsAtExit.size() == 2);
  CHECK(relays >= 15);  // 30 000 reports, 2 000 at most a frame
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    CHECK(reportsAtExit.at(rank) == 15000);
    REQUIRE(steps[rank].size() == 15000);
    for (int64_t step = 0; step < 15000; ++step) {
      if (steps[rank][step] != step) FAIL("step " << step << " arrived as " << steps[rank][step]);
    }
  }
}

namespace {

// varuna_agent started on `runDir` against a manager that is never reached;
// its exit code (nullopt: still running after 20 s) and stderr.
std::pair<std::optional<int>, std::string> startAgentOn(const fs::path& runDir, const fs::path& dir) {
  test::FakeManager manager;
  test::ChildProcess agent({(test::buildDir() / "bin" / "varuna_agent").string(), "--manager", manager.address(),
                            "--host", "127.0.0.1", "--job", "agent-run-dir", "--run_dir", runDir.string(),
                            "--code_dir", dir.string(), "--grace_s", "1"},
                           {{"VARUNA_JOB_TOKEN", "t0k-secret"}}, dir / "agent");
  const auto code = agent.wait(20s);
  return {code, agent.stderrText()};
}

}  // namespace

TEST_CASE("agent: a run folder others can write to, with a planted link, is refused; the link's target is untouched",
          "[agent][security]") {
  const fs::path dir = test::scratchDir("agent-planted-run-dir");
  const fs::path run = dir / "jobs" / "host";
  fs::create_directories(run);
  fs::permissions(run, fs::perms::all);  // 0777: what another user pre-creates
  const fs::path victim = dir / "victim.txt";
  { std::ofstream(victim) << "untouched"; }
  fs::create_symlink(victim, run / "connection.json");
  fs::create_symlink(victim, run / "agent.log");
  const auto [code, err] = startAgentOn(run, dir);
  CHECK(code == kExitConfigError);
  CHECK(err.find("writable by others") != std::string::npos);
  CHECK(test::readText(victim) == "untouched");
}

TEST_CASE("agent: a run folder that is a link, or belongs to another user, is refused", "[agent][security]") {
  const fs::path dir = test::scratchDir("agent-foreign-run-dir");
  fs::create_directories(dir / "jobs" / "elsewhere");
  fs::create_directory_symlink(dir / "jobs" / "elsewhere", dir / "jobs" / "linked");
  auto [linkCode, linkErr] = startAgentOn(dir / "jobs" / "linked", dir);
  CHECK(linkCode == kExitConfigError);
  CHECK(linkErr.find("is a symbolic link") != std::string::npos);

  fs::create_directories(dir / "jobs" / "foreign");
  REQUIRE(::chown((dir / "jobs" / "foreign").c_str(), 65534, 65534) == 0);  // nobody (the tests run as root)
  auto [foreignCode, foreignErr] = startAgentOn(dir / "jobs" / "foreign", dir);
  CHECK(foreignCode == kExitConfigError);
  CHECK(foreignErr.find("belongs to uid 65534") != std::string::npos);
}

TEST_CASE("agent: its run folder and logs are its user's only", "[agent][security]") {
  AgentUnderTest t("private-run-dir", "5");
  t.launchSleepers();
  const auto mode = [](const fs::path& p) { return fs::status(p).permissions() & fs::perms::all; };
  CHECK(mode(t.dir / "run") == fs::perms::owner_all);
  CHECK(mode(t.dir / "run" / "logs") == fs::perms::owner_all);
  for (const auto& entry : fs::directory_iterator(t.dir / "run" / "logs")) {
    CHECK(mode(entry.path()) == (fs::perms::owner_read | fs::perms::owner_write));
  }
  CHECK(mode(t.dir / "run" / "connection.json") == (fs::perms::owner_read | fs::perms::owner_write));
}

TEST_CASE("agent: the default run root is shared and sticky, its own folders private", "[agent][security]") {
  const fs::path dir = test::scratchDir("agent-default-run-root");
  test::FakeManager manager{keysOfAgent("t0k")};
  // The default run folder is <temp dir>/varuna/<job>/<host>; TMPDIR points it here.
  test::ChildProcess agent({(test::buildDir() / "bin" / "varuna_agent").string(), "--manager", manager.address(),
                            "--host", "127.0.0.1", "--job", "rootjob", "--code_dir", dir.string(), "--grace_s", "1"},
                           {{"VARUNA_JOB_TOKEN", "t0k"}, {"TMPDIR", dir.string()}}, dir / "agent");
  REQUIRE(manager.accept(20s));  // connected: its folders are made by now
  const auto mode = [](const fs::path& p) { return fs::symlink_status(p).permissions(); };
  CHECK(mode(dir / "varuna") == (fs::perms::all | fs::perms::sticky_bit));
  CHECK(mode(dir / "varuna" / "rootjob") == fs::perms::owner_all);
  CHECK(mode(dir / "varuna" / "rootjob" / "127.0.0.1") == fs::perms::owner_all);
}

TEST_CASE("agent: a default run root planted as a link, or owned by another user, is refused", "[agent][security]") {
  const auto startWithTmp = [](const fs::path& tmp) {
    test::FakeManager manager;
    test::ChildProcess agent({(test::buildDir() / "bin" / "varuna_agent").string(), "--manager", manager.address(),
                              "--host", "127.0.0.1", "--job", "rootjob", "--code_dir", tmp.string(), "--grace_s", "1"},
                             {{"VARUNA_JOB_TOKEN", "t0k"}, {"TMPDIR", tmp.string()}}, tmp / "agent");
    const auto code = agent.wait(20s);
    return std::pair{code, agent.stderrText()};
  };
  // Another user's sticky, world-writable folder, linked where the root goes.
  const fs::path linked = test::scratchDir("agent-root-linked");
  fs::create_directories(linked / "theirs");
  fs::permissions(linked / "theirs", fs::perms::all | fs::perms::sticky_bit);
  fs::create_directory_symlink(linked / "theirs", linked / "varuna");
  const auto [linkCode, linkErr] = startWithTmp(linked);
  CHECK(linkCode == kExitConfigError);
  CHECK(linkErr.find("is a symbolic link") != std::string::npos);
  CHECK(fs::is_empty(linked / "theirs"));  // nothing made through the link

  const fs::path foreign = test::scratchDir("agent-root-foreign");
  fs::create_directories(foreign / "varuna");
  fs::permissions(foreign / "varuna", fs::perms::all | fs::perms::sticky_bit);
  REQUIRE(::chown((foreign / "varuna").c_str(), 65534, 65534) == 0);  // nobody (the tests run as root)
  const auto [foreignCode, foreignErr] = startWithTmp(foreign);
  CHECK(foreignCode == kExitConfigError);
  CHECK(foreignErr.find("belongs to uid 65534, neither root nor this user") != std::string::npos);
  CHECK(fs::is_empty(foreign / "varuna"));
}

TEST_CASE("agent: a manager without the job's credentials gets nothing; the agent exits with an authentication error",
          "[agent][security]") {
  // An impostor on the manager's address (another job's run_varuna, or whoever
  // bound the port): it cannot complete the TLS handshake, so the agent sends
  // no hello, no credential, and stops.
  const fs::path dir = test::scratchDir("agent-impostor-manager");
  test::FakeManager impostor{keysOfAgent("another-jobs-secret")};
  test::ChildProcess agent({(test::buildDir() / "bin" / "varuna_agent").string(), "--manager", impostor.address(),
                            "--host", "127.0.0.1", "--job", "agent-impostor", "--run_dir", (dir / "run").string(),
                            "--code_dir", dir.string(), "--grace_s", "1"},
                           {{"VARUNA_JOB_TOKEN", "t0k"}}, dir / "agent");
  CHECK_FALSE(impostor.accept(20s));  // the handshake failed: no peer, nothing read
  CHECK_THAT(impostor.lastRefusal(), Catch::Contains("TLS handshake"));
  const auto code = agent.wait(20s);
  REQUIRE(code);
  CHECK(*code != 0);
  CHECK_THAT(agent.stderrText(), Catch::Contains("did not accept this agent's credential"));
  CHECK_FALSE(fs::exists(dir / "run" / "connection.json"));  // no notifier pointed at the impostor
}

TEST_CASE("agent: a manager of another CA gets nothing; the agent exits with an authentication error",
          "[agent][security]") {
  // Another job's run_varuna, or one whose secret was rotated: refused in the handshake.
  const fs::path dir = test::scratchDir("agent-foreign-ca");
  const auto ours = newJobCa();
  test::FakeManager impostor{newJobCa()};
  test::ChildProcess agent({(test::buildDir() / "bin" / "varuna_agent").string(), "--manager", impostor.address(),
                            "--host", "127.0.0.1", "--job", "agent-foreign-ca", "--run_dir", (dir / "run").string(),
                            "--code_dir", dir.string(), "--grace_s", "1"},
                           {{"VARUNA_JOB_TOKEN", hostCaOf(*ours, "127.0.0.1")}}, dir / "agent");
  CHECK_FALSE(impostor.accept(20s));  // the agent ended the handshake: no peer, nothing read
  const auto code = agent.wait(20s);
  REQUIRE(code);
  CHECK(*code == kExitConfigError);
  CHECK_THAT(agent.stderrText(), Catch::Contains("not signed by this job's CA"));
  CHECK_FALSE(fs::exists(dir / "run" / "connection.json"));
}

TEST_CASE("agent: a plaintext manager is refused unless the agent was told the job is plaintext", "[agent][security]") {
  const fs::path dir = test::scratchDir("agent-plaintext-manager");
  const std::vector<std::string> argv{(test::buildDir() / "bin" / "varuna_agent").string(), "--manager", "",
                                      "--host", "127.0.0.1", "--job", "agent-plaintext", "--run_dir",
                                      (dir / "run").string(), "--code_dir", dir.string(), "--grace_s", "1"};
  {
    test::FakeManager plaintext;
    auto args = argv;
    args[2] = plaintext.address();
    test::ChildProcess agent(args, {{"VARUNA_JOB_TOKEN", "t0k"}}, dir / "agent");
    auto peer = plaintext.accept(20s);
    REQUIRE(peer);
    bool gotFrame = false;  // a TLS ClientHello is no frame: nothing decodes
    try {
      gotFrame = peer->receive(3s).has_value();
    } catch (const proto::ProtocolError&) {
    }
    CHECK_FALSE(gotFrame);
    const auto code = agent.wait(20s);
    REQUIRE(code);
    CHECK(*code != 0);
  }
  test::FakeManager plaintext;
  auto args = argv;
  args[2] = plaintext.address();
  args.push_back("--insecure_plaintext_control");
  test::ChildProcess agent(args, {{"VARUNA_JOB_TOKEN", "t0k"}}, dir / "agent2");
  auto peer = plaintext.accept(20s);
  REQUIRE(peer);
  const auto hello = peer->receive(10s);
  REQUIRE(hello);
  CHECK(std::get<proto::Hello>(*hello).role == "agent");
  const auto connection = nlohmann::json::parse(test::readText(dir / "run" / "connection.json"));
  CHECK(connection.at("insecure_plaintext_control") == true);  // its notifier follows
}

TEST_CASE("agent: a launch cannot switch its workers to plaintext or hand them a credential in their environment",
          "[agent][security]") {
  AgentUnderTest t("agent-launch-env", "30");
  proto::LaunchWorkers launch;
  launch.workers = {{0, 0}};
  launch.argv = {"/bin/sh", "-c", "exec sleep 120"};
  launch.codeDir = t.dir.string();
  launch.stageToRankMap = "0;";
  launch.chunkSize = launch.batchSize = 1;
  launch.masterAddr = "127.0.0.1";
  launch.masterPort = 29999;
  launch.worldSize = 1;
  launch.generation = 1;
  launch.env = {{"VARUNA_INSECURE_PLAINTEXT_CONTROL", "1"}, {"VARUNA_JOB_TOKEN", "planted-secret"},
                {"OMP_NUM_THREADS", "3"}};
  REQUIRE(t.link->send(launch));
  std::set<pid_t> workers;
  REQUIRE(test::waitUntil([&] { return (workers = childrenOf(t.agent->pid())).size() == 1; }, 10s));
  std::string environ;
  REQUIRE(test::waitUntil([&] {
    std::ifstream in("/proc/" + std::to_string(*workers.begin()) + "/environ");
    environ.assign(std::istreambuf_iterator<char>(in), {});
    return environ.find("OMP_NUM_THREADS=3") != std::string::npos;  // after exec: the job's variables are there
  }, 10s));
  CHECK(environ.find("VARUNA_INSECURE_PLAINTEXT_CONTROL") == std::string::npos);
  CHECK(environ.find("planted-secret") == std::string::npos);
}

TEST_CASE("agent: joined, but its connection cut before the handshake, it joins again; the job's env cannot turn "
          "TLS off", "[agent][join]") {
  const std::string joinCredential = "vj1.99999999999.0123456789abcdef";
  test::FakeManager manager([&](const tls::PskIdentity& identity) -> std::optional<std::string> {
    if (identity.role == "join") return tls::pskKey(joinCredential);
    if (identity.role == "agent" && identity.host == "127.0.0.1") return tls::pskKey("agent-credential");
    return std::nullopt;
  });
  const auto dir = test::scratchDir("agent-join-retry");
  const auto tokenFile = dir / "join_token";
  std::ofstream(tokenFile) << joinCredential << "\n";
  fs::permissions(tokenFile, fs::perms::owner_read | fs::perms::owner_write);
  test::ChildProcess agent({(test::buildDir() / "bin" / "varuna_agent").string(), "--join", manager.address(),
                            "--join_token_file", tokenFile.string(), "--host", "127.0.0.1", "--job",
                            "agent-test-join-retry", "--run_dir", (dir / "run").string(), "--code_dir", dir.string(),
                            "--join_wait_s", "60"},
                           {}, dir / "agent");
  const auto admit = [&] {
    auto join = manager.accept(30s);
    REQUIRE(join);
    REQUIRE(join->identity());
    CHECK(join->identity()->role == "join");
    const auto hello = join->receive(10s);
    REQUIRE(hello);
    CHECK(std::get<proto::Hello>(*hello).role == "join");
    // A manager (or an env_file) that names the plaintext switch: the agent ignores it.
    REQUIRE(join->send(proto::Joined{"agent-credential", {{"VARUNA_INSECURE_PLAINTEXT_CONTROL", "1"}}, 0, 0}));
  };
  admit();
  REQUIRE(manager.acceptAndDrop(30s));  // the agent's own connection, cut before its handshake
  admit();                              // so it joins again (after a pause of 2 s)
  auto link = manager.accept(30s);
  REQUIRE(link);
  REQUIRE(link->identity());  // TLS, as the agent decided, not plaintext as the env said
  CHECK(link->identity()->role == "agent");
  const auto hello = link->receive(10s);
  REQUIRE(hello);
  CHECK(std::get<proto::Hello>(*hello).role == "agent");
  CHECK_FALSE(agent.wait(0ms));  // still serving
}
