// PeerRouter alone, over in-memory connections: where a hello goes by role,
// what a worker of the running launch is told (Welcome) and what a stale one
// is (ExitNow, closed, recorded), and what a notifier may send. The Sink is
// the test's; the router's wiring into the real daemon is
// daemon_sequences_test's.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_env.h"
#include "daemon/peer_router.h"
#include "varuna/manager/byte_stream.h"

using namespace varuna;
using namespace std::chrono_literals;

namespace {

// The daemon as the router sees it: generation 3 expects ranks 0 and 1.
struct RecordingSink : PeerRouter::Sink {
  int generation = 3;
  std::set<int> expected = {0, 1};
  std::set<int> connected;
  std::vector<std::string> agents;
  std::vector<std::pair<int, std::string>> messages;  // (rank, type)
  std::vector<std::string> notices;
  int allConnected = 0;

  void agentHello(const std::shared_ptr<FramedConnection>&, const proto::Hello& hello) override {
    agents.push_back(hello.host);
  }
  std::vector<std::string> joins;
  void joinHello(const std::shared_ptr<FramedConnection>&, const proto::Hello& hello) override {
    joins.push_back(hello.host);
  }
  int runningGeneration() const override { return generation; }
  bool expectsWorker(int rank) const override { return expected.count(rank) > 0; }
  std::string hostOf(int rank) const override { return rank == 1 ? "host-b" : "host-a"; }
  bool workerConnected(int rank, const std::shared_ptr<FramedConnection>&) override {
    connected.insert(rank);
    return connected == expected;
  }
  void allWorkersConnected() override { ++allConnected; }
  void workerMessage(int rank, const proto::Message& message) override {
    messages.emplace_back(rank, proto::typeName(message));
  }
  void preemptNotice(const std::shared_ptr<FramedConnection>& connection, const proto::PreemptNotice& notice) override {
    notices.push_back(notice.host);
    connection->send(proto::Ack{true, ""});
    connection->closeAfterSending("done");
  }
};

// A peer's end of a connection the router is handed (its manager end).
struct Peer {
  std::shared_ptr<FramedConnection> manager, peer;
  std::vector<proto::Message> received;
  std::string closed;
};

struct RouterFixture {
  static constexpr PeerRouter::TimePoint t0{std::chrono::hours(1)};
  boost::asio::io_context io;
  std::filesystem::path dir;
  EventLog events;
  RecordingSink sink;
  PeerRouter router;
  std::vector<std::unique_ptr<Peer>> peers;

  explicit RouterFixture(const std::string& name)
      : dir(test::scratchDir(name)),
        events((dir / "events.jsonl").string()),
        router(PeerRouter::Options{12000ms, 30000ms, 5000ms, "job-secret"}, sink, events) {}
  ~RouterFixture() {
    for (auto& p : peers) {
      p->manager->close("test over");
      p->peer->close("test over");
    }
    run();
  }
  // Runs what is ready (the in-memory streams' reads and writes are handlers).
  void run() {
    io.restart();
    io.poll();
  }

  // A peer that said `hello`, routed; what the manager sends it is recorded.
  Peer& connect(const proto::Hello& hello) {
    auto [a, b] = memoryStreamPair(io, "peer", "manager");
    auto p = std::make_unique<Peer>();
    p->peer = std::make_shared<FramedConnection>(std::move(a));
    p->manager = std::make_shared<FramedConnection>(std::move(b));
    Peer& ref = *p;
    p->peer->start([&ref](const proto::Message& m) { ref.received.push_back(m); },
                   [&ref](const std::string& reason) { ref.closed = reason; });
    peers.push_back(std::move(p));
    router.route(ref.manager, hello, t0);
    run();
    return ref;
  }
  static proto::Hello hello(const std::string& role, int rank = -1, int generation = -1,
                            const std::string& host = "host-a", const std::string& token = "token") {
    return proto::Hello{proto::kVersion, token, role, host, rank, generation};
  }
  void send(Peer& p, const proto::Message& message) {
    p.peer->send(message);
    run();
  }
  std::vector<nlohmann::json> staleEvents() {
    std::vector<nlohmann::json> out;
    std::ifstream in(dir / "events.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("event", "") == "stale_worker") out.push_back(std::move(j));
    }
    return out;
  }
};

}  // namespace

TEST_CASE("router: an agent's and a joining host's hellos go to the sink; an unknown role is refused") {
  RouterFixture f("router_roles");
  f.connect(RouterFixture::hello("agent"));
  CHECK(f.sink.agents == std::vector<std::string>{"host-a"});
  f.connect(RouterFixture::hello("join"));
  CHECK(f.sink.joins == std::vector<std::string>{"host-a"});
  CHECK_THROWS_AS(f.router.route(f.peers.back()->manager, RouterFixture::hello("spy"), RouterFixture::t0), proto::ProtocolError);
}

TEST_CASE("router: a worker of the running launch is welcomed and its frames reach the sink") {
  RouterFixture f("router_worker");
  Peer& rank0 = f.connect(RouterFixture::hello("worker", 0, 3));
  REQUIRE(rank0.received.size() == 1);
  const auto& welcome = std::get<proto::Welcome>(rank0.received[0]);
  CHECK(welcome.generation == 3);
  CHECK(welcome.lostManagerGraceMs == 12000);
  CHECK(welcome.salvageTimeoutMs == 30000);
  CHECK(f.sink.allConnected == 0);
  f.send(rank0, proto::Heartbeat{0, 5, false});
  f.send(rank0, proto::StepReport{0, 0, 0, 6, 2.0, 0.5, 0.1});
  CHECK(f.sink.messages == std::vector<std::pair<int, std::string>>{{0, "heartbeat"}, {0, "step_report"}});
  f.connect(RouterFixture::hello("worker", 1, 3, "host-b"));
  CHECK(f.sink.allConnected == 1);  // the last rank the launch waited for
  CHECK(f.staleEvents().empty());
  CHECK(f.router.refusedMessages() == 0);
}

TEST_CASE("router: a worker speaks only for its own rank and host") {
  RouterFixture f("router_worker_identity");
  // Rank 1 runs on host-b: a hello for it from host-a is refused, not admitted.
  CHECK_THROWS_AS(f.connect(RouterFixture::hello("worker", 1, 3, "host-a")), proto::ProtocolError);
  CHECK(f.sink.connected.empty());
  // Rank 0's connection reporting rank 1's step, checkpoint failure or salvage state: dropped and counted.
  Peer& rank0 = f.connect(RouterFixture::hello("worker", 0, 3));
  f.send(rank0, proto::StepReport{1, 1, 0, 6, 2.0, 0.5, 0.1});
  f.send(rank0, proto::CheckpointFailed{1, 6, "disk full"});
  proto::SalvageReady ready;
  ready.rank = 1;
  f.send(rank0, ready);
  CHECK(f.sink.messages.empty());
  CHECK(f.router.refusedMessages() == 3);
  f.send(rank0, proto::StepReport{0, 0, 0, 6, 2.0, 0.5, 0.1});  // its own: through
  CHECK(f.sink.messages == std::vector<std::pair<int, std::string>>{{0, "step_report"}});
}

TEST_CASE("router: a worker of another generation or one not expected is ordered out and recorded") {
  RouterFixture f("router_stale");
  Peer& old = f.connect(RouterFixture::hello("worker", 0, 2));    // an earlier generation
  Peer& gone = f.connect(RouterFixture::hello("worker", 7, 3));   // written off (not expected)
  for (Peer* p : {&old, &gone}) {
    REQUIRE(p->received.size() == 1);
    CHECK(std::holds_alternative<proto::ExitNow>(p->received[0]));
    CHECK_FALSE(p->closed.empty());
  }
  CHECK(std::get<proto::ExitNow>(old.received[0]).generation == 2);
  CHECK(f.sink.connected.empty());
  const auto stale = f.staleEvents();
  REQUIRE(stale.size() == 2);
  CHECK(stale[0]["generation"] == 2);
  CHECK(stale[1]["rank"] == 7);
  CHECK(stale[1]["host"] == "host-a");
}

TEST_CASE("router: a notifier's notice goes to the sink; anything else is refused") {
  RouterFixture f("router_notifier");
  Peer& good = f.connect(RouterFixture::hello("notifier"));
  f.send(good, proto::PreemptNotice{"host-a", 0});
  CHECK(f.sink.notices == std::vector<std::string>{"host-a"});
  REQUIRE(good.received.size() == 1);
  CHECK(std::get<proto::Ack>(good.received[0]).ok);
  Peer& bad = f.connect(RouterFixture::hello("notifier"));
  f.send(bad, proto::Heartbeat{-1, 0, false});
  REQUIRE(bad.received.size() == 1);
  CHECK_FALSE(std::get<proto::Ack>(bad.received[0]).ok);
  CHECK_FALSE(bad.closed.empty());
  CHECK(f.sink.notices.size() == 1);
  // A host's notifier announcing another host: refused and counted.
  Peer& other = f.connect(RouterFixture::hello("notifier"));
  f.send(other, proto::PreemptNotice{"host-b", 0});
  REQUIRE(other.received.size() == 1);
  CHECK_FALSE(std::get<proto::Ack>(other.received[0]).ok);
  CHECK_THAT(std::get<proto::Ack>(other.received[0]).error, Catch::Contains("may announce only that host"));
  CHECK(f.sink.notices.size() == 1);
  CHECK(f.router.refusedMessages() == 1);
  // The operator's notifier (the job's secret) may announce any host.
  Peer& op = f.connect(RouterFixture::hello("notifier", -1, -1, "head", "job-secret"));
  f.send(op, proto::PreemptNotice{"host-b", 0});
  CHECK(f.sink.notices == std::vector<std::string>{"host-a", "host-b"});
}

TEST_CASE("router: a notifier that sends nothing is closed at its deadline; one that sent its notice is only dropped") {
  RouterFixture f("router_idle_notifier");
  Peer& silent = f.connect(RouterFixture::hello("notifier"));
  Peer& good = f.connect(RouterFixture::hello("notifier"));
  f.send(good, proto::PreemptNotice{"host-a", 0});
  CHECK(f.router.waitingNotifiers() == 2);
  f.router.closeIdleNotifiers(RouterFixture::t0 + 4999ms);
  f.run();
  CHECK(silent.closed.empty());  // not yet
  f.router.closeIdleNotifiers(RouterFixture::t0 + 5000ms);
  f.run();
  CHECK(silent.closed == "closed by peer");
  CHECK(f.router.waitingNotifiers() == 0);
  CHECK(f.sink.notices == std::vector<std::string>{"host-a"});
  REQUIRE(good.received.size() == 1);
  CHECK(std::get<proto::Ack>(good.received[0]).ok);
}
