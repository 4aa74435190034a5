// The ManagerDaemon in-process, on its own event loop and the real clock,
// with SimCluster's agents and workers dialling it over loopback TCP
// (sim_daemon_harness.h): what the loop does with connections that never
// say hello, with a failing accept (EMFILE), with a state write that fails
// inside a connection's close, and with its launch threads. The peers that
// misbehave (no hello, an oversized first frame) are raw sockets of the
// test's own: what these cases need is real descriptors and real time.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <filesystem>

#include <atomic>
#include <fstream>
#include <thread>

#include "sim_daemon_harness.h"
#include "varuna/common/certificate_credential.h"
#include "varuna/common/control_client.h"
#include "varuna/manager/credentials.h"

using namespace varuna;
namespace fs = std::filesystem;
using namespace std::chrono_literals;
using sim::PeerKind;

namespace {

// One host per machine-list line, one slot each, on SimCluster's agents and
// workers over TCP.
struct DaemonFixture : test::SimDaemonHarness {
  explicit DaemonFixture(const std::string& name, PendingLimits limits = {},
                         const std::vector<std::string>& hosts = {"127.0.0.1"})
      : SimDaemonHarness(name, 5000ms) {
    test::writeMachineList(dir / "machines.txt", hosts, 1);
    // One replica per host.
    const JobConfig config = test::daemonTestConfig(dir, "daemon-test", static_cast<int64_t>(hosts.size()));
    simulate(sim::fastSimOptions());
    startSimulated(config, limits);
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
  f.launcher->hold("127.0.0.1");  // the loop has not run yet: the start-up's thread waits in it
  // The one agent start-up under way (its thread starts once its start is saved).
  CHECK(f.runUntil([&] { return f.daemon->launchThreads() == 1; }));
  f.launcher->release("127.0.0.1");
  REQUIRE(f.runUntil([&] { return f.agentUp() && f.daemon->launchThreads() == 0; }));
}

TEST_CASE("daemon: connections without a hello are capped and closed at their deadline", "[daemon]") {
  PendingLimits limits;
  limits.maxPending = 8;
  limits.helloDeadline = 300ms;
  DaemonFixture f("daemon_pending", limits);
  REQUIRE(f.runUntil([&] { return f.agentUp(); }));
  // Its worker has said hello: the manager waits for no peer, so the cap is maxPending.
  REQUIRE(f.runUntil([&] {
    const int generation = f.cluster->generation();
    return generation >= 0 && f.cluster->welcomedWorkers(generation) == 1;
  }));
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(dial(f.daemon->port()));
  size_t peak = 0;
  f.runUntil([&] {
    peak = std::max(peak, f.daemon->pendingConnections());
    return false;
  }, 100ms);
  CHECK(peak <= limits.maxPending);
  // Over the cap the oldest went at once; the rest go at the deadline.
  REQUIRE(f.runUntil([&] { return std::all_of(idle.begin(), idle.end(), closedByPeer); }, 3000ms));
  CHECK(f.daemon->pendingConnections() == 0);
  // A notifier that says hello at once is never caught by either.
  std::vector<int> more;
  for (int i = 0; i < 20; ++i) more.push_back(dial(f.daemon->port()));
  f.cluster->sendPreemptNotice("127.0.0.1", 0);
  REQUIRE(f.runUntil([&] { return f.cluster->count(PeerKind::kNotifier, "ack") == 1; }));
  CHECK(std::get<proto::Ack>(f.cluster->ordersTo(PeerKind::kNotifier, "", "ack").front().message).ok);
  const auto state = f.state();
  CHECK(state["connections"]["over_the_cap"].get<int>() >= 40 - static_cast<int>(limits.maxPending));
  CHECK(state["connections"]["no_hello_in_time"].get<int>() >= 1);
  CHECK(f.daemon->handlerFailures() == 0);
  for (int fd : idle) ::close(fd);
  for (int fd : more) ::close(fd);
}

TEST_CASE("daemon: an oversized first frame is refused from its header", "[daemon]") {
  DaemonFixture f("daemon_first_frame");
  // Inside TLS, from a peer with a credential (the host CA its agent was
  // started with): its first frame is held to the hello's limit all the same.
  REQUIRE(f.runUntil([&] { return f.agentUp(); }));
  const proto::Hello agent{proto::kVersion, f.cluster->agentCredential("127.0.0.1"), "agent", "127.0.0.1", -1, -1};
  proto::Hello huge = agent;
  huge.host.assign(1000000, 'h');  // under the protocol's 1 MiB, far over a hello
  std::atomic<bool> closed{false}, handshaken{false};
  std::thread peer([&, address = "127.0.0.1:" + std::to_string(f.daemon->port())] {
    try {
      auto client = proto::ControlClient::connectTls(address, 10s, tls::clientCredential(agent));
      handshaken = true;
      client.send(huge, 10s);
      client.receive(10s);
    } catch (const std::exception&) {
    }
    closed = true;
  });
  const bool refused = f.runUntil([&] { return closed.load(); }, 10000ms);
  peer.join();
  CHECK(refused);
  CHECK(handshaken);
  CHECK(f.runUntil([&] { return f.state()["connections"]["closed_before_hello"].get<int>() >= 1; }, 5000ms));
}

// What a connection as `hello` gets from the daemon within `wait` (the
// daemon's loop runs here, the peer on a thread): its first message, and
// whether the connection is still open after it (a refused handshake ends
// it at the client's first read; a silent notifier is kept).
struct Answer {
  std::optional<proto::Message> message;
  bool open = false;
};
Answer answerTo(DaemonFixture& f, const proto::Hello& hello, std::chrono::milliseconds wait) {
  std::atomic<bool> done{false};
  Answer answer;
  std::thread peer([&, address = "127.0.0.1:" + std::to_string(f.daemon->port())] {
    try {
      auto client = proto::ControlClient::connectAs(address, 10s, hello);
      answer.message = client.receive(wait);
      answer.open = client.connected();
    } catch (const std::exception&) {
    }
    done = true;
  });
  f.runUntil([&] { return done.load(); }, wait + 15000ms);
  peer.join();
  return answer;
}

TEST_CASE("daemon: certificates of another start of a host's agent are revoked: refused, a worker ordered out",
          "[daemon][security]") {
  DaemonFixture f("daemon_host_ca_launch");
  REQUIRE(f.runUntil([&] { return f.agentUp(); }));
  // The job's root can issue host CAs, but only those of a start of the
  // host's agent run_varuna holds valid speak for the host: not one naming
  // no start, nor one of a start it never made.
  std::string caText;
  std::ifstream(f.dir / "state" / "ca") >> caText;
  const auto root = tls::CertificateCredential::parse(caText);
  const std::string current = f.cluster->agentCredential("127.0.0.1");
  REQUIRE(tls::isCertificateCredential(current));
  const auto unauthenticated = [&] { return f.state()["connections"]["unauthenticated"].get<int>(); };
  const int before = unauthenticated();
  const auto notifierOf = [](const std::string& hostCa) {
    return proto::Hello{proto::kVersion, credentials::notifier(hostCa), "notifier", "127.0.0.1", -1, -1};
  };
  const std::string noStart = root.issue({"agent", "127.0.0.1", -1, -1, ""}, true).encode();
  const std::string otherStart = root.issue({"agent", "127.0.0.1", -1, -1, "an-earlier-start"}, true).encode();
  CHECK_FALSE(answerTo(f, notifierOf(noStart), 1000ms).open);
  CHECK_FALSE(answerTo(f, notifierOf(otherStart), 1000ms).open);
  CHECK_FALSE(answerTo(f, {proto::kVersion, otherStart, "agent", "127.0.0.1", -1, -1}, 1000ms).open);
  CHECK(f.runUntil([&] { return unauthenticated() == before + 3; }, 5000ms));
  // A worker of a revoked start is let through only to be ordered out, even
  // for the running generation's rank.
  REQUIRE(f.runUntil([&] { return f.cluster->generation() >= 1; }, 20000ms));
  const int generation = f.cluster->generation();
  const auto answer = answerTo(
      f, {proto::kVersion, credentials::worker(otherStart, 0, generation), "worker", "127.0.0.1", 0, generation}, 10000ms);
  REQUIRE(answer.message);
  CHECK(std::holds_alternative<proto::ExitNow>(*answer.message));
  REQUIRE(f.runUntil([&] { return !f.events("stale_worker").empty(); }, 5000ms));
  CHECK(f.events("stale_worker").back()["revoked"] == true);  // for its certificate, not its generation
  CHECK(unauthenticated() == before + 3);
  // The current start's notifier is kept (silent, within its deadline).
  CHECK(answerTo(f, notifierOf(current), 1000ms).open);
  CHECK(unauthenticated() == before + 3);
  // The start is kept in the state folder for a restarted manager.
  std::ifstream saved(f.dir / "state" / "agent_launches");
  REQUIRE(saved);
  const auto launches = nlohmann::json::parse(saved);
  CHECK(launches["127.0.0.1"].size() == 1);
}

TEST_CASE("daemon: an agent's start is on disk before its command runs", "[daemon][security]") {
  // A manager killed the moment after starting an agent still knows the
  // start when it comes back (its notices are heard, its certificate valid).
  DaemonFixture f("daemon_launch_saved_first");
  f.launcher->hold("127.0.0.1");  // the loop has not run yet: the first start-up is held
  REQUIRE(f.runUntil([&] { return f.launcher->calls("127.0.0.1") >= 1; }, 20000ms));
  const auto savedStarts = [&] {
    std::ifstream saved(f.dir / "state" / "agent_launches");
    return saved ? nlohmann::json::parse(saved) : nlohmann::json::object();
  };
  // The command has not returned (held), and the 1 s coalescing of other
  // changes has not run either: the start was written before the command.
  const auto starts = savedStarts();
  REQUIRE(starts.contains("127.0.0.1"));
  CHECK(starts["127.0.0.1"].size() == 1);
  f.launcher->release("127.0.0.1");
  REQUIRE(f.runUntil([&] { return f.agentUp(); }));
  CHECK(savedStarts()["127.0.0.1"].size() == 1);
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
  // (which used to throw out of io.run() and end the manager). Its restarts
  // fail (an unreachable host): it is not back before the end.
  f.cluster->setHostReachable("127.0.0.1", false);
  f.cluster->dropAgent("127.0.0.1");
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
