// The manager's I/O building blocks, each on its own: framed connections over
// loopback (Asio) and what an unauthenticated peer can make them cost, the
// handler guard, the registry of connections before their hello, the
// blocking client, local commands, shell quoting, the event log and the
// agent's helpers.
#include <catch2/catch.hpp>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_env.h"
#include "varuna/common/control_client.h"
#include "agent/agent.h"
#include "agent/run_dir.h"
#include "agent/scheduler_grace.h"
#include "daemon/async_planner.h"
#include "loop/background_worker.h"
#include "loop/event_log.h"
#include "loop/framed_connection.h"
#include "loop/handler_guard.h"
#include "varuna/manager/credentials.h"
#include "varuna/manager/host_launcher.h"
#include "loop/pending_connections.h"

using namespace varuna;
namespace asio = boost::asio;

namespace {

// A listener on 127.0.0.1:0 whose first accepted connection becomes a FramedConnection.
struct LoopbackServer {
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor{io, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)};
  std::shared_ptr<FramedConnection> connection;
  std::vector<proto::Message> received;
  std::string closeReason;

  std::string address() const { return "127.0.0.1:" + std::to_string(acceptor.local_endpoint().port()); }
  void acceptOne() {
    acceptor.async_accept([this](const boost::system::error_code& ec, asio::ip::tcp::socket socket) {
      REQUIRE_FALSE(ec);
      connection = std::make_shared<FramedConnection>(std::move(socket));
      connection->start([this](const proto::Message& m) { received.push_back(m); },
                        [this](const std::string& reason) { closeReason = reason; });
    });
  }
  // Runs the loop until `done` or 5 s.
  template <typename Pred>
  bool runUntil(Pred done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      io.run_for(std::chrono::milliseconds(10));
      io.restart();
    }
    return done();
  }
};

}  // namespace

TEST_CASE("framed connection: messages both ways, in order, through the blocking client", "[runtime]") {
  LoopbackServer server;
  server.acceptOne();
  auto client = proto::ControlClient::connect(server.address(), std::chrono::seconds(5));
  client.send(proto::Hello{proto::kVersion, "t", "worker", "h", 3, 1});
  for (int i = 0; i < 100; ++i) client.send(proto::Heartbeat{3, i});
  REQUIRE(server.runUntil([&] { return server.received.size() == 101; }));
  CHECK(std::get<proto::Hello>(server.received[0]).rank == 3);
  CHECK(std::get<proto::Heartbeat>(server.received[100]).step == 99);

  server.connection->send(proto::Pong{7, 42});
  server.connection->send(proto::Shutdown{"bye"});
  server.io.run_for(std::chrono::milliseconds(200));  // the writes go out
  server.io.restart();
  const auto pong = client.receive(std::chrono::seconds(2));
  REQUIRE(pong);
  CHECK(std::get<proto::Pong>(*pong).sentNs == 42);
  CHECK(std::get<proto::Shutdown>(*client.receive(std::chrono::seconds(2))).reason == "bye");
}

TEST_CASE("framed connection: a malformed frame closes it with the reason", "[runtime]") {
  LoopbackServer server;
  server.acceptOne();
  auto client = proto::ControlClient::connect(server.address(), std::chrono::seconds(5));
  const int fd = client.release();
  const char garbage[] = "\x00\x00\x00\x05{bad}";
  REQUIRE(::write(fd, garbage, sizeof(garbage) - 1) == static_cast<ssize_t>(sizeof(garbage) - 1));
  REQUIRE(server.runUntil([&] { return !server.closeReason.empty(); }));
  CHECK_THAT(server.closeReason, Catch::Contains("malformed"));
  ::close(fd);
}

TEST_CASE("framed connection: the peer closing is reported once", "[runtime]") {
  LoopbackServer server;
  server.acceptOne();
  {
    auto client = proto::ControlClient::connect(server.address(), std::chrono::seconds(5));
    client.send(proto::Heartbeat{1, 1});
    REQUIRE(server.runUntil([&] { return server.received.size() == 1; }));
  }
  REQUIRE(server.runUntil([&] { return !server.closeReason.empty(); }));
  CHECK(server.closeReason == "closed by peer");
  CHECK_FALSE(server.connection->open());
}

TEST_CASE("framed connection: a restart from inside its first message keeps one read in flight", "[runtime]") {
  // What the daemon does once a hello says who the peer is, while the peer's
  // frames keep coming. Two reads in flight would share the read buffer and,
  // under load, splice one frame into another (bench/manager_scale saw it).
  LoopbackServer server;
  std::vector<int64_t> steps;
  int others = 0;
  server.acceptor.async_accept([&](const boost::system::error_code& ec, asio::ip::tcp::socket socket) {
    if (ec) return;
    server.connection = std::make_shared<FramedConnection>(std::move(socket));
    server.connection->start(
        [&](const proto::Message&) {
          server.connection->start(
              [&](const proto::Message& m) {
                if (const auto* beat = std::get_if<proto::Heartbeat>(&m)) {
                  steps.push_back(beat->step);
                } else {
                  ++others;
                }
              },
              [&](const std::string& reason) { server.closeReason = reason; });
        },
        [&](const std::string& reason) { server.closeReason = reason; });
  });
  constexpr int kFrames = 20000;
  std::thread sender([address = server.address()] {
    try {
      auto client = proto::ControlClient::connect(address, std::chrono::seconds(5));
      client.send(proto::Hello{proto::kVersion, "t", "worker", "h", 0, 1});
      for (int i = 0; i < kFrames; ++i) client.send(proto::Heartbeat{0, i});  // a write each
    } catch (const std::exception&) {
      // the server closed on a corrupt frame: the checks below say so
    }
  });
  server.runUntil([&] { return steps.size() == kFrames || !server.closeReason.empty(); });
  sender.join();
  server.runUntil([&] { return steps.size() == kFrames; });
  CHECK((server.closeReason.empty() || server.closeReason == "closed by peer"));
  CHECK(others == 0);
  REQUIRE(steps.size() == kFrames);
  size_t firstWrong = 0;
  while (firstWrong < steps.size() && steps[firstWrong] == static_cast<int64_t>(firstWrong)) ++firstWrong;
  CHECK(firstWrong == steps.size());
}

TEST_CASE("control client: refused and malformed addresses are clear errors", "[runtime]") {
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor(io, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  const int port = acceptor.local_endpoint().port();
  acceptor.close();  // nothing listens there now
  CHECK_THROWS_WITH(proto::ControlClient::connect("127.0.0.1:" + std::to_string(port), std::chrono::seconds(2)),
                    Catch::Contains("cannot connect to the manager at 127.0.0.1:" + std::to_string(port)));
  CHECK_THROWS_WITH(proto::ControlClient::connect("no-port", std::chrono::seconds(1)), Catch::Contains("host:port"));
  CHECK(proto::splitHostPort("[::1]:80", "x") == std::pair<std::string, int>{"::1", 80});
  CHECK_THROWS_AS(proto::splitHostPort("h:99999", "x"), ConfigError);
}

TEST_CASE("local commands: output, exit status and timeout", "[runtime]") {
  auto ok = runLocalCommand("echo out; echo err >&2", std::chrono::seconds(10));
  CHECK(ok.ok);
  CHECK(ok.output.find("out") != std::string::npos);
  CHECK(ok.output.find("err") != std::string::npos);
  auto failed = runLocalCommand("echo why; exit 3", std::chrono::seconds(10));
  CHECK_FALSE(failed.ok);
  CHECK(failed.exitStatus == 3);
  CHECK_THAT(failed.message, Catch::Contains("status 3") && Catch::Contains("why"));
  const auto start = std::chrono::steady_clock::now();
  auto slow = runLocalCommand("sleep 30", std::chrono::milliseconds(300));
  CHECK_FALSE(slow.ok);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  CHECK_THAT(slow.message, Catch::Contains("did not finish"));
}

TEST_CASE("local commands: the input arrives on stdin, then EOF", "[runtime]") {
  auto echoed = runLocalCommand("read -r secret; printf '<%s>' \"$secret\"; cat; echo end", std::chrono::seconds(10),
                                "s3cr3t\nmore\n");
  CHECK(echoed.ok);
  CHECK(echoed.output == "<s3cr3t>more\nend\n");
  // A command that exits without reading its input is no problem (no SIGPIPE).
  CHECK(runLocalCommand("exit 0", std::chrono::seconds(10), std::string(32 * 1024, 'x')).ok);
  // A credential and an env file of up to 32 KiB fit (written before the fork); more is refused.
  auto large = runLocalCommand("wc -c", std::chrono::seconds(10), std::string(32 * 1024, 'x'));
  CHECK(large.ok);
  CHECK(large.output == "32768\n");
  auto tooLong = runLocalCommand("cat", std::chrono::seconds(10), std::string(32 * 1024 + 1, 'x'));
  CHECK_FALSE(tooLong.ok);
  CHECK_THAT(tooLong.message, Catch::Contains("at most 32768"));
}

TEST_CASE("local agents start as the job's user: root switches to ssh_user, others go over SSH", "[runtime][security]") {
  if (::geteuid() != 0) {  // CI runs as root, as run_varuna may; a user's run of the tests has nothing to switch
    WARN("skipped: needs root");
    return;
  }
  CHECK_FALSE(localStartFor("").overSsh);
  CHECK_FALSE(localStartFor("").account);
  CHECK_FALSE(localStartFor("root").account);  // run_varuna's own user: nothing to switch
  const LocalStart nobody = localStartFor("nobody");
  REQUIRE(nobody.account);
  CHECK_FALSE(nobody.overSsh);
  CHECK(nobody.account->uid == 65534);
  CHECK_THROWS_WITH(localStartFor("no-such-user-varuna"),
                    Catch::Contains("ssh_user 'no-such-user-varuna' has no account on this machine"));

  // Started as it: its uids, gids and groups, its HOME and name.
  const auto ran = runLocalCommand("id -u; id -g; id -G; echo \"$HOME $USER $LOGNAME\"; grep -E '^(Uid|Gid):' /proc/self/status",
                                   std::chrono::seconds(10), "", &*nobody.account);
  REQUIRE(ran.ok);
  CHECK(ran.output == "65534\n65534\n65534\n" + nobody.account->home +
                          " nobody nobody\nUid:\t65534\t65534\t65534\t65534\nGid:\t65534\t65534\t65534\t65534\n");

  // Through the launcher: a missing account is that host's failed start-up, naming the fix.
  SshOptions ssh;
  ssh.user = "no-such-user-varuna";
  ShellHostLauncher launcher(ssh);
  const auto refused = launcher.run("127.0.0.1", "true", "");
  CHECK_FALSE(refused.ok);
  CHECK_THAT(refused.message, Catch::Contains("create the account here"));

  // run_varuna as another user, which cannot switch: over SSH, as any host.
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    ::_exit(localStartFor("root").overSsh && !localStartFor("").overSsh && !localStartFor("nobody").overSsh ? 0 : 1);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("shell quoting survives the shell; local hosts are recognised", "[runtime]") {
  const std::string nasty = "it's a \"test\" $HOME `x` \\ ;|&";
  const auto echoed = runLocalCommand("printf %s " + shellQuote(nasty), std::chrono::seconds(10));
  CHECK(echoed.output == nasty);
  CHECK(isLocalHost("127.0.0.1"));
  CHECK(isLocalHost("127.0.0.2"));
  CHECK(isLocalHost("localhost"));
  CHECK_FALSE(isLocalHost("192.0.2.1"));  // TEST-NET: never this machine
}

TEST_CASE("event log: one JSON object per line, appended", "[runtime]") {
  const auto dir = test::scratchDir("event_log");
  const auto path = (dir / "events.jsonl").string();
  {
    EventLog log(path);
    log.write("launch", {{"generation", 1}});
  }
  EventLog again(path);
  again.write("stop", {{"reason", "done"}});
  std::ifstream in(path);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  REQUIRE(lines.size() == 2);
  CHECK(lines[0]["event"] == "launch");
  CHECK(lines[0]["generation"] == 1);
  CHECK(lines[1]["reason"] == "done");
  CHECK(lines[1]["time"].get<std::string>().size() == 24);
}

TEST_CASE("agent helpers: program resolution, log tails, connection file", "[runtime]") {
  const auto dir = test::scratchDir("agent_helpers");
  std::ofstream(dir / "train.sh") << "#!/bin/sh\n";
  std::filesystem::permissions(dir / "train.sh", std::filesystem::perms::owner_all);
  std::ofstream(dir / "data.txt") << "x";
  CHECK(resolveProgram("./train.sh", dir.string()) == (dir / "train.sh").string());
  CHECK(resolveProgram("sh", dir.string()).find("/sh") != std::string::npos);  // on PATH
  CHECK_THROWS_WITH(resolveProgram("./missing", dir.string()), Catch::Contains("does not exist"));
  CHECK_THROWS_WITH(resolveProgram("./data.txt", dir.string()), Catch::Contains("not executable"));
  CHECK_THROWS_WITH(resolveProgram("no-such-program-anywhere", dir.string()), Catch::Contains("not on PATH"));

  std::ofstream log(dir / "w.log");
  for (int i = 0; i < 20; ++i) log << "line " << i << "\n";
  log.close();
  CHECK(tailOfFile((dir / "w.log").string(), 2) == "line 18\nline 19");

  AgentOptions options;
  options.host = "10.0.0.5";
  options.job = "j";
  options.credential = "secret";
  writeConnectionFile(dir.string(), "10.0.0.1:29400", options);
  const auto status = std::filesystem::status(dir / "connection.json");
  CHECK((status.permissions() & std::filesystem::perms::group_read) == std::filesystem::perms::none);
  std::ifstream in(dir / "connection.json");
  const auto connection = nlohmann::json::parse(in);
  CHECK(connection["manager"] == "10.0.0.1:29400");
  CHECK(connection["token"] == credentials::notifier("secret"));  // the notifier's, not the agent's
  CHECK(connection["host"] == "10.0.0.5");
}

// --- what an unauthenticated peer can cost, and handler failures ------------

namespace {

// Writes raw bytes on a connected client socket (no framing).
void writeRaw(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    REQUIRE(n > 0);
    done += static_cast<size_t>(n);
  }
}

std::string header(uint32_t n) {
  return std::string{static_cast<char>(n >> 24), static_cast<char>(n >> 16), static_cast<char>(n >> 8),
                     static_cast<char>(n)};
}

// True if valid UTF-8 (what boundedText promises).
bool validUtf8(const std::string& text) { return proto::boundedText(text, text.size() + 8) == text; }

}  // namespace

TEST_CASE("framed connection: a frame over the limit is refused from its header alone", "[runtime]") {
  LoopbackServer server;
  server.acceptOne();
  auto client = proto::ControlClient::connect(server.address(), std::chrono::seconds(5));
  const int fd = client.release();
  writeRaw(fd, header(proto::kMaxFrameBytes + 1));  // the header only: nothing to buffer
  REQUIRE(server.runUntil([&] { return !server.closeReason.empty(); }));
  CHECK_THAT(server.closeReason, Catch::Contains("exceeds the limit"));
  ::close(fd);
}

TEST_CASE("framed connection: the first frame is held to limitFirstFrame, later ones are not", "[runtime]") {
  for (const bool tooBig : {true, false}) {
    DYNAMIC_SECTION("first frame " << (tooBig ? "over" : "within") << " the limit") {
      LoopbackServer server;
      server.acceptor.async_accept([&](const boost::system::error_code& ec, asio::ip::tcp::socket socket) {
        REQUIRE_FALSE(ec);
        server.connection = std::make_shared<FramedConnection>(std::move(socket));
        server.connection->limitFirstFrame(1024);
        server.connection->start([&](const proto::Message& m) { server.received.push_back(m); },
                                 [&](const std::string& reason) { server.closeReason = reason; });
      });
      auto client = proto::ControlClient::connect(server.address(), std::chrono::seconds(5));
      if (tooBig) {
        const int fd = client.release();
        writeRaw(fd, header(1025) + "{");  // a trickle after an announcement of 1025 bytes
        REQUIRE(server.runUntil([&] { return !server.closeReason.empty(); }));
        CHECK_THAT(server.closeReason, Catch::Contains("first frame of 1025 bytes"));
        CHECK(server.received.empty());
        ::close(fd);
      } else {
        client.send(proto::Hello{proto::kVersion, "t", "worker", "h", 0, 1});
        client.send(proto::CheckpointFailed{0, 5, std::string(400, 'e')});  // ~0.5 KiB, then bigger:
        proto::WorkerExited exited;
        exited.host = "h";
        exited.logTail = std::string(8000, 'x');
        client.send(exited);
        REQUIRE(server.runUntil([&] { return server.received.size() == 3; }));
        CHECK(server.closeReason.empty());
        CHECK(std::get<proto::WorkerExited>(server.received[2]).logTail.size() == 8000);
      }
    }
  }
}

TEST_CASE("framed connection: a close reason quoting the peer is bounded, valid UTF-8", "[runtime]") {
  LoopbackServer server;
  server.acceptOne();
  auto client = proto::ControlClient::connect(server.address(), std::chrono::seconds(5));
  const int fd = client.release();
  // An unknown type whose name is 100 kB, with bytes that are not UTF-8.
  const std::string body = "{\"type\":\"" + std::string(100000, 'A') + "\\u00ff\xff\xfe\"}";
  writeRaw(fd, header(static_cast<uint32_t>(body.size())) + body);
  REQUIRE(server.runUntil([&] { return !server.closeReason.empty(); }));
  CHECK(server.closeReason.size() <= proto::kMaxErrorTextBytes);
  CHECK(validUtf8(server.closeReason));
  ::close(fd);
}

TEST_CASE("framed connection: nothing is read or dispatched after closeAfterSending", "[runtime]") {
  LoopbackServer server;
  int dispatched = 0;
  server.acceptor.async_accept([&](const boost::system::error_code& ec, asio::ip::tcp::socket socket) {
    REQUIRE_FALSE(ec);
    server.connection = std::make_shared<FramedConnection>(std::move(socket));
    server.connection->start(
        [&](const proto::Message&) {
          ++dispatched;
          server.connection->send(proto::Ack{false, "refused"});
          server.connection->closeAfterSending("refused");
        },
        [&](const std::string& reason) { server.closeReason = reason; });
  });
  auto client = proto::ControlClient::connect(server.address(), std::chrono::seconds(5));
  // 200 frames in one write: the refusal must not be repeated for each.
  std::string burst;
  for (int i = 0; i < 200; ++i) burst += proto::encode(proto::Heartbeat{0, i});
  const int fd = client.release();
  writeRaw(fd, burst);
  REQUIRE(server.runUntil([&] { return server.closeReason == "refused"; }));
  CHECK(dispatched == 1);
  ::close(fd);
}

TEST_CASE("framed connection: failing callbacks never escape the event loop", "[runtime]") {
  SECTION("without a guard: onMessage's exception closes, onClose's is logged") {
    LoopbackServer server;
    server.acceptor.async_accept([&](const boost::system::error_code& ec, asio::ip::tcp::socket socket) {
      REQUIRE_FALSE(ec);
      server.connection = std::make_shared<FramedConnection>(std::move(socket));
      server.connection->start([](const proto::Message&) { throw std::runtime_error("disk full"); },
                               [&](const std::string& reason) {
                                 server.closeReason = reason;
                                 throw std::runtime_error("state write failed");
                               });
    });
    auto client = proto::ControlClient::connect(server.address(), std::chrono::seconds(5));
    client.send(proto::Heartbeat{1, 1});
    REQUIRE_NOTHROW(server.runUntil([&] { return !server.closeReason.empty(); }));
    CHECK(server.closeReason == "disk full");
  }
  SECTION("with a guard: both are reported through it, the connection closed") {
    auto guard = std::make_shared<HandlerGuard>();
    LoopbackServer server;
    int closes = 0;
    server.acceptor.async_accept([&](const boost::system::error_code& ec, asio::ip::tcp::socket socket) {
      REQUIRE_FALSE(ec);
      server.connection = std::make_shared<FramedConnection>(std::move(socket));
      server.connection->setGuard(guard);
      server.connection->start([](const proto::Message&) { throw std::runtime_error("disk full"); },
                               [&](const std::string& reason) {
                                 ++closes;
                                 server.closeReason = reason;
                                 throw 42;  // not even a std::exception
                               });
    });
    auto client = proto::ControlClient::connect(server.address(), std::chrono::seconds(5));
    client.send(proto::Heartbeat{1, 1});
    client.send(proto::Heartbeat{1, 2});
    REQUIRE_NOTHROW(server.runUntil([&] { return !server.closeReason.empty(); }));
    CHECK(server.closeReason == "its message handler failed");
    CHECK(closes == 1);
    CHECK(guard->failures() == 2);  // the message handler, then onClose
  }
  SECTION("the peer closing while onClose throws") {
    LoopbackServer server;
    server.acceptor.async_accept([&](const boost::system::error_code& ec, asio::ip::tcp::socket socket) {
      REQUIRE_FALSE(ec);
      server.connection = std::make_shared<FramedConnection>(std::move(socket));
      server.connection->start([](const proto::Message&) {}, [&](const std::string& reason) {
        server.closeReason = reason;
        throw std::runtime_error("No space left on device");  // what onClose -> writeState did
      });
    });
    { auto client = proto::ControlClient::connect(server.address(), std::chrono::seconds(5)); }
    REQUIRE_NOTHROW(server.runUntil([&] { return !server.closeReason.empty(); }));
    CHECK(server.closeReason == "closed by peer");
  }
}

TEST_CASE("handler guard: catches, counts, forwards arguments; rate limiter", "[runtime]") {
  HandlerGuard guard;
  CHECK(guard.run("fine", [] {}));
  CHECK_FALSE(guard.run("throws", [] { throw std::runtime_error("boom"); }));
  CHECK_FALSE(guard.run("throws anything", [] { throw 7; }));
  CHECK(guard.failures() == 2);
  int sum = 0;
  auto handler = guard.wrap("adding", [&](int a, const std::string& b) {
    sum += a + static_cast<int>(b.size());
    if (a < 0) throw std::invalid_argument("negative");
  });
  handler(2, std::string("abc"));
  handler(-10, std::string(""));
  CHECK(sum == -5);
  CHECK(guard.failures() == 3);
  for (int i = 0; i < 1000; ++i) guard.run("flood", [] { throw std::runtime_error(std::string(100000, 'x')); });
  CHECK(guard.failures() == 1003);  // logged 5 times per 10 s, each cut to 500 bytes

  using namespace std::chrono_literals;
  RateLimiter limiter(10s, 2);
  const RateLimiter::Clock::time_point t0{1000s};
  uint64_t suppressed = 99;
  CHECK(limiter.allow(t0, &suppressed));
  CHECK(suppressed == 0);
  CHECK(limiter.allow(t0 + 1s));
  CHECK_FALSE(limiter.allow(t0 + 2s));
  CHECK_FALSE(limiter.allow(t0 + 9s));
  CHECK(limiter.allow(t0 + 10s, &suppressed));
  CHECK(suppressed == 2);
}

TEST_CASE("pending connections: a cap that closes the oldest, a hello deadline", "[runtime]") {
  using namespace std::chrono_literals;
  asio::io_context io;  // never run: the connections are closed by the registry, not by I/O
  PendingLimits limits;
  limits.maxPending = 3;
  limits.helloDeadline = 5000ms;
  PendingConnections pending(limits);
  std::vector<std::shared_ptr<FramedConnection>> connections;
  std::vector<std::string> reasons(6);
  const PendingConnections::TimePoint t0{100s};
  for (int i = 0; i < 6; ++i) {
    auto c = std::make_shared<FramedConnection>(asio::ip::tcp::socket(io));
    std::weak_ptr<FramedConnection> weak = c;
    // onClose erases it, as the daemon's does: re-entry into the registry.
    c->start([](const proto::Message&) {}, [&, i, weak](const std::string& reason) {
      reasons[i] = reason;
      if (auto self = weak.lock()) pending.erase(self);
    });
    connections.push_back(c);
  }
  for (int i = 0; i < 3; ++i) pending.add(connections[i], t0 + std::chrono::seconds(i));
  CHECK(pending.size() == 3);
  pending.add(connections[3], t0 + 3s);  // the cap: connection 0, the oldest, goes
  CHECK(pending.size() == 3);
  CHECK(pending.evicted() == 1);
  CHECK_FALSE(connections[0]->open());
  CHECK_THAT(reasons[0], Catch::Contains("more than 3 connections without a hello"));
  CHECK(connections[3]->open());

  pending.erase(connections[2]);  // said hello
  CHECK(pending.size() == 2);
  CHECK(pending.expire(t0 + 5999ms) == 0);
  CHECK(pending.expire(t0 + 6000ms) == 1);  // connection 1 (accepted at t0 + 1 s)
  CHECK_FALSE(connections[1]->open());
  CHECK(connections[2]->open());  // not pending any more: never closed by the registry
  CHECK_THAT(reasons[1], Catch::Contains("no hello within 5000 ms"));
  CHECK(pending.expire(t0 + 7999ms) == 0);
  CHECK(pending.expire(t0 + 8000ms) == 1);  // connection 3
  CHECK(pending.expired() == 2);
  CHECK(pending.empty());

  // Peers the daemon waits for (a launch's workers) raise the cap.
  for (int i = 0; i < 3; ++i) pending.add(connections[i], t0 + 8s);  // closed ones: admitted, harmless
  pending.add(connections[4], t0 + 9s, /*expectedPeers=*/2);
  CHECK(pending.size() == 4);
  CHECK(pending.evicted() == 1);
  pending.add(connections[5], t0 + 9s, /*expectedPeers=*/2);
  CHECK(pending.size() == 5);
  CHECK(pending.evicted() == 1);
  for (int i = 0; i < 3; ++i) pending.erase(connections[i]);
  CHECK(pending.shedOldest("out of file descriptors"));
  CHECK(reasons[4] == "out of file descriptors");
  pending.closeAll("manager exiting");
  CHECK(reasons[5] == "manager exiting");
  CHECK_FALSE(pending.shedOldest("x"));
}

TEST_CASE("event log: never throws; bytes that are not UTF-8 are replaced", "[runtime]") {
  const auto dir = test::scratchDir("event_log_utf8");
  const auto path = (dir / "events.jsonl").string();
  EventLog log(path);
  REQUIRE_NOTHROW(log.write("connection_refused", {{"reason", std::string("bad \xff\xfe byte")}}));
  std::ifstream in(path);
  std::string line;
  REQUIRE(std::getline(in, line));
  const auto j = nlohmann::json::parse(line);
  CHECK(j["reason"] == "bad \xEF\xBF\xBD\xEF\xBF\xBD byte");  // U+FFFD twice
  CHECK(log.lost() == 0);
}

TEST_CASE("event log: past its size limit it becomes events.jsonl.1 and a new file starts", "[runtime]") {
  const auto dir = test::scratchDir("event_log_rotation");
  const auto path = (dir / "events.jsonl").string();
  const auto lines = [](const std::string& file) {
    std::ifstream in(file);
    std::vector<nlohmann::json> read;
    for (std::string line; std::getline(in, line);) read.push_back(nlohmann::json::parse(line));
    return read;
  };
  {
    EventLog log(path, /*maxBytes=*/1000);
    for (int i = 0; i < 30; ++i) log.write("tick", {{"i", i}});  // ~80 bytes a line
    CHECK(log.lost() == 0);
  }
  const auto current = lines(path), previous = lines(path + ".1");
  CHECK(std::filesystem::file_size(path) <= 1000);
  CHECK(std::filesystem::file_size(path + ".1") <= 1000);
  REQUIRE_FALSE(current.empty());
  REQUIRE_FALSE(previous.empty());
  // The newest lines are kept, in order, with nothing lost between the two files.
  CHECK(current.back()["i"] == 29);
  CHECK(previous.back()["i"].get<int>() + 1 == current.front()["i"].get<int>());
  // Reopened (a restarted manager), the size already there counts.
  {
    EventLog log(path, /*maxBytes=*/std::filesystem::file_size(path) + 10);
    log.write("tick", {{"i", 30}});
  }
  CHECK(lines(path).size() == 1);
  CHECK(lines(path + ".1").back()["i"] == 29);
}

// --- work off the event loop -------------------------------------------------------

TEST_CASE("background worker: results come back on the loop, in order; destruction drops the rest", "[runtime]") {
  asio::io_context io;
  std::vector<int> results;
  std::thread::id loopThread = std::this_thread::get_id(), workThread;
  {
    BackgroundWorker worker(io, "test-worker");
    for (int i = 0; i < 3; ++i) {
      worker.run(
          [i, &workThread] {
            workThread = std::this_thread::get_id();
            return i * 10;
          },
          [&results, loopThread](int value) {
            CHECK(std::this_thread::get_id() == loopThread);
            results.push_back(value);
          });
    }
    CHECK(worker.pending() == 3);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (results.size() < 3 && std::chrono::steady_clock::now() < deadline) {
      io.run_for(std::chrono::milliseconds(10));
      io.restart();
    }
    CHECK(results == std::vector<int>{0, 10, 20});
    CHECK(worker.pending() == 0);
    CHECK(workThread != loopThread);
    // A job that throws: logged, no completion, not counted as pending.
    bool ran = false;
    worker.run([]() -> int { throw std::runtime_error("boom"); }, [&ran](int) { ran = true; });
    while (worker.pending() > 0 && std::chrono::steady_clock::now() < deadline) {
      io.run_for(std::chrono::milliseconds(10));
      io.restart();
    }
    CHECK(worker.pending() == 0);
    CHECK_FALSE(ran);
    // A slow job, then one queued behind it: the worker goes before either result is read.
    worker.run(
        [] {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          return 1;
        },
        [&results](int v) { results.push_back(v); });
    worker.run([] { return 2; }, [&results](int v) { results.push_back(v); });
  }
  io.run_for(std::chrono::milliseconds(50));  // anything it had posted is dropped, not run on it
  CHECK(results.size() == 3);
}

TEST_CASE("async planner: AutoConfig off the loop, the controller waits and is told when the plan is there",
          "[runtime]") {
  asio::io_context io;
  BackgroundWorker worker(io, "test-plan");
  std::atomic<int> computed{0};
  std::vector<std::string> chosen;
  bool readyCalled = false;
  AsyncPlanner planner(
      worker,
      [&computed](const PlanRequest& request) {
        ++computed;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a big cluster's simulations
        AutoConfigResult result;
        result.best.plan = makePlan(request);
        return result;
      },
      [&chosen](const AutoConfigResult& result) { chosen.push_back(result.best.plan.describe()); },
      [&readyCalled] { readyCalled = true; });
  ControllerOptions options;
  options.stages = 1;
  options.globalBatch = 4;
  options.chunkSize = 1;
  options.planner = planner.planner();
  MorphController controller(options, {{"a", 2, 1}}, [] { return std::optional<int64_t>(); });
  const auto now = std::chrono::steady_clock::now();
  const auto started = std::chrono::steady_clock::now();
  CHECK(controller.start(now).empty());  // at once, without waiting for AutoConfig
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::milliseconds(50));
  CHECK(controller.phase() == Phase::kPlanning);
  CHECK(planner.computing() == 1);
  CHECK_THROWS_AS(planner.plan(PlanRequest{{{"a", 2, 1}}, 1, 4, 1, {}}), PlanPending);  // the same request: not again
  CHECK(planner.computing() == 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!readyCalled && std::chrono::steady_clock::now() < deadline) {
    io.run_for(std::chrono::milliseconds(10));
    io.restart();
  }
  REQUIRE(readyCalled);
  CHECK(chosen.size() == 1);
  auto actions = controller.planReady(now);
  REQUIRE(actions.size() == 1);
  CHECK(std::get<action::Launch>(actions[0]).plan.replicas == 2);
  CHECK(computed == 1);  // the relaunch's question was answered from the result
  // No plan fits: the ConfigError comes back as such.
  AsyncPlanner failing(
      worker, [](const PlanRequest&) -> AutoConfigResult { throw ConfigError("no plan fits in 0 B"); }, {},
      [&readyCalled] { readyCalled = true; });
  readyCalled = false;
  CHECK_THROWS_AS(failing.plan(PlanRequest{}), PlanPending);
  while (!readyCalled && std::chrono::steady_clock::now() < deadline) {
    io.run_for(std::chrono::milliseconds(10));
    io.restart();
  }
  CHECK_THROWS_WITH(failing.plan(PlanRequest{}), Catch::Contains("no plan fits in 0 B"));
}

TEST_CASE("scheduler grace: Slurm's durations and a partition's GraceTime", "[runtime]") {
  CHECK(parseSlurmSeconds("30") == 30);
  CHECK(parseSlurmSeconds("0") == 0);
  CHECK(parseSlurmSeconds("02:05") == 125);
  CHECK(parseSlurmSeconds("00:00:30") == 30);
  CHECK(parseSlurmSeconds("01:00:00") == 3600);
  CHECK(parseSlurmSeconds("1-00:00:10") == 86410);
  for (const std::string& bad : std::vector<std::string>{"", "UNLIMITED", "1-30", "-5", "1:2:3:4", "30s", "1.5"}) {
    INFO(bad);
    CHECK_FALSE(parseSlurmSeconds(bad));
  }
  // As `scontrol show partition` prints it (22.05).
  const std::string low =
      "PartitionName=low\n   AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL\n   AllocNodes=ALL Default=YES QoS=N/A\n"
      "   DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=15 Hidden=NO\n";
  CHECK(graceTimeFromPartition(low) == 15);
  CHECK(graceTimeFromPartition("   GraceTime=00:01:30 Hidden=NO") == 90);
  CHECK_FALSE(graceTimeFromPartition("PartitionName=low Hidden=NO"));
  CHECK_FALSE(graceTimeFromPartition("NoGraceTime=15"));
}

TEST_CASE("agent: worker logs of generations before the last ten are removed, nothing else", "[runtime][agent]") {
  const auto dir = varuna::test::scratchDir("prune_worker_logs");
  const auto logs = dir / "logs";
  std::filesystem::create_directories(logs);
  for (int g = 1; g <= 15; ++g) std::ofstream(logs / ("g" + std::to_string(g) + "_rank0.log")) << "g" << g;
  std::ofstream(logs / "g15_rank1.log") << "x";
  std::ofstream(logs / "notes.txt") << "mine";
  std::ofstream(logs / "g3_rank0.log.bak") << "mine too";
  std::ofstream(logs / "g-3_rank0.log") << "not a generation";
  std::ofstream(logs / "g1_rank0x.log") << "nor this";
  std::ofstream(dir / "elsewhere") << "not the agent's";
  std::filesystem::create_symlink(dir / "elsewhere", logs / "g2_rank5.log");
  CHECK(pruneWorkerLogs(logs, 15) == 6);  // g1..g5 of rank 0, and the link (not what it points to)
  for (int g = 1; g <= 15; ++g) CHECK(std::filesystem::exists(logs / ("g" + std::to_string(g) + "_rank0.log")) == (g > 5));
  CHECK(std::filesystem::exists(logs / "g15_rank1.log"));
  CHECK(std::filesystem::exists(logs / "notes.txt"));
  CHECK(std::filesystem::exists(logs / "g3_rank0.log.bak"));
  CHECK(std::filesystem::exists(logs / "g-3_rank0.log"));
  CHECK(std::filesystem::exists(logs / "g1_rank0x.log"));
  CHECK_FALSE(std::filesystem::is_symlink(logs / "g2_rank5.log"));
  std::ifstream elsewhere(dir / "elsewhere");
  std::string text;
  std::getline(elsewhere, text);
  CHECK(text == "not the agent's");
  CHECK(pruneWorkerLogs(logs, 15) == 0);
  CHECK(pruneWorkerLogs(dir / "missing", 15) == 0);
  // capLogs' copies go with their generation.
  std::ofstream(logs / "g5_rank0.log.1") << "cut";
  std::ofstream(logs / "g6_rank0.log.1") << "cut";
  CHECK(pruneWorkerLogs(logs, 16) == 3);  // g6_rank0.log, its copy and g5's copy
  CHECK_FALSE(std::filesystem::exists(logs / "g6_rank0.log.1"));
  CHECK_FALSE(std::filesystem::exists(logs / "g5_rank0.log.1"));
  CHECK(std::filesystem::exists(logs / "g7_rank0.log"));
}
