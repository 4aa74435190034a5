// The manager's I/O building blocks, each on its own: framed connections over
// loopback (Asio), the blocking client, local commands, shell quoting, the
// event log and the agent's helpers.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <thread>
#include <unistd.h>

#include "test_env.h"
#include "varuna/common/control_client.h"
#include "varuna/manager/agent.h"
#include "varuna/manager/event_log.h"
#include "varuna/manager/framed_connection.h"
#include "varuna/manager/host_launcher.h"

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
  CHECK(runLocalCommand("exit 0", std::chrono::seconds(10), std::string(4000, 'x')).ok);
  auto tooLong = runLocalCommand("cat", std::chrono::seconds(10), std::string(5000, 'x'));
  CHECK_FALSE(tooLong.ok);
  CHECK_THAT(tooLong.message, Catch::Contains("at most 4096"));
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
  options.token = "secret";
  writeConnectionFile(dir.string(), "10.0.0.1:29400", options);
  const auto status = std::filesystem::status(dir / "connection.json");
  CHECK((status.permissions() & std::filesystem::perms::group_read) == std::filesystem::perms::none);
  std::ifstream in(dir / "connection.json");
  const auto connection = nlohmann::json::parse(in);
  CHECK(connection["manager"] == "10.0.0.1:29400");
  CHECK(connection["token"] == "secret");
  CHECK(connection["host"] == "10.0.0.5");
}
