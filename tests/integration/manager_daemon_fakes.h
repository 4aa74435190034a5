// The fake peers of the ManagerDaemon tests (manager_daemon_*_test.cpp): host
// launchers whose "agents" are blocking clients that dial the manager named in
// the agent command and say hello with the token the command gets on stdin,
// and a fake worker. Each fake agent or worker runs on a thread of its own,
// as a real one runs in a process of its own; the daemon runs on the test
// thread (DaemonHarness, daemon_harness.h).
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "varuna/common/control_client.h"
#include "varuna/manager/host_launcher.h"

namespace varuna::test {

// The manager address ("ip:port") in an agent command, if it names one.
inline std::optional<std::string> managerAddressIn(const std::string& command) {
  std::smatch match;
  if (!std::regex_search(command, match, std::regex("--manager '([^']+)'"))) return std::nullopt;
  return match[1].str();
}

// The job token an agent command gets on stdin (its first line).
inline std::string tokenIn(const std::string& input) { return input.substr(0, input.find('\n')); }

inline HostCommandResult noManagerInCommand() {
  HostCommandResult result;
  result.message = "no --manager in the command";
  return result;
}

inline HostCommandResult startedOk() {
  HostCommandResult result;
  result.ok = true;
  result.exitStatus = 0;
  return result;
}

// Starts "agents" that say hello and then stay silent.
class FakeLauncher : public HostLauncher {
 public:
  HostCommandResult run(const std::string& host, const std::string& command, const std::string& input) override {
    const auto address = managerAddressIn(command);
    if (!address) return noManagerInCommand();
    auto client = proto::ControlClient::connect(*address, std::chrono::seconds(5));
    proto::Hello hello;
    hello.token = tokenIn(input);
    hello.role = "agent";
    hello.host = host;
    client.send(hello);
    std::lock_guard<std::mutex> lock(mutex_);
    agents_.push_back(client.release());
    return startedOk();
  }
  // The fake agents' sockets (closing one is the agent going away).
  std::vector<int> agents() {
    std::lock_guard<std::mutex> lock(mutex_);
    return agents_;
  }
  ~FakeLauncher() override {
    for (int fd : agents_) ::close(fd);
  }

 private:
  std::mutex mutex_;
  std::vector<int> agents_;
};

// An agent on its own thread, as the manager sees one: hello, a heartbeat
// every 0.2 s, and the orders answered as a real agent's workers would
// (KillWorkers: they die of SIGKILL; CheckpointAndExit: they exit 75;
// Shutdown: the agent leaves). Counts the manager's heartbeats. stop() is
// the agent going away (its connection closes).
class FakeAgent {
 public:
  FakeAgent(const std::string& address, const std::string& token, const std::string& host)
      : host_(host), client_(proto::ControlClient::connect(address, std::chrono::seconds(5))) {
    proto::Hello hello;
    hello.token = token;
    hello.role = "agent";
    hello.host = host;
    client_.send(hello);
    thread_ = std::thread([this] { run(); });
  }
  ~FakeAgent() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  int heartbeatsReceived() const { return heartbeats_; }
  bool running() const { return !done_; }

 private:
  void run() {
    using namespace std::chrono_literals;
    auto lastBeat = std::chrono::steady_clock::now();
    std::vector<int> ranks;
    int generation = 0;
    try {
      while (!stop_) {
        if (std::chrono::steady_clock::now() - lastBeat > 200ms) {
          client_.send(proto::Heartbeat{-1, 0});
          lastBeat = std::chrono::steady_clock::now();
        }
        auto message = client_.receive(20ms);
        if (!message) continue;
        auto exitAll = [&](int code, int signal) {
          for (int rank : ranks) client_.send(proto::WorkerExited{host_, rank, code, signal, generation, ""});
          ranks.clear();
        };
        if (std::holds_alternative<proto::Heartbeat>(*message)) {
          ++heartbeats_;
        } else if (const auto* launch = std::get_if<proto::LaunchWorkers>(&*message)) {
          generation = launch->generation;
          ranks.clear();
          for (const auto& w : launch->workers) ranks.push_back(w.rank);
        } else if (std::holds_alternative<proto::KillWorkers>(*message)) {
          exitAll(-1, 9);
        } else if (std::holds_alternative<proto::CheckpointAndExit>(*message)) {
          exitAll(75, 0);
        } else if (std::holds_alternative<proto::Shutdown>(*message)) {
          break;
        }
      }
    } catch (const std::exception&) {
      // The manager closed the connection.
    }
    client_.close();
    done_ = true;
  }

  std::string host_;
  proto::ControlClient client_;
  std::atomic<bool> stop_{false}, done_{false};
  std::atomic<int> heartbeats_{0};
  std::thread thread_;
};

// Starts FakeAgents; a host can be made to fail its next start-ups
// (unreachable). Records when each host was started and the commands.
class FlakyLauncher : public HostLauncher {
 public:
  HostCommandResult run(const std::string& host, const std::string& command, const std::string& input) override {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      calls_[host].push_back(std::chrono::steady_clock::now());
      commands_.push_back(command);
      released_.wait(lock, [&] { return !held_.count(host); });
      if (failures_[host] > 0) {
        --failures_[host];
        HostCommandResult result;
        result.message = "fake: " + host + " is unreachable";
        return result;
      }
    }
    const auto address = managerAddressIn(command);
    if (!address) return noManagerInCommand();
    auto agent = std::make_shared<FakeAgent>(*address, tokenIn(input), host);
    std::lock_guard<std::mutex> lock(mutex_);
    agents_[host] = agent;  // the newest; the one it replaces stays alive until the launcher goes
    all_.push_back(agent);
    return startedOk();
  }
  // Start-ups of `host` block (a slow SSH connection) until released.
  void hold(const std::string& host) {
    std::lock_guard<std::mutex> lock(mutex_);
    held_.insert(host);
  }
  void release(const std::string& host) {
    std::lock_guard<std::mutex> lock(mutex_);
    held_.erase(host);
    released_.notify_all();
  }
  ~FlakyLauncher() override {
    for (const auto& host : std::set<std::string>(held_)) release(host);
  }
  void failNext(const std::string& host, int times) {
    std::lock_guard<std::mutex> lock(mutex_);
    failures_[host] = times;
  }
  std::vector<std::chrono::steady_clock::time_point> calls(const std::string& host) {
    std::lock_guard<std::mutex> lock(mutex_);
    return calls_[host];
  }
  std::shared_ptr<FakeAgent> agent(const std::string& host) {
    std::lock_guard<std::mutex> lock(mutex_);
    return agents_[host];
  }
  std::vector<std::string> commands() {
    std::lock_guard<std::mutex> lock(mutex_);
    return commands_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  std::set<std::string> held_;
  std::map<std::string, int> failures_;
  std::map<std::string, std::vector<std::chrono::steady_clock::time_point>> calls_;
  std::vector<std::string> commands_;
  std::map<std::string, std::shared_ptr<FakeAgent>> agents_;
  std::vector<std::shared_ptr<FakeAgent>> all_;
};

// A worker as the manager sees one, on its own thread: hello, a heartbeat
// (step, waiting) every 0.1 s and, while `advancing`, a finished step every
// 0.2 s (a step report); a ping on request. Stops at an ExitNow.
class FakeWorker {
 public:
  FakeWorker(const std::string& address, const std::string& token, int rank, int generation)
      : rank_(rank), client_(proto::ControlClient::connect(address, std::chrono::seconds(5))) {
    proto::Hello hello;
    hello.token = token;
    hello.role = "worker";
    hello.host = "127.0.0.1";
    hello.rank = rank;
    hello.generation = generation;
    client_.send(hello);
    thread_ = std::thread([this] { run(); });
  }
  ~FakeWorker() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  std::atomic<bool> advancing{false}, waiting{false};
  int64_t step() const { return step_; }
  bool exitOrdered() const { return exitOrdered_; }
  void requestPing() { pingRequested_ = true; }
  double pongAfterMs() const { return pongAfterMs_; }  // < 0 until the pong

 private:
  void run() {
    using namespace std::chrono_literals;
    using Clock = std::chrono::steady_clock;
    auto lastBeat = Clock::now() - 1s, lastStep = Clock::now();
    Clock::time_point pingSent{};
    try {
      while (!stop_) {
        const auto now = Clock::now();
        if (advancing && now - lastStep >= 200ms) {
          ++step_;
          client_.send(proto::StepReport{rank_, 0, rank_, step_, 2.5, 0.2, 0.05});
          lastStep = now;
        }
        if (now - lastBeat >= 100ms) {
          client_.send(proto::Heartbeat{rank_, step_, waiting});
          lastBeat = now;
        }
        if (pingRequested_.exchange(false)) {
          pingSent = Clock::now();
          client_.send(proto::Ping{1, 0});
        }
        auto message = client_.receive(20ms);
        if (!message) continue;
        if (std::holds_alternative<proto::ExitNow>(*message)) {
          exitOrdered_ = true;
          break;
        }
        if (std::holds_alternative<proto::Pong>(*message)) {
          pongAfterMs_ = std::chrono::duration<double, std::milli>(Clock::now() - pingSent).count();
        }
      }
    } catch (const std::exception&) {
      // The manager closed the connection.
    }
    client_.close();
  }

  int rank_;
  proto::ControlClient client_;
  std::atomic<int64_t> step_{0};
  std::atomic<bool> stop_{false}, exitOrdered_{false}, pingRequested_{false};
  std::atomic<double> pongAfterMs_{-1};
  std::thread thread_;
};

}  // namespace varuna::test
