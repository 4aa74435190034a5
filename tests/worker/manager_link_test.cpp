// The worker's ManagerLink against a fake manager: it exits the process on an
// exit order of its generation, after the grace when refused, unanswered or
// unable to connect, never without a manager; its heartbeat carries the step
// and whether the training thread waits on a peer; with an agent's beat
// socket the heartbeats go there instead, and to the manager again when the
// agent's end is gone or the descriptor is no datagram socket. And the runtime's SIGUSR1
// handler takes a request that was pending (blocked) before it was installed.
// Each link runs in a forked child (its exit is the process's), the test
// process plays the manager.
// libtorch's headers (through manager_link.h) define a CHECK of their own:
// Catch2's comes after them.
#include "link/manager_link.h"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <cstdlib>
#include <thread>

#include "fake_manager.h"
#include "varuna/common/agent_beat.h"

using namespace varuna;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kGeneration = 4;
constexpr int kRank = 3;

// The options of every link here: this job's token and generation, the test's manager.
ManagerLinkOptions linkOptions(const std::string& address, std::chrono::milliseconds heartbeatInterval) {
  ManagerLinkOptions options;
  options.address = address;
  options.token = "t0k";
  options.generation = kGeneration;
  options.host = "127.0.0.1";
  options.heartbeatInterval = heartbeatInterval;
  return options;
}

// A ManagerLink (rank 3, generation 4, step 7) in a child process that lives
// `lifetime` unless the link ends it, then exits 0.
class LinkChild {
 public:
  LinkChild(const std::string& address, ManagerLinkTimings timings, std::chrono::milliseconds lifetime) {
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      auto* link = new ManagerLink(linkOptions(address, 100ms), kRank, timings);  // never destroyed: the process ends first
      link->setStep(7);
      std::this_thread::sleep_for(lifetime);
      ::_exit(0);
    }
  }
  ~LinkChild() {
    if (!status_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  // The exit code (128 + signal) once it exited within `timeout`.
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (!status_) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      } else if (Clock::now() >= deadline) {
        break;
      } else {
        std::this_thread::sleep_for(10ms);
      }
    }
    return status_;
  }

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
};

ManagerLinkTimings fastTimings(std::chrono::milliseconds grace) {
  ManagerLinkTimings t;
  t.lostManagerGrace = grace;
  t.readInterval = 50ms;
  t.connectTimeout = 500ms;
  t.sendTimeout = 500ms;
  t.retryInterval = 100ms;
  return t;
}

// Accepts the link's connection and checks its hello.
test::FakePeer acceptHello(test::FakeManager& manager) {
  auto peer = manager.accept(10s);
  REQUIRE(peer);
  auto hello = peer->receive(5s);
  REQUIRE(hello);
  const auto& h = std::get<proto::Hello>(*hello);
  CHECK(h.role == "worker");
  CHECK(h.token == "t0k");
  CHECK(h.rank == kRank);
  CHECK(h.generation == kGeneration);
  return std::move(*peer);
}

// The next heartbeat within `timeout` for which `match` holds (others, and
// other messages, are skipped); nullopt if none came.
template <typename F>
std::optional<proto::Heartbeat> heartbeatWhere(test::FakePeer& peer, F&& match, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    auto m = peer.receive(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    if (!m) break;
    if (auto* h = std::get_if<proto::Heartbeat>(&*m); h && match(*h)) return *h;
  }
  return std::nullopt;
}

// A link (rank 3, generation 4, step 7, beats every 50 ms) in a forked child
// that lives until killed, beating through `agentBeatFd`; `othersEnd` (the
// test's end, inherited by the fork) is closed in the child, so that the
// test closing its copy closes that end for good.
pid_t linkWithBeatSocket(const std::string& address, int agentBeatFd, int othersEnd) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::close(othersEnd);
  ManagerLinkOptions options = linkOptions(address, 50ms);
  options.agentBeatFd = agentBeatFd;
  auto* link = new ManagerLink(options, kRank, fastTimings(30s));  // the process ends first
  link->setStep(7);
  std::this_thread::sleep_for(60s);
  ::_exit(0);
}

// The next beat record on `fd` within `timeout`.
std::optional<AgentBeatRecord> receiveBeat(int fd, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return std::nullopt;
  char buffer[64];
  const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
  return n > 0 ? AgentBeatRecord::decode(buffer, static_cast<size_t>(n)) : std::nullopt;
}

double secondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

TEST_CASE("manager link: an exit order of its generation ends the process at once with code 76", "[manager_link]") {
  test::FakeManager manager;
  LinkChild child(manager.address(), fastTimings(30s), 60s);
  auto peer = acceptHello(manager);
  REQUIRE(peer.send(proto::Welcome{kGeneration, 30000}));
  // The heartbeat carries the step (set just after the link started: the
  // first heartbeat may still say -1); reading does not hold it back.
  std::optional<proto::Heartbeat> heartbeat;
  for (int i = 0; i < 100 && !(heartbeat && heartbeat->step == 7); ++i) {
    auto m = peer.receive(5s);
    REQUIRE(m);
    if (auto* h = std::get_if<proto::Heartbeat>(&*m)) heartbeat = *h;
  }
  REQUIRE(heartbeat);
  CHECK(heartbeat->rank == kRank);
  CHECK(heartbeat->step == 7);
  // An order for another generation is not this worker's.
  REQUIRE(peer.send(proto::ExitNow{kGeneration - 1, "an older generation"}));
  CHECK_FALSE(child.wait(500ms));
  const auto ordered = Clock::now();
  REQUIRE(peer.send(proto::ExitNow{kGeneration, "rank 1 exited with code 3 (lost a peer)"}));
  CHECK(child.wait(5s) == kExitSuperseded);
  CHECK(secondsSince(ordered) < 2.0);  // readInterval is 50 ms; generous for a loaded machine
}

TEST_CASE("manager link: refused, it exits after the grace and not before", "[manager_link]") {
  test::FakeManager manager;
  const auto start = Clock::now();
  LinkChild child(manager.address(), fastTimings(1500ms), 60s);
  int refusals = 0;
  std::optional<int> code;
  while (!(code = child.wait(0ms)) && secondsSince(start) < 10) {
    auto peer = manager.accept(100ms);
    if (!peer) continue;
    if (peer->receive(2s)) {
      peer->send(proto::Ack{false, "generation 4 is over"});
      ++refusals;
    }
  }
  const double elapsed = secondsSince(start);
  CHECK(code == kExitSuperseded);
  CHECK(refusals >= 2);  // it kept trying within the grace
  CHECK(elapsed >= 1.4);
  CHECK(elapsed < 6.0);
}

TEST_CASE("manager link: with no manager to reach, it exits after the grace", "[manager_link]") {
  std::string address;
  {
    test::FakeManager closed;  // a port nothing listens on once it is gone
    address = closed.address();
  }
  const auto start = Clock::now();
  LinkChild child(address, fastTimings(1000ms), 60s);
  CHECK(child.wait(8s) == kExitSuperseded);
  CHECK(secondsSince(start) >= 0.9);
}

TEST_CASE("manager link: answered pings keep it alive past the grace; silence ends it", "[manager_link]") {
  test::FakeManager manager;
  // The manager's Welcome sets the grace (1 s) over the worker's own (30 s).
  LinkChild child(manager.address(), fastTimings(30s), 60s);
  auto peer = acceptHello(manager);
  REQUIRE(peer.send(proto::Welcome{kGeneration, 1000}));
  const auto start = Clock::now();
  int pings = 0, heartbeats = 0;
  while (secondsSince(start) < 3.0) {
    auto m = peer.receive(100ms);
    if (!m) continue;
    if (auto* ping = std::get_if<proto::Ping>(&*m)) {
      ++pings;
      peer.send(proto::Pong{ping->sequence, ping->sentNs});
    }
    if (std::holds_alternative<proto::Heartbeat>(*m)) ++heartbeats;
  }
  CHECK_FALSE(child.wait(0ms));
  CHECK(pings >= 5);        // every grace / 5
  CHECK(heartbeats >= 10);  // every 100 ms, pings or not
  // The manager stops answering (frozen, or a partition): the connection stays
  // up, the pings go unanswered.
  const auto silent = Clock::now();
  CHECK(child.wait(8s) == kExitSuperseded);
  CHECK(secondsSince(silent) >= 0.8);
}

TEST_CASE("manager link: without a manager address it never exits the process", "[manager_link]") {
  LinkChild child("", fastTimings(200ms), 1500ms);
  CHECK(child.wait(10s) == 0);  // lived its whole life
}

TEST_CASE("manager link: heartbeats carry the last finished step and whether the training thread waits",
          "[manager_link]") {
  test::FakeManager manager;
  int commands[2];
  REQUIRE(::pipe(commands) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The "training thread": each byte from the test advances one phase.
    ::close(commands[1]);
    static std::atomic<bool> waiting{false};
    auto* link = new ManagerLink(linkOptions(manager.address(), 50ms), kRank, fastTimings(30s), &waiting);  // the process ends first
    char command = 0;
    while (::read(commands[0], &command, 1) == 1) {
      if (command == 'w') {
        link->setStep(7);
        waiting.store(true);  // e.g. blocked in an all-reduce
      } else if (command == 'c') {
        link->setStep(8);
        waiting.store(false);  // computing
      }
    }
    ::_exit(0);
  }
  ::close(commands[0]);
  auto peer = acceptHello(manager);
  // Before any step finished: -1, not waiting.
  auto first = heartbeatWhere(peer, [](const proto::Heartbeat&) { return true; }, 5s);
  REQUIRE(first);
  CHECK(first->rank == kRank);
  CHECK(first->step == -1);
  CHECK_FALSE(first->waiting);
  REQUIRE(::write(commands[1], "w", 1) == 1);
  auto waiting = heartbeatWhere(peer, [](const proto::Heartbeat& h) { return h.step == 7; }, 5s);
  REQUIRE(waiting);
  CHECK(waiting->waiting);
  REQUIRE(::write(commands[1], "c", 1) == 1);
  auto computing = heartbeatWhere(peer, [](const proto::Heartbeat& h) { return h.step == 8; }, 5s);
  REQUIRE(computing);
  CHECK_FALSE(computing->waiting);
  ::close(commands[1]);  // the child ends
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
}

TEST_CASE("the checkpoint signal handler takes a SIGUSR1 that was pending before it was installed",
          "[manager_link][signal]") {
  // What a worker started by varuna_agent (SIGUSR1 blocked) sees when a
  // checkpoint request arrives during its start-up. In a child: it changes
  // the process's signal state.
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    ::sigprocmask(SIG_BLOCK, &usr1, nullptr);
    ::kill(::getpid(), SIGUSR1);  // pending: blocked, so not the default action's death
    if (checkpointSignalled()) ::_exit(1);
    installCheckpointSignalHandler();
    ::_exit(checkpointSignalled() ? 0 : 2);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  INFO("status " << status);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("manager link: with an agent's beat socket heartbeats go there; with its end gone, to the manager",
          "[manager_link]") {
  test::FakeManager manager;
  int pair[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_DGRAM, 0, pair) == 0);
  const pid_t pid = linkWithBeatSocket(manager.address(), pair[1], pair[0]);
  REQUIRE(pid >= 0);
  ::close(pair[1]);
  auto peer = acceptHello(manager);
  // The first heartbeat after the hello goes to the manager itself (a relay
  // could overtake the hello)...
  REQUIRE(heartbeatWhere(peer, [](const proto::Heartbeat&) { return true; }, 5s));
  // ...the next ones through the agent's socket, carrying the step (the
  // first may still say -1: the link starts before the step is set)...
  int withStep = 0;
  const auto deadline = Clock::now() + 10s;
  while (withStep < 5 && Clock::now() < deadline) {
    const auto beat = receiveBeat(pair[0], 5s);
    REQUIRE(beat);
    CHECK(beat->rank == kRank);
    CHECK(beat->waiting == 0);
    CHECK(std::abs(monotonicNs() - beat->sentNs) < 5'000'000'000);  // stamped when sent
    if (beat->step == 7) ++withStep;
  }
  CHECK(withStep == 5);
  // ...and none of them to the manager (only the link's pings, if any).
  while (auto m = peer.receive(0ms)) CHECK_FALSE(std::holds_alternative<proto::Heartbeat>(*m));
  // The agent's end is gone (a dead agent): the link beats to the manager.
  ::close(pair[0]);
  auto direct = heartbeatWhere(peer, [](const proto::Heartbeat& h) { return h.step == 7; }, 5s);
  REQUIRE(direct);
  CHECK(direct->rank == kRank);
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

TEST_CASE("manager link: a beat descriptor that is no datagram socket is never written; beats go to the manager",
          "[manager_link]") {
  test::FakeManager manager;
  int pipeFds[2];
  REQUIRE(::pipe(pipeFds) == 0);
  const pid_t pid = linkWithBeatSocket(manager.address(), pipeFds[1], pipeFds[0]);
  REQUIRE(pid >= 0);
  ::close(pipeFds[1]);
  auto peer = acceptHello(manager);
  REQUIRE(heartbeatWhere(peer, [](const proto::Heartbeat& h) { return h.step == 7; }, 5s));
  pollfd p{pipeFds[0], POLLIN, 0};
  CHECK(::poll(&p, 1, 0) == 0);  // nothing was written into the pipe
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  ::close(pipeFds[0]);
}
