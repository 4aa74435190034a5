// DaemonHarness: the real ManagerDaemon in-process, for the tests that drive
// it with a simulated cluster (sim_daemon_harness.h): on the real clock over
// TCP (manager_daemon_*_test.cpp) or on a FakeClock over the in-process
// network (daemon_sequences_test.cpp and its siblings, daemon_metrics_test.cpp).
// The daemon and whatever plays its agents and workers share one io_context, which the test thread polls (runUntil): every
// wait is on a condition with a deadline, never a bare sleep.
// On a FakeClock, runUntil first lets the loop settle (runs every handler
// that is ready, the in-memory streams' reads and writes included, and waits
// in real time while the daemon has work on other threads: agent start-ups,
// store scans), then moves
// the clock to the next timer's deadline; so seconds of job time pass in
// milliseconds, in the order they would have. useFakeClock also makes the
// in-process network (localNetwork) the daemon then accepts on instead of
// TCP: a fake-clock test's simulated peers (SimOptions::localNetwork) reach
// it over in-memory streams, and noSockets() proves that none was opened.
// Also the job such a test starts from (daemonTestConfig and a machine
// list in the test's scratch folder) and readers of what the daemon writes
// there (state.json, events.jsonl, the job token).
// Single-threaded: members are called on the test thread only. The peers:
// SimDaemonHarness (sim_daemon_harness.h) adds a SimCluster.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fake_clock.h"
#include "test_env.h"
#include "varuna/manager/local_network.h"
#include "varuna/manager/manager_daemon.h"

namespace varuna::test {

// Writes the machine list `file`: every host with `slots` slots. Truncates
// and rewrites in place, so writing the same hosts again is a rewrite with
// the same text (what brings a preempted host back).
inline void writeMachineList(const std::filesystem::path& file, const std::vector<std::string>& hosts, int slots) {
  std::ofstream out(file, std::ios::trunc);
  for (const auto& host : hosts) out << host << " slots=" << slots << "\n";
}

// A job of `nstages` stages, chunk size 1, global batch `batchSize`, on
// `dir`/machines.txt, with its store and state folder in `dir`. The agent
// command never runs: the tests' launchers start fake or simulated agents.
inline JobConfig daemonTestConfig(const std::filesystem::path& dir, const std::string& job, int64_t batchSize,
                                  int nstages = 1) {
  JobConfig config;
  config.job = job;
  config.machineList = (dir / "machines.txt").string();
  config.nstages = nstages;
  config.batchSize = batchSize;
  config.chunkSize = 1;
  config.codeDir = dir.string();
  config.managerIp = "127.0.0.1";
  config.globalStore = (dir / "store").string();
  config.stateDir = (dir / "state").string();
  config.agentPath = "/bin/false";
  config.program = {"./train"};
  // The fake workers of these tests do not salvage (they never answer a
  // salvage_stop): the rollback path, unless a test turns salvage on.
  config.noSalvage = true;
  return config;
}

// The timings of the fault-sequence tests on a fake clock (sequences,
// metrics, joins): agents silent 3 s are lost, workers 2 s; start-ups and
// checkpoints get 10 s; relaunches back off 0.2 s; five failures are allowed.
inline void fastFaultTimings(JobConfig& config) {
  config.heartbeatTimeoutS = 2;  // agents: max(this, 3) s
  config.startupTimeoutS = 10;
  config.checkpointTimeoutS = 10;
  config.agentGraceS = 1;
  config.restartBackoffS = 0.2;
  config.maxFailures = 5;
}

// The host-return tests' job (unit and integration alike): two hosts of one
// slot each, one replica per host, lost hosts retried after 0.3 s, doubling
// up to 5 s; `tweak` changes it further.
inline JobConfig hostReturnTestConfig(const std::filesystem::path& dir, const std::function<void(JobConfig&)>& tweak) {
  JobConfig config = daemonTestConfig(dir, "daemon-test", 2);
  config.restartBackoffS = 0.05;
  config.hostRetryS = 0.3;
  config.hostRetryMaxS = 5;
  if (tweak) tweak(config);
  return config;
}

// The events of `type` in `stateDir`/events.jsonl, oldest first. A line still
// being written (cut short) is skipped: it is read whole the next time.
inline std::vector<nlohmann::json> readEvents(const std::filesystem::path& stateDir, const std::string& type) {
  std::vector<nlohmann::json> out;
  std::ifstream in(stateDir / "events.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto event = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (event.is_object() && event.value("event", "") == type) out.push_back(std::move(event));
  }
  return out;
}

struct DaemonHarness {
  boost::asio::io_context io;  // first: destroyed last (the daemon and the test's peers use it)
  // Set (useFakeClock) before startDaemon: the daemon's and the peers' time.
  std::unique_ptr<FakeClock> fakeClock;
  // Made with the fake clock: the daemon's peers connect through it, no TCP.
  std::unique_ptr<LocalNetwork> localNetwork;
  std::filesystem::path dir;   // the test's scratch folder: machines.txt, store/, state/
  std::unique_ptr<ManagerDaemon> daemon;
  std::chrono::milliseconds defaultLimit;  // how long runUntil waits when not told (on the daemon's clock)

  explicit DaemonHarness(const std::string& name, std::chrono::milliseconds defaultLimit = std::chrono::seconds(10))
      : dir(scratchDir(name)), defaultLimit(defaultLimit) {}

  FakeClock& useFakeClock() {
    fakeClock = std::make_unique<FakeClock>();
    localNetwork = std::make_unique<LocalNetwork>(io);
    return *fakeClock;
  }
  // The daemon's clock: the fake one if set, else the real one.
  Clock& clock() { return fakeClock ? static_cast<Clock&>(*fakeClock) : realClock(); }
  Clock::TimePoint now() { return clock().now(); }
  DaemonHarness(const DaemonHarness&) = delete;
  DaemonHarness& operator=(const DaemonHarness&) = delete;
  ~DaemonHarness() { daemon.reset(); }  // before the io_context and the network: it joins its launch threads

  // Creates and starts the daemon on `io`. `scanner`, if given, replaces the
  // checkpoint store scan (e.g. a slow one).
  void startDaemon(const JobConfig& config, std::unique_ptr<HostLauncher> launcher, PendingLimits limits = {},
                   StoreScanner scanner = {}) {
    DaemonOptions options;
    options.pendingLimits = limits;
    options.clock = &clock();
    options.localConnections = localNetwork.get();
    daemon = std::make_unique<ManagerDaemon>(io, config, std::move(launcher), options);
    if (scanner) daemon->setStoreScanner(std::move(scanner));
    daemon->start();
  }

  // Runs the loop until done() or `limit` has passed; done()'s last value.
  template <typename Pred>
  bool runUntil(Pred done, std::chrono::milliseconds limit) {
    if (fakeClock) return runUntilOnFakeClock(done, limit);
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      io.run_for(std::chrono::milliseconds(10));
      io.restart();
    }
    return done();
  }
  template <typename Pred>
  bool runUntil(Pred done) {
    return runUntil(std::move(done), defaultLimit);
  }
  void runFor(std::chrono::milliseconds duration) {
    runUntil([] { return false; }, duration);
  }

  // Runs what is ready until nothing is: a few empty polls in a row, with no
  // work of the daemon's on another thread (for that it waits, in real time).
  void settle() {
    constexpr int kQuietPolls = 3;
    for (int quiet = 0; quiet < kQuietPolls;) {
      io.restart();
      if (io.poll() > 0) {
        quiet = 0;
      } else if (daemon && daemon->backgroundJobs() > 0) {
        io.run_for(std::chrono::milliseconds(1));
        quiet = 0;
      } else {
        ++quiet;
        std::this_thread::yield();  // a result posted from another thread lands meanwhile
      }
    }
    io.restart();
  }

 private:
  template <typename Pred>
  bool runUntilOnFakeClock(Pred& done, std::chrono::milliseconds limit) {
    const auto deadline = fakeClock->now() + limit;
    for (;;) {
      settle();
      if (done()) return true;
      if (fakeClock->now() >= deadline) return false;
      fakeClock->advanceTo(std::min(fakeClock->nextDeadline().value_or(deadline), deadline));
    }
  }

 public:

  std::vector<nlohmann::json> events(const std::string& type) const { return readEvents(dir / "state", type); }
  nlohmann::json state() const {
    while (daemon && daemon->stateWriting()) {  // the tick's rewrite, off the loop
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::ifstream in(dir / "state" / "state.json");
    return nlohmann::json::parse(in);
  }
  // The job token the daemon wrote for its peers' hellos.
  std::string token() const {
    std::ifstream in(dir / "state" / "token");
    std::string t;
    std::getline(in, t);
    return t;
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(daemon->port()); }

  // Sockets this process has open now (/proc/self/fd links "socket:[...]").
  static int openSockets() {
    int sockets = 0;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
      std::error_code linkError;
      const auto target = std::filesystem::read_symlink(entry.path(), linkError);
      if (!linkError && target.string().rfind("socket:", 0) == 0) ++sockets;
    }
    return sockets;
  }
  // For a test on the in-process network, while its peers are connected:
  // "" if its peers came through the network and nothing used a socket (no
  // control port, no TCP accept, no socket open in the process), else what did.
  std::string noSockets() const {
    std::ostringstream problems;
    if (!localNetwork || localNetwork->dials() == 0) problems << "no peer dialled the in-process network; ";
    if (daemon && daemon->port() != 0) problems << "the daemon bound control port " << daemon->port() << "; ";
    if (daemon && daemon->tcpConnectionsAccepted() != 0) {
      problems << "the daemon accepted " << daemon->tcpConnectionsAccepted() << " TCP connection(s); ";
    }
    if (const int sockets = openSockets(); sockets != 0) problems << sockets << " socket(s) open in this process; ";
    return problems.str();
  }
};

}  // namespace varuna::test
