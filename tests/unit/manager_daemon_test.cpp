// The ManagerDaemon in-process, on its own event loop, with a fake
// HostLauncher whose "agents" are blocking clients that dial back and say
// hello: what the loop does with connections that never say hello, with a
// failing accept (EMFILE), with a state write that fails inside a
// connection's close, and with its launch threads.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <atomic>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <mutex>
#include <regex>

#include "test_env.h"
#include "varuna/common/control_client.h"
#include "varuna/manager/manager_daemon.h"

using namespace varuna;
namespace asio = boost::asio;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

// Starts "agents" by dialling the manager named in the agent command and
// saying hello with the token it is given on stdin; they then stay silent.
class FakeLauncher : public HostLauncher {
 public:
  HostCommandResult run(const std::string& host, const std::string& command, const std::string& input) override {
    std::smatch match;
    const bool found = std::regex_search(command, match, std::regex("--manager '([^']+)'"));
    HostCommandResult result;
    if (!found) {
      result.message = "no --manager in the command";
      return result;
    }
    auto client = proto::ControlClient::connect(match[1].str(), std::chrono::seconds(5));
    proto::Hello hello;
    hello.token = input.substr(0, input.find('\n'));
    hello.role = "agent";
    hello.host = host;
    client.send(hello);
    std::lock_guard<std::mutex> lock(mutex_);
    agents_.push_back(client.release());
    result.ok = true;
    result.exitStatus = 0;
    return result;
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

struct DaemonFixture {
  asio::io_context io;
  FakeLauncher* launcher = nullptr;
  std::unique_ptr<ManagerDaemon> daemon;
  fs::path dir;

  explicit DaemonFixture(const std::string& name, PendingLimits limits = {},
                         const std::vector<std::string>& hosts = {"127.0.0.1"})
      : dir(test::scratchDir(name)) {
    std::ofstream machines(dir / "machines.txt");
    for (const auto& host : hosts) machines << host << " slots=1\n";
    machines.close();
    JobConfig config;
    config.job = "daemon-test";
    config.machineList = (dir / "machines.txt").string();
    config.nstages = 1;
    config.batchSize = static_cast<int64_t>(hosts.size());  // one replica per host
    config.chunkSize = 1;
    config.codeDir = dir.string();
    config.managerIp = "127.0.0.1";
    config.globalStore = (dir / "store").string();
    config.stateDir = (dir / "state").string();
    config.agentPath = "/bin/false";  // never run: the launcher is fake
    config.program = {"./train"};
    auto fake = std::make_unique<FakeLauncher>();
    launcher = fake.get();
    daemon = std::make_unique<ManagerDaemon>(io, config, std::move(fake), limits);
    daemon->start();
  }
  ~DaemonFixture() { daemon.reset(); }  // before the io_context: it joins launch threads

  template <typename Pred>
  bool runUntil(Pred done, std::chrono::milliseconds limit = 5000ms) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      io.run_for(10ms);
      io.restart();
    }
    return done();
  }
  void runFor(std::chrono::milliseconds duration) {
    runUntil([] { return false; }, duration);
  }
  nlohmann::json state() {
    std::ifstream in(dir / "state" / "state.json");
    return nlohmann::json::parse(in);
  }
  bool agentUp(const std::string& host = "127.0.0.1") {
    try {
      return state()["hosts"][host]["agent"] == "up";
    } catch (const std::exception&) {
      return false;
    }
  }
};

// A socket connected to the daemon (the kernel completes it; the daemon
// accepts when its loop runs).
int dial(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  return fd;
}

// True once the peer has closed `fd` (EOF or reset); false while it is open.
bool closedByPeer(int fd) {
  char byte;
  const ssize_t n = ::recv(fd, &byte, 1, MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

}  // namespace

TEST_CASE("daemon: launch threads are joined when their result arrives", "[daemon]") {
  DaemonFixture f("daemon_launch_threads");
  CHECK(f.daemon->launchThreads() == 1);  // the one agent start-up under way
  REQUIRE(f.runUntil([&] { return f.agentUp() && f.daemon->launchThreads() == 0; }));
}

TEST_CASE("daemon: connections without a hello are capped and closed at their deadline", "[daemon]") {
  PendingLimits limits;
  limits.maxPending = 8;
  limits.helloDeadline = 300ms;
  DaemonFixture f("daemon_pending", limits);
  REQUIRE(f.runUntil([&] { return f.agentUp(); }));
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(dial(f.daemon->port()));
  size_t peak = 0;
  f.runUntil([&] {
    peak = std::max(peak, f.daemon->pendingConnections());
    return false;
  }, 100ms);
  CHECK(peak <= limits.maxPending + 1);  // + the launched worker that has not said hello (a fake agent starts none)
  // Over the cap the oldest went at once; the rest go at the deadline.
  REQUIRE(f.runUntil([&] { return std::all_of(idle.begin(), idle.end(), closedByPeer); }, 3000ms));
  CHECK(f.daemon->pendingConnections() == 0);
  // A notifier that says hello at once is never caught by either.
  std::vector<int> more;
  for (int i = 0; i < 20; ++i) more.push_back(dial(f.daemon->port()));
  const auto token = [&] {
    std::ifstream in(f.dir / "state" / "token");
    std::string t;
    std::getline(in, t);
    return t;
  }();
  std::optional<proto::Message> reply;
  std::thread notifier([&] {
    auto client = proto::ControlClient::connect("127.0.0.1:" + std::to_string(f.daemon->port()), 5s);
    proto::Hello hello;
    hello.token = token;
    hello.role = "notifier";
    hello.host = "127.0.0.1";
    client.send(hello);
    client.send(proto::PreemptNotice{"127.0.0.1", 0});
    reply = client.receive(5s);
  });
  f.runUntil([&] { return reply.has_value(); });
  notifier.join();
  REQUIRE(reply);
  CHECK(std::get<proto::Ack>(*reply).ok);
  const auto state = f.state();
  CHECK(state["connections"]["over_the_cap"].get<int>() >= 40 - static_cast<int>(limits.maxPending));
  CHECK(state["connections"]["no_hello_in_time"].get<int>() >= 1);
  CHECK(f.daemon->handlerFailures() == 0);
  for (int fd : idle) ::close(fd);
  for (int fd : more) ::close(fd);
}

TEST_CASE("daemon: an oversized first frame is refused from its header", "[daemon]") {
  DaemonFixture f("daemon_first_frame");
  const int fd = dial(f.daemon->port());
  const uint32_t n = 1000000;  // under the protocol's 1 MiB, far over a hello
  const unsigned char head[4] = {static_cast<unsigned char>(n >> 24), static_cast<unsigned char>(n >> 16),
                                 static_cast<unsigned char>(n >> 8), static_cast<unsigned char>(n)};
  REQUIRE(::write(fd, head, 4) == 4);
  REQUIRE(f.runUntil([&] { return closedByPeer(fd); }, 2000ms));
  ::close(fd);
}

TEST_CASE("daemon: a failing accept (EMFILE) backs off instead of spinning", "[daemon]") {
  DaemonFixture f("daemon_emfile");
  REQUIRE(f.runUntil([&] { return f.agentUp(); }));
  std::vector<int> clients;
  for (int i = 0; i < 5; ++i) clients.push_back(dial(f.daemon->port()));  // in the listen queue
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
  // The lowest free descriptor number as the limit: every new one fails.
  const int lowestFree = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(lowestFree >= 0);
  ::close(lowestFree);
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(lowestFree);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  const uint64_t before = f.daemon->acceptFailures();
  REQUIRE_NOTHROW(f.runFor(1000ms));  // state writes fail too (no descriptor): retried
  const uint64_t failures = f.daemon->acceptFailures() - before;
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &saved) == 0);
  // 50 + 100 + 200 + 400 ms: about 4 in a second (a busy loop: hundreds of thousands).
  CHECK(failures >= 2);
  CHECK(failures <= 8);
  // Descriptors again: the queued connections are accepted (and, silent,
  // closed later). Some may have been accepted during the shortage (a
  // descriptor another of the daemon's threads freed for a moment) and shed
  // at the next failure to make room, as designed: their clients see the
  // close. Every one is accounted for, and a new peer gets in.
  auto accounted = [&] {
    size_t shed = 0;
    for (int fd : clients) shed += closedByPeer(fd);
    return f.daemon->pendingConnections() + shed == clients.size();
  };
  REQUIRE(f.runUntil(accounted, 3000ms));
  const size_t pendingBefore = f.daemon->pendingConnections();
  clients.push_back(dial(f.daemon->port()));
  REQUIRE(f.runUntil([&] { return f.daemon->pendingConnections() == pendingBefore + 1; }, 3000ms));
  CHECK_FALSE(f.daemon->stateWriteFailing());
  CHECK(f.daemon->handlerFailures() == 0);
  for (int fd : clients) ::close(fd);
}

TEST_CASE("daemon: a state write failing inside a connection's close is retried, not fatal", "[daemon]") {
  DaemonFixture f("daemon_state_write", {}, {"127.0.0.1", "127.0.0.2"});
  REQUIRE(f.runUntil([&] { return f.agentUp("127.0.0.1") && f.agentUp("127.0.0.2"); }));
  // state.json cannot be written: its temporary file's name is taken by a folder.
  const fs::path blocker = f.dir / "state" / ("state.json.tmp." + std::to_string(::getpid()));
  fs::create_directories(blocker);
  // An agent goes away: its connection's onClose declares the host lost,
  // the controller kills the generation, and the state is written at once
  // (which used to throw out of io.run() and end the manager).
  ::shutdown(f.launcher->agents().at(0), SHUT_RDWR);
  REQUIRE_NOTHROW(f.runUntil([&] { return f.daemon->stateWriteFailing(); }, 3000ms));
  REQUIRE(f.daemon->stateWriteFailing());
  REQUIRE_NOTHROW(f.runFor(300ms));  // retried at every tick, logged once
  CHECK(f.daemon->handlerFailures() == 0);
  fs::remove(blocker);
  REQUIRE(f.runUntil([&] { return !f.daemon->stateWriteFailing(); }, 2000ms));
  const auto state = f.state();
  CHECK(state["hosts"].size() == 2);
  CHECK(state["hosts"]["127.0.0.1"]["agent"] != state["hosts"]["127.0.0.2"]["agent"]);  // one up, one gone
}

// --- hosts that come back ---------------------------------------------------------

namespace {

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
    HostCommandResult result;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      calls_[host].push_back(std::chrono::steady_clock::now());
      commands_.push_back(command);
      released_.wait(lock, [&] { return !held_.count(host); });
      if (failures_[host] > 0) {
        --failures_[host];
        result.message = "fake: " + host + " is unreachable";
        return result;
      }
    }
    std::smatch match;
    if (!std::regex_search(command, match, std::regex("--manager '([^']+)'"))) {
      result.message = "no --manager in the command";
      return result;
    }
    auto agent = std::make_shared<FakeAgent>(match[1].str(), input.substr(0, input.find('\n')), host);
    std::lock_guard<std::mutex> lock(mutex_);
    agents_[host] = agent;  // the newest; the one it replaces stays alive until the launcher goes
    all_.push_back(agent);
    result.ok = true;
    result.exitStatus = 0;
    return result;
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

const std::vector<std::string> kTwoHosts = {"127.0.0.1", "127.0.0.2"};

struct ReturnFixture {
  asio::io_context io;
  FlakyLauncher* launcher = nullptr;
  std::unique_ptr<ManagerDaemon> daemon;
  fs::path dir;
  std::string listText;

  ReturnFixture(const std::string& name, const std::function<void(JobConfig&)>& tweak = {})
      : dir(test::scratchDir(name)) {
    for (const auto& host : kTwoHosts) listText += host + " slots=1\n";
    writeList();
    JobConfig config;
    config.job = "daemon-test";
    config.machineList = (dir / "machines.txt").string();
    config.nstages = 1;
    config.batchSize = 2;  // one replica per host
    config.chunkSize = 1;
    config.codeDir = dir.string();
    config.managerIp = "127.0.0.1";
    config.globalStore = (dir / "store").string();
    config.stateDir = (dir / "state").string();
    config.agentPath = "/bin/false";  // never run: the launcher is fake
    config.program = {"./train"};
    config.restartBackoffS = 0.05;
    config.hostRetryS = 0.3;
    config.hostRetryMaxS = 5;
    if (tweak) tweak(config);
    auto fake = std::make_unique<FlakyLauncher>();
    launcher = fake.get();
    daemon = std::make_unique<ManagerDaemon>(io, config, std::move(fake));
    daemon->start();
  }
  ~ReturnFixture() { daemon.reset(); }

  // The same text written again (truncated and rewritten in place).
  void writeList() {
    std::ofstream machines(dir / "machines.txt", std::ios::trunc);
    machines << listText;
  }
  template <typename Pred>
  bool runUntil(Pred done, std::chrono::milliseconds limit = 10000ms) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      io.run_for(10ms);
      io.restart();
    }
    return done();
  }
  std::vector<nlohmann::json> events(const std::string& name) {
    std::vector<nlohmann::json> out;
    std::ifstream in(dir / "state" / "events.jsonl");
    for (std::string line; std::getline(in, line);) {
      try {
        auto event = nlohmann::json::parse(line);
        if (event.value("event", "") == name) out.push_back(event);
      } catch (const std::exception&) {
      }
    }
    return out;
  }
  nlohmann::json state() {
    std::ifstream in(dir / "state" / "state.json");
    return nlohmann::json::parse(in);
  }
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
};

double secondsFrom(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

TEST_CASE("daemon: a lost host is started again with backoff and the job grows back", "[daemon][hosts]") {
  ReturnFixture f("daemon_host_retry");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  f.launcher->failNext("127.0.0.2", 2);  // unreachable for its next two start-ups
  const auto lostAt = std::chrono::steady_clock::now();
  f.launcher->agent("127.0.0.2")->stop();  // the agent goes away
  REQUIRE(f.runUntil([&] { return f.hostBack("127.0.0.2"); }));
  const auto calls = f.launcher->calls("127.0.0.2");
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
  const auto lostAgainAt = std::chrono::steady_clock::now();
  f.launcher->agent("127.0.0.2")->stop();
  REQUIRE(f.runUntil([&] { return f.launcher->calls("127.0.0.2").size() == 5; }));
  CHECK(secondsFrom(lostAgainAt, f.launcher->calls("127.0.0.2")[4]) >= 2.4);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("daemon: one start-up per host at a time; the loop is never blocked by one", "[daemon][hosts]") {
  ReturnFixture f("daemon_host_retry_one_at_a_time");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  f.launcher->hold("127.0.0.2");  // its next start-up hangs (a slow SSH connection)
  f.launcher->agent("127.0.0.2")->stop();
  REQUIRE(f.runUntil([&] { return f.launcher->calls("127.0.0.2").size() == 2; }));
  REQUIRE(f.runUntil([&] { return f.state()["hosts"]["127.0.0.2"]["agent"] == "starting"; }));
  const auto out = f.state()["hosts"]["127.0.0.2"]["out"];
  CHECK(out["why"] == "lost");
  CHECK(out["back_when"] == "its agent is up");
  // A list write asks for a retry at once, and the backoff passes: still the one start-up.
  f.writeList();
  REQUIRE(f.runUntil([&] { return f.events("hosts_readmitted").size() == 1; }));
  f.runUntil([] { return false; }, 1000ms);  // the loop runs on meanwhile (state.json is written)
  CHECK(f.launcher->calls("127.0.0.2").size() == 2);
  CHECK(f.daemon->launchThreads() == 1);
  f.launcher->release("127.0.0.2");
  REQUIRE(f.runUntil([&] { return f.hostBack("127.0.0.2"); }));
  CHECK(f.launcher->calls("127.0.0.2").size() == 2);
  REQUIRE(f.runUntil([&] { return f.daemon->launchThreads() == 0; }));
}

TEST_CASE("daemon: a preempted host comes back when the machine list is written with the same text",
          "[daemon][hosts]") {
  ReturnFixture f("daemon_preempted_back");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  const std::string token = [&] {
    std::ifstream in(f.dir / "state" / "token");
    std::string t;
    std::getline(in, t);
    return t;
  }();
  // The cloud takes 127.0.0.2 in ten minutes.
  std::optional<proto::Message> reply;
  std::thread notifier([&] {
    auto client = proto::ControlClient::connect("127.0.0.1:" + std::to_string(f.daemon->port()), 5s);
    proto::Hello hello;
    hello.token = token;
    hello.role = "notifier";
    hello.host = "127.0.0.2";
    client.send(hello);
    client.send(proto::PreemptNotice{"127.0.0.2", unixMillisNow() + 600000});
    reply = client.receive(5s);
  });
  REQUIRE(f.runUntil([&] { return reply.has_value(); }));
  notifier.join();
  // Checkpoint, relaunch without it, its agent released.
  REQUIRE(f.runUntil([&] { return f.launches() == 2 && !f.launcher->agent("127.0.0.2")->running(); }));
  CHECK(f.launchedOn() == std::vector<std::string>{"127.0.0.1"});
  REQUIRE(f.runUntil([&] { return f.state()["hosts"]["127.0.0.2"]["agent"] == "gone"; }));
  auto out = f.state()["hosts"]["127.0.0.2"]["out"];
  CHECK(out["why"] == "preempted");
  CHECK(out["back_when"] == "the preemption deadline has passed");
  CHECK(f.launcher->calls("127.0.0.2").size() == 1);  // not retried before the deadline
  // The operator writes the list again, unchanged: the host is there.
  f.writeList();
  REQUIRE(f.runUntil([&] { return f.hostBack("127.0.0.2"); }));
  CHECK(f.launcher->calls("127.0.0.2").size() == 2);
  CHECK(f.events("hosts_readmitted").size() == 1);
  CHECK(f.events("host_back").front()["why"] == "preempted");
  REQUIRE(f.runUntil([&] { return f.launches() == 3 && f.launchedOn() == kTwoHosts; }));
  REQUIRE(f.runUntil([&] { return f.state()["hosts"]["127.0.0.2"]["preempted"] == false; }));
}

TEST_CASE("daemon: a preempted host is tried again after the notice's deadline", "[daemon][hosts]") {
  ReturnFixture f("daemon_preempted_deadline");
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts; }));
  const std::string token = [&] {
    std::ifstream in(f.dir / "state" / "token");
    std::string t;
    std::getline(in, t);
    return t;
  }();
  const int64_t deadlineUnixMs = unixMillisNow() + 1500;
  const auto deadline = std::chrono::steady_clock::now() + 1500ms;
  std::optional<proto::Message> reply;
  std::thread notifier([&] {
    auto client = proto::ControlClient::connect("127.0.0.1:" + std::to_string(f.daemon->port()), 5s);
    proto::Hello hello;
    hello.token = token;
    hello.role = "notifier";
    hello.host = "127.0.0.2";
    client.send(hello);
    client.send(proto::PreemptNotice{"127.0.0.2", deadlineUnixMs});
    reply = client.receive(5s);
  });
  REQUIRE(f.runUntil([&] { return reply.has_value(); }));
  notifier.join();
  REQUIRE(f.runUntil([&] { return f.hostBack("127.0.0.2"); }));
  const auto calls = f.launcher->calls("127.0.0.2");
  REQUIRE(calls.size() == 2);
  CHECK(calls[1] >= deadline - 50ms);  // the clocks differ by the notice's round trip at most
  REQUIRE(f.runUntil([&] { return f.launchedOn() == kTwoHosts && f.launches() >= 3; }));
}

TEST_CASE("daemon: the manager heartbeats its agents and hands them the lost-manager deadline", "[daemon][hosts]") {
  ReturnFixture f("daemon_agent_heartbeats", [](JobConfig& c) {
    c.heartbeatTimeoutS = 4;
    c.agentGraceS = 2.5;
  });
  REQUIRE(f.runUntil([&] { return f.launcher->agent("127.0.0.1") && f.launcher->agent("127.0.0.2"); }));
  REQUIRE(f.runUntil([&] {
    return f.launcher->agent("127.0.0.1")->heartbeatsReceived() >= 3 &&
           f.launcher->agent("127.0.0.2")->heartbeatsReceived() >= 3;
  }));
  const auto commands = f.launcher->commands();
  REQUIRE(commands.size() == 2);
  for (const auto& command : commands) CHECK_THAT(command, Catch::Contains(" --lost_manager_ms 6500 "));
}

// --- liveness is progress; the loop never waits on the store ----------------------

namespace {

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

// One host with `slots` ranks (one stage, a replica per slot) on FlakyLauncher's
// agents (they heartbeat and answer orders), and a store scan of the test's choosing.
struct LivenessFixture {
  asio::io_context io;
  std::unique_ptr<ManagerDaemon> daemon;
  fs::path dir;

  LivenessFixture(const std::string& name, int slots, const std::function<void(JobConfig&)>& tweak,
                  StoreScanner scanner = {})
      : dir(test::scratchDir(name)) {
    std::ofstream(dir / "machines.txt") << "127.0.0.1 slots=" << slots << "\n";
    JobConfig config;
    config.job = "daemon-test";
    config.machineList = (dir / "machines.txt").string();
    config.nstages = 1;
    config.batchSize = slots;
    config.chunkSize = 1;
    config.codeDir = dir.string();
    config.managerIp = "127.0.0.1";
    config.globalStore = (dir / "store").string();
    config.stateDir = (dir / "state").string();
    config.agentPath = "/bin/false";  // never run: the launcher is fake
    config.program = {"./train"};
    config.restartBackoffS = 0.05;
    if (tweak) tweak(config);
    daemon = std::make_unique<ManagerDaemon>(io, config, std::make_unique<FlakyLauncher>());
    if (scanner) daemon->setStoreScanner(std::move(scanner));
    daemon->start();
  }
  ~LivenessFixture() { daemon.reset(); }

  template <typename Pred>
  bool runUntil(Pred done, std::chrono::milliseconds limit = 10000ms) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      io.run_for(10ms);
      io.restart();
    }
    return done();
  }
  void runFor(std::chrono::milliseconds duration) {
    runUntil([] { return false; }, duration);
  }
  std::vector<nlohmann::json> events(const std::string& name) {
    std::vector<nlohmann::json> out;
    std::ifstream in(dir / "state" / "events.jsonl");
    for (std::string line; std::getline(in, line);) {
      try {
        auto event = nlohmann::json::parse(line);
        if (event.value("event", "") == name) out.push_back(event);
      } catch (const std::exception&) {
      }
    }
    return out;
  }
  std::string token() {
    std::ifstream in(dir / "state" / "token");
    std::string t;
    std::getline(in, t);
    return t;
  }
  std::string address() { return "127.0.0.1:" + std::to_string(daemon->port()); }
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
