// The byte-stream seam under FramedConnection (varuna/manager/byte_stream.h):
// the in-memory pair the daemon's fake-clock tests run on, FramedConnection
// over it, and the LocalNetwork through which a test's peers reach the
// daemon's ControlListener. No socket anywhere: one io_context, polled.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "daemon/control_listener.h"
#include "fake_clock.h"
#include "loop/event_log.h"
#include "loop/framed_connection.h"
#include "loop/handler_guard.h"
#include "test_env.h"
#include "varuna/manager/byte_stream.h"
#include "varuna/manager/credentials.h"
#include "varuna/manager/local_network.h"

using namespace varuna;
namespace asio = boost::asio;
using boost::system::error_code;

namespace {

// Runs every ready handler; how many ran.
size_t drain(asio::io_context& io) {
  io.restart();
  const size_t n = io.poll();
  io.restart();
  return n;
}

// One read's outcome.
struct Read {
  bool done = false;
  error_code ec;
  std::string bytes;
};

void readInto(ByteStream& stream, Read& read, std::vector<char>& buffer) {
  read = {};
  stream.asyncReadSome(buffer.data(), buffer.size(), [&read, &buffer](const error_code& ec, size_t n) {
    read.done = true;
    read.ec = ec;
    read.bytes.assign(buffer.data(), n);
  });
}

}  // namespace

TEST_CASE("memory stream: bytes both ways, in order; handlers run on the loop, never inline", "[byte_stream]") {
  asio::io_context io;
  auto [a, b] = memoryStreamPair(io, "a", "b");
  CHECK(a->peer() == "b");
  CHECK(b->peer() == "a");
  std::vector<char> bufferA(64), bufferB(64);
  Read readA, readB;
  readInto(*b, readB, bufferB);
  bool written = false;
  const std::string hello = "hello";
  a->asyncWrite(hello.data(), hello.size(), [&](const error_code& ec, size_t n) {
    CHECK_FALSE(ec);
    CHECK(n == 5);
    written = true;
  });
  CHECK_FALSE(written);  // posted, not called in asyncWrite
  CHECK_FALSE(readB.done);
  drain(io);
  CHECK(written);
  REQUIRE(readB.done);
  CHECK_FALSE(readB.ec);
  CHECK(readB.bytes == "hello");

  // The other way, two writes before a read of a smaller buffer: in order.
  const std::string one = "one", two = "two";
  b->asyncWrite(one.data(), one.size(), [](const error_code&, size_t) {});
  drain(io);
  b->asyncWrite(two.data(), two.size(), [](const error_code&, size_t) {});
  std::vector<char> small(4);
  readInto(*a, readA, small);
  drain(io);
  CHECK(readA.bytes == "onet");
  readInto(*a, readA, small);
  drain(io);
  CHECK(readA.bytes == "wo");
}

TEST_CASE("memory stream: a close gives the other end what was written, then EOF; the closed end's "
          "operations abort", "[byte_stream]") {
  asio::io_context io;
  auto [a, b] = memoryStreamPair(io, "a", "b");
  std::vector<char> bufferA(64), bufferB(64);
  Read pendingOnA, readB;
  readInto(*a, pendingOnA, bufferA);  // pending when a closes
  const std::string last = "last words";
  a->asyncWrite(last.data(), last.size(), [](const error_code&, size_t) {});
  a->close();
  drain(io);
  REQUIRE(pendingOnA.done);
  CHECK(pendingOnA.ec == asio::error::operation_aborted);
  readInto(*b, readB, bufferB);
  drain(io);
  CHECK(readB.bytes == "last words");
  readInto(*b, readB, bufferB);
  drain(io);
  CHECK(readB.ec == asio::error::eof);

  // On the closed end: aborted; towards it: the peer is gone (a broken pipe).
  error_code onClosed, towardsClosed;
  a->asyncWrite(last.data(), last.size(), [&](const error_code& ec, size_t) { onClosed = ec; });
  b->asyncWrite(last.data(), last.size(), [&](const error_code& ec, size_t) { towardsClosed = ec; });
  drain(io);
  CHECK(onClosed == asio::error::operation_aborted);
  CHECK(towardsClosed == asio::error::broken_pipe);
}

TEST_CASE("memory stream: a write to a peer that stops reading waits at the capacity, then completes",
          "[byte_stream]") {
  asio::io_context io;
  auto [a, b] = memoryStreamPair(io, "a", "b", /*capacity=*/8);
  const std::string data = "0123456789abcdef";  // twice the capacity
  bool written = false;
  a->asyncWrite(data.data(), data.size(), [&](const error_code& ec, size_t n) {
    CHECK_FALSE(ec);
    CHECK(n == data.size());
    written = true;
  });
  drain(io);
  CHECK_FALSE(written);  // 8 bytes wait unread; the rest cannot go
  std::string received;
  std::vector<char> buffer(64);
  Read read;
  while (received.size() < data.size()) {
    readInto(*b, read, buffer);
    drain(io);
    REQUIRE(read.done);
    REQUIRE_FALSE(read.ec);
    received += read.bytes;
  }
  CHECK(received == data);
  CHECK(written);

  // A reader that closes fails the writer's pending write.
  error_code pending;
  a->asyncWrite(data.data(), data.size(), [&](const error_code& ec, size_t) { pending = ec; });
  drain(io);
  b->close();
  drain(io);
  CHECK(pending == asio::error::connection_reset);
}

namespace {

// Two FramedConnections over one in-memory pair.
struct FramedPair {
  asio::io_context io;
  std::shared_ptr<FramedConnection> server, client;
  std::vector<proto::Message> atServer, atClient;
  std::string serverClosed, clientClosed;

  explicit FramedPair(size_t capacity = 256 * 1024, size_t firstFrameLimit = 0) {
    auto [c, s] = memoryStreamPair(io, "client", "server", capacity);
    server = std::make_shared<FramedConnection>(std::move(s));
    client = std::make_shared<FramedConnection>(std::move(c));
    if (firstFrameLimit) server->limitFirstFrame(firstFrameLimit);
    server->start([this](const proto::Message& m) { atServer.push_back(m); },
                  [this](const std::string& reason) { serverClosed = reason; });
    client->start([this](const proto::Message& m) { atClient.push_back(m); },
                  [this](const std::string& reason) { clientClosed = reason; });
  }
  // Closed at the end: a pending read's handler, held by the open stream,
  // holds its connection (as a socket's pending operation does until closed).
  ~FramedPair() {
    server->close("test over");
    client->close("test over");
  }
  void run() {
    while (drain(io) > 0) {
    }
  }
};

}  // namespace

TEST_CASE("framed connection over memory: frames both ways, in order", "[byte_stream]") {
  FramedPair pair;
  CHECK(pair.server->peer() == "client");
  pair.client->send(proto::Hello{proto::kVersion, "t", "worker", "h", 0, 1});
  pair.client->send(proto::Heartbeat{0, 7, false});
  pair.server->send(proto::Ack{true, ""});
  pair.run();
  REQUIRE(pair.atServer.size() == 2);
  CHECK(std::get<proto::Hello>(pair.atServer[0]).host == "h");
  CHECK(std::get<proto::Heartbeat>(pair.atServer[1]).step == 7);
  REQUIRE(pair.atClient.size() == 1);
  CHECK(std::get<proto::Ack>(pair.atClient[0]).ok);
  CHECK(pair.serverClosed.empty());
  CHECK(pair.clientClosed.empty());
}

TEST_CASE("framed connection over memory: a close is the peer's EOF; closeAfterSending sends first",
          "[byte_stream]") {
  FramedPair pair;
  pair.server->send(proto::Ack{false, "refused"});
  pair.server->closeAfterSending("refused");
  pair.run();
  CHECK(pair.serverClosed == "refused");
  REQUIRE(pair.atClient.size() == 1);
  CHECK_FALSE(std::get<proto::Ack>(pair.atClient[0]).ok);
  CHECK(pair.clientClosed == "closed by peer");
  CHECK_FALSE(pair.client->open());
}

TEST_CASE("framed connection over memory: frames to a peer that stops reading wait, then arrive in order",
          "[byte_stream]") {
  // A 1 KiB stream: a paused reader's side fills after a few frames.
  asio::io_context io;
  auto [c, s] = memoryStreamPair(io, "client", "server", 1024);
  auto server = std::make_shared<FramedConnection>(std::move(s));
  std::vector<proto::Message> received;
  server->start([&](const proto::Message& m) { received.push_back(m); }, [](const std::string&) {});
  for (int step = 0; step < 100; ++step) server->send(proto::Heartbeat{0, step, false});
  while (drain(io) > 0) {
  }
  CHECK(server->open());  // its writes wait; nothing failed
  // The client reads only now, with a bare decoder.
  proto::FrameDecoder decoder;
  std::vector<char> buffer(4096);
  std::vector<int64_t> steps;
  for (int rounds = 0; rounds < 1000 && steps.size() < 100; ++rounds) {
    Read read;
    readInto(*c, read, buffer);
    while (drain(io) > 0) {
    }
    REQUIRE(read.done);
    REQUIRE_FALSE(read.ec);
    decoder.feed(read.bytes);
    while (auto m = decoder.next()) steps.push_back(std::get<proto::Heartbeat>(*m).step);
  }
  REQUIRE(steps.size() == 100);
  for (int step = 0; step < 100; ++step) CHECK(steps[step] == step);
  server->close("test over");
}

TEST_CASE("framed connection over memory: a peer that never reads is closed at the queue's cap, not buffered "
          "without bound", "[byte_stream]") {
  asio::io_context io;
  auto [c, s] = memoryStreamPair(io, "client", "server", 1024);  // the client never reads
  auto server = std::make_shared<FramedConnection>(std::move(s));
  server->limitQueuedBytes(64 * 1024);
  std::string closed;
  server->start([](const proto::Message&) {}, [&](const std::string& why) { closed = why; });
  int sent = 0;
  for (; sent < 100000 && server->open(); ++sent) {
    server->send(proto::Heartbeat{0, sent, false});
    CHECK(server->queuedBytes() <= 64 * 1024);
    drain(io);
  }
  CHECK_FALSE(server->open());
  CHECK(sent < 100000);
  CHECK_THAT(closed, Catch::StartsWith("the peer does not read: ") && Catch::Contains("(at most 65536)"));
  CHECK(server->queuedBytes() == 0);
  // A peer that reads is never closed by the cap: the queue drains as it goes.
  FramedPair pair(256 * 1024);
  pair.server->limitQueuedBytes(4096);
  for (int step = 0; step < 2000; ++step) {
    pair.server->send(proto::Heartbeat{0, step, false});
    pair.run();
  }
  CHECK(pair.server->open());
  CHECK(pair.atClient.size() == 2000);
}

TEST_CASE("framed connection over memory: the first frame is held to limitFirstFrame", "[byte_stream]") {
  FramedPair pair(256 * 1024, /*firstFrameLimit=*/64);
  proto::WorkerExited exited;
  exited.host = "h";
  exited.logTail = std::string(200, 'x');
  pair.client->send(exited);
  pair.run();
  CHECK_THAT(pair.serverClosed, Catch::Contains("a first frame of"));
  CHECK(pair.atServer.empty());
  CHECK(pair.clientClosed == "closed by peer");
}

TEST_CASE("local network: a dial with no listener is refused; the listener gets the server end after dial returns",
          "[byte_stream]") {
  asio::io_context io;
  LocalNetwork network(io);
  CHECK(network.dial("early") == nullptr);
  std::unique_ptr<ByteStream> accepted;
  network.listen([&](std::unique_ptr<ByteStream> end) { accepted = std::move(end); });
  auto client = network.dial("agent 10.0.0.2");
  REQUIRE(client);
  CHECK(client->peer() == "memory:manager");
  CHECK_FALSE(accepted);  // posted
  drain(io);
  REQUIRE(accepted);
  CHECK(accepted->peer() == "memory:agent 10.0.0.2");
  CHECK(network.dials() == 2);

  // A listener that stopped before the accept ran: the dialler reads EOF.
  auto late = network.dial("late");
  network.stopListening();
  std::vector<char> buffer(16);
  Read read;
  readInto(*late, read, buffer);
  while (drain(io) > 0) {
  }
  CHECK(read.ec == asio::error::eof);
}

TEST_CASE("control listener on a local network: the same admission as TCP (credential check, refusal, hand-over)",
          "[byte_stream]") {
  asio::io_context io;
  test::FakeClock clock;
  LocalNetwork network(io);
  auto guard = std::make_shared<HandlerGuard>();
  const auto dir = test::scratchDir("byte_stream_listener");
  EventLog events((dir / "events.jsonl").string());
  ControlListener listener(io, guard, PendingLimits{}, clock);
  listener.listenLocal(network);
  std::vector<proto::Hello> hellos;
  listener.start(
      "the-token", events,
      [&](const std::shared_ptr<FramedConnection>&, const proto::Hello& hello) { hellos.push_back(hello); },
      [] { return size_t{0}; });
  CHECK(listener.port() == 0);  // never listened on TCP

  auto dialAndSay = [&](const std::string& token, std::vector<proto::Message>& replies, std::string& closed) {
    auto connection = std::make_shared<FramedConnection>(network.dial("worker h"));
    connection->start([&](const proto::Message& m) { replies.push_back(m); },
                      [&](const std::string& reason) { closed = reason; });
    connection->send(proto::Hello{proto::kVersion, token, "worker", "h", 0, 1});
    return connection;
  };
  std::vector<proto::Message> goodReplies, badReplies;
  std::string goodClosed, badClosed;
  // Rank 0 of generation 1 on host h carries its own credential, derived
  // from h's agent credential; the job's secret itself is not a worker's.
  auto good = dialAndSay(credentials::worker(credentials::agent("the-token", "h"), 0, 1), goodReplies, goodClosed);
  auto bad = dialAndSay("the-token", badReplies, badClosed);
  while (drain(io) > 0) {
  }
  REQUIRE(hellos.size() == 1);
  CHECK(hellos[0].rank == 0);
  REQUIRE(badReplies.size() == 1);
  CHECK_FALSE(std::get<proto::Ack>(badReplies[0]).ok);
  CHECK(badClosed == "closed by peer");
  CHECK(goodClosed.empty());
  CHECK(listener.localAccepted() == 2);
  CHECK(listener.tcpAccepted() == 0);
  CHECK(listener.pendingConnections() == 0);

  // Stopped: a dial is refused.
  listener.close();
  CHECK(network.dial("after") == nullptr);
  good->close("test over");
  bad->close("test over");
  while (drain(io) > 0) {
  }
}

TEST_CASE("credentials: HMAC-SHA256 as specified (known answers), one per host, rank and generation", "[byte_stream]") {
  // Computed with Python's hmac module from credentials.h's definitions.
  const std::string a = credentials::agent("secret", "host-a");
  CHECK(a == "1b6cf88e98fba05e8ec16ca1907e7ca5269f72e22bdabba6fb64e5c66b027348");
  CHECK(credentials::notifier(a) == "dec968a2eb3b785eb0395c3ed2308ad5be5f1177036cd884f9e7eae5b34b347a");
  CHECK(credentials::worker(a, 3, 7) == "8fc3d2a8f7feb145af90714f0787e0bd70b6909da39fb891a1fe32e05eb00bf1");
  CHECK(credentials::agent("secret", "host-b") != a);
  CHECK(credentials::worker(a, 3, 8) != credentials::worker(a, 3, 7));
  CHECK(credentials::worker(a, 4, 7) != credentials::worker(a, 3, 7));
  CHECK(credentials::expected(a, "agent", -1, -1) == a);
  CHECK(credentials::expected(a, "notifier", -1, -1) == credentials::notifier(a));
  CHECK(credentials::expected(a, "worker", 3, 7) == credentials::worker(a, 3, 7));
  CHECK(credentials::expected(a, "spy", 3, 7).empty());
}

TEST_CASE("credentials: a joined host's agent credential is bound to its join's nonce", "[byte_stream]") {
  // Computed with Python's hmac module from credentials.h's definition.
  const std::string nonce = "00112233445566778899aabbccddeeff";
  const std::string joined = credentials::joinedAgent("secret", "host-a", nonce);
  CHECK(joined == "86f68293ecd74da2866845a491981b955b4ba0b04ad9dccf17f1e7b1d549a6aa");
  CHECK(joined != credentials::agent("secret", "host-a"));  // not what a listed host-a's agent holds
  CHECK(credentials::joinedAgent("secret", "host-b", nonce) != joined);
  CHECK_THROWS(credentials::joinedAgent("secret", "host-a", ""));
  // Fresh each time, 128 bits in hex.
  const std::string n1 = credentials::newNonce(), n2 = credentials::newNonce();
  CHECK(n1.size() == 32);
  CHECK(n1.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(n1 != n2);
  CHECK(credentials::joinedAgent("secret", "host-a", n1) != credentials::joinedAgent("secret", "host-a", n2));
}

TEST_CASE("credentials: a join credential carries its expiry under the job's MAC", "[byte_stream]") {
  // The MAC computed with Python's hmac module from credentials.h's definition.
  const std::string j = credentials::join("secret", 2000000000);
  CHECK(j == "vj1.2000000000.250bfcf456cf9f4851ddcaa71c75e9c9a6c6d97ec4aedfc2acba0dc7242aa4da");
  CHECK(credentials::joinExpiry(j) == 2000000000);
  using credentials::JoinCheck;
  CHECK(credentials::checkJoin("secret", j, 1999999999) == JoinCheck::kValid);
  CHECK(credentials::checkJoin("secret", j, 2000000000) == JoinCheck::kExpired);
  CHECK(credentials::checkJoin("other", j, 1999999999) == JoinCheck::kWrong);
  // A later expiry written over the MAC'd one no longer holds.
  std::string extended = j;
  extended.replace(4, 10, "2100000000");
  CHECK(credentials::checkJoin("secret", extended, 1999999999) == JoinCheck::kWrong);
  for (const std::string& bad : std::vector<std::string>{"", "vj1.", "vj1..abc", "vj1.12x4.abc", "vj2.2000000000.abc", "2000000000",
                                "vj1.1234567890123.abc", std::string(200, 'a')}) {
    CHECK(credentials::checkJoin("secret", bad, 0) == JoinCheck::kMalformed);
  }
  // An agent credential is not a join credential, and the reverse.
  CHECK(credentials::checkJoin("secret", credentials::agent("secret", "h"), 0) == JoinCheck::kMalformed);
  CHECK(credentials::expected(credentials::agent("secret", "h"), "join", -1, -1).empty());
}

TEST_CASE("control listener: a credential speaks only for its own role, host, rank and generation", "[byte_stream]") {
  asio::io_context io;
  test::FakeClock clock;
  LocalNetwork network(io);
  const auto dir = test::scratchDir("byte_stream_credentials");
  EventLog events((dir / "events.jsonl").string());
  ControlListener listener(io, std::make_shared<HandlerGuard>(), PendingLimits{}, clock);
  listener.listenLocal(network);
  std::vector<proto::Hello> admitted;
  listener.start(
      "job-secret", events,
      [&](const std::shared_ptr<FramedConnection>&, const proto::Hello& hello) { admitted.push_back(hello); },
      [] { return size_t{0}; });
  const std::string agentA = credentials::agent("job-secret", "host-a");
  // Each attempt: (credential, role, host, rank, generation, admitted?).
  struct Attempt {
    std::string credential, role, host;
    int rank, generation;
    bool admitted;
  };
  const std::vector<Attempt> attempts = {
      {agentA, "agent", "host-a", -1, -1, true},
      {agentA, "agent", "host-b", -1, -1, false},                                  // another host's agent
      {credentials::notifier(agentA), "notifier", "host-a", -1, -1, true},
      {credentials::notifier(agentA), "notifier", "host-b", -1, -1, false},        // host A's notifier as B's
      {credentials::notifier(agentA), "agent", "host-a", -1, -1, false},           // a notifier as the agent
      {"job-secret", "notifier", "head", -1, -1, true},                            // the operator's
      {credentials::worker(agentA, 1, 4), "worker", "host-a", 1, 4, true},
      {credentials::worker(agentA, 1, 4), "worker", "host-a", 0, 4, false},        // rank 1 claiming rank 0
      {credentials::worker(agentA, 1, 3), "worker", "host-a", 1, 4, false},        // generation 3's, replayed in 4
      {credentials::worker(agentA, 1, 4), "agent", "host-a", -1, -1, false},       // a worker as its agent
      {credentials::worker(agentA, 1, 4), "notifier", "host-a", -1, -1, false},    // a worker as a notifier
      {"job-secret", "worker", "host-a", 1, 4, false},                             // the secret is no worker's
  };
  std::vector<std::shared_ptr<FramedConnection>> connections;
  std::vector<std::vector<proto::Message>> replies(attempts.size());
  for (size_t i = 0; i < attempts.size(); ++i) {
    const auto& a = attempts[i];
    auto connection = std::make_shared<FramedConnection>(network.dial(a.host));
    connection->start([&replies, i](const proto::Message& m) { replies[i].push_back(m); }, [](const std::string&) {});
    connection->send(proto::Hello{proto::kVersion, a.credential, a.role, a.host, a.rank, a.generation});
    connections.push_back(connection);
    while (drain(io) > 0) {
    }
  }
  size_t expectedAdmitted = 0;
  for (size_t i = 0; i < attempts.size(); ++i) {
    INFO("attempt " << i << ": " << attempts[i].role << " " << attempts[i].host << " rank " << attempts[i].rank);
    if (attempts[i].admitted) {
      ++expectedAdmitted;
      CHECK(replies[i].empty());
    } else {
      REQUIRE(replies[i].size() == 1);
      CHECK_FALSE(std::get<proto::Ack>(replies[i][0]).ok);
    }
  }
  CHECK(admitted.size() == expectedAdmitted);
  CHECK(listener.stats()["refused"] == attempts.size() - expectedAdmitted);
  listener.close();
  for (auto& c : connections) c->close("test over");
  while (drain(io) > 0) {
  }
}

TEST_CASE("control listener on a local network: once destroyed, a dial is refused", "[byte_stream]") {
  asio::io_context io;
  test::FakeClock clock;
  LocalNetwork network(io);
  const auto dir = test::scratchDir("byte_stream_listener_gone");
  EventLog events((dir / "events.jsonl").string());
  {
    ControlListener listener(io, std::make_shared<HandlerGuard>(), PendingLimits{}, clock);
    listener.listenLocal(network);
    listener.start("t", events, [](const std::shared_ptr<FramedConnection>&, const proto::Hello&) {},
                   [] { return size_t{0}; });
    CHECK(network.listening());
  }
  CHECK_FALSE(network.listening());
  CHECK(network.dial("late") == nullptr);
}
