// Hosts that join by themselves (`varuna_agent --join`, agent_pool.h),
// against the real ManagerDaemon in-process with --machine_source join: the
// test plays each host's join (a raw "join" hello over the daemon's
// in-process network), then starts the simulated agent with the credential
// the manager answered (tests/support/sim_cluster.h). On a FakeClock, like
// daemon_sequences_test: seconds of job time in milliseconds, no socket.
#include <catch2/catch.hpp>

#include <optional>

#include "sim_daemon_harness.h"
#include "varuna/common/time_util.h"
#include "varuna/manager/credentials.h"
#include "loop/framed_connection.h"

using namespace varuna;
using namespace std::chrono_literals;

namespace {

// run_varuna with no machine list: training starts at `minHosts` joined hosts.
struct JoinDaemon : test::SimDaemonHarness {
  explicit JoinDaemon(const std::string& name, int minHosts = 0) : SimDaemonHarness(name, 10s) {
    JobConfig config = test::daemonTestConfig(dir, "joins", /*batchSize=*/4, /*nstages=*/2);
    config.machineList.clear();
    config.machineSource = "join";
    config.minHosts = minHosts;
    test::fastFaultTimings(config);
    auto sim = sim::fastSimOptions();
    sim.globalStore = config.globalStore;
    useFakeClock();
    simulate(sim);
    startSimulated(config);
  }
  ~JoinDaemon() { CHECK(noSockets() == ""); }

  std::string joinCredential(int64_t expiresIn = 3600) const {
    return credentials::join(token(), unixSecondsNow() + expiresIn);
  }

  // One join, as varuna_agent --join says it: the manager's answer (Joined
  // or a refusing Ack), nullopt if none came.
  std::optional<proto::Message> join(const std::string& host, int slots, const std::string& credential) {
    auto connection = std::make_shared<FramedConnection>(localNetwork->dial("join " + host));
    std::optional<proto::Message> answer;
    bool closed = false;
    connection->start([&](const proto::Message& m) { answer = m; }, [&](const std::string&) { closed = true; });
    connection->send(proto::Hello{proto::kVersion, credential, "join", host, -1, -1, slots});
    runUntil([&] { return closed; }, 5s);
    return answer;
  }
  // A join admitted, then the host's agent (simulated) dials as the agent.
  bool joinAndStartAgent(const std::string& host, int slots = 2) {
    const auto answer = join(host, slots, joinCredential());
    const auto* joined = answer ? std::get_if<proto::Joined>(&*answer) : nullptr;
    if (!joined) return false;
    // Bound to this join: not the name-only A(H) a listed host's agent holds.
    CHECK(joined->credential != credentials::agent(token(), host));
    CHECK(joined->credential.size() == 64);
    credentialOf[host] = joined->credential;
    cluster->startAgent(host, "in-process", joined->credential);
    return true;
  }
  // A hello over the daemon's in-process network: the refusal's text, or
  // "(not refused)" when nothing refused it before the connection was kept.
  std::string hello(const std::string& credential, const std::string& role, const std::string& host, int rank = -1,
                    int generation = -1) {
    auto connection = std::make_shared<FramedConnection>(localNetwork->dial(role + " " + host));
    std::optional<proto::Message> answer;
    bool closed = false;
    connection->start([&](const proto::Message& m) { answer = m; }, [&](const std::string&) { closed = true; });
    connection->send(proto::Hello{proto::kVersion, credential, role, host, rank, generation});
    runUntil([&] { return closed; }, 2s);
    const std::string why = refusal(answer);
    connection->close("test over");
    runFor(100ms);
    return why;
  }
  std::map<std::string, std::string> credentialOf;  // the agent credential each host's last join got
  std::string refusal(const std::optional<proto::Message>& answer) const {
    const auto* ack = answer ? std::get_if<proto::Ack>(&*answer) : nullptr;
    return ack && !ack->ok ? ack->error : "(not refused)";
  }
  bool training(int generation, int world) {
    return runUntil(
        [&] {
          return cluster->generation() == generation && cluster->worldSize(generation) == world &&
                 cluster->welcomedWorkers(generation) == world && cluster->minStep(generation) >= 1;
        },
        20s);
  }
};

}  // namespace

TEST_CASE("join: hosts that join start the job, grow it, leave with their agent and grow it back when they rejoin",
          "[join]") {
  JoinDaemon f("join_grow_leave_rejoin");
  f.runFor(2s);
  CHECK(f.cluster->launches() == 0);  // nobody joined yet: nothing to plan
  REQUIRE(f.joinAndStartAgent("node-a"));
  REQUIRE(f.training(1, 2));  // 2 stages x 1 replica on node-a
  REQUIRE(f.joinAndStartAgent("node-b"));
  REQUIRE(f.training(2, 4));  // grown to 2 x 2
  CHECK(f.events("host_joined").size() == 2);

  // Another agent claiming node-b while node-b's is up: refused, job untouched.
  CHECK_THAT(f.refusal(f.join("node-b", 2, f.joinCredential())), Catch::Contains(std::string(proto::kJoinHostPresent)));
  CHECK(f.events("join_refused").size() == 1);

  // node-b's agent dies with its workers (a node crash, a SIGKILLed task):
  // the host leaves the job, which goes on on node-a.
  f.cluster->dropAgent("node-b", /*withWorkers=*/true);
  REQUIRE(f.training(3, 2));
  const auto lost = f.events("host_lost");
  REQUIRE(lost.size() == 1);
  CHECK(lost[0]["joined"] == true);
  CHECK_FALSE(f.state()["hosts"].contains("node-b"));  // forgotten: nothing starts it again

  // The requeued task joins again under the same name: the job grows back.
  REQUIRE(f.joinAndStartAgent("node-b"));
  REQUIRE(f.training(4, 4));
  CHECK(f.state()["hosts"]["node-b"]["joined"] == true);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("join: a joined host's credentials are its join's: the name-only one and an earlier join's are refused",
          "[join]") {
  JoinDaemon f("join_bound_credentials");
  REQUIRE(f.joinAndStartAgent("node-a"));
  REQUIRE(f.training(1, 2));
  const std::string first = f.credentialOf.at("node-a");
  // What anyone who knows H, or a listed H's agent, holds: A(H) by the name.
  const std::string byName = credentials::agent(f.token(), "node-a");
  CHECK_THAT(f.hello(byName, "agent", "node-a"), Catch::Contains("wrong job token"));
  CHECK_THAT(f.hello(credentials::notifier(byName), "notifier", "node-a"), Catch::Contains("wrong job token"));
  CHECK_THAT(f.hello(credentials::worker(byName, 0, 1), "worker", "node-a", 0, 1), Catch::Contains("wrong job token"));
  // The join's own credentials pass the check (the agent's then meets the agent already up).
  CHECK_THAT(f.hello(first, "agent", "node-a"), Catch::Contains("already has an agent"));
  CHECK(f.hello(credentials::notifier(first), "notifier", "node-a") == "(not refused)");

  // node-a's task ends and is requeued: the new join gets a credential of its
  // own, and everything the first join's credential derives is refused.
  f.cluster->dropAgent("node-a", /*withWorkers=*/true);
  REQUIRE(f.runUntil([&] { return !f.state()["hosts"].contains("node-a"); }, 10s));
  REQUIRE(f.joinAndStartAgent("node-a"));
  REQUIRE(f.runUntil([&] { return f.cluster->launches() == 2; }, 20s));
  const int generation = f.cluster->generation();
  REQUIRE(f.training(generation, 2));
  CHECK(f.credentialOf.at("node-a") != first);
  CHECK_THAT(f.hello(first, "agent", "node-a"), Catch::Contains("wrong job token"));
  CHECK_THAT(f.hello(credentials::notifier(first), "notifier", "node-a"), Catch::Contains("wrong job token"));
  CHECK_THAT(f.hello(credentials::worker(first, 0, generation), "worker", "node-a", 0, generation),
             Catch::Contains("wrong job token"));
  CHECK(f.cluster->launches() == 2);  // none of it touched the job
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("join: wrong, expired, forged and malformed joins are refused before anything else", "[join]") {
  JoinDaemon f("join_refusals");
  // Another job's credential, an expired one of this job, one whose expiry
  // was edited (its MAC no longer holds), a worker's credential, no credential.
  const std::string expired = f.joinCredential(-10);
  std::string edited = f.joinCredential();
  edited[5] = edited[5] == '9' ? '8' : '9';
  const auto other = credentials::join("another job's secret", unixSecondsNow() + 3600);
  CHECK_THAT(f.refusal(f.join("node-x", 2, other)), Catch::Contains("wrong join credential"));
  CHECK_THAT(f.refusal(f.join("node-x", 2, expired)), Catch::Contains("expired join credential"));
  CHECK_THAT(f.refusal(f.join("node-x", 2, edited)), Catch::Contains("wrong join credential"));
  CHECK_THAT(f.refusal(f.join("node-x", 2, credentials::agent(f.token(), "node-x"))),
             Catch::Contains("not a join credential"));
  CHECK_THAT(f.refusal(f.join("node-x", 2, "")), Catch::Contains("not a join credential"));
  // A valid credential, but a name or slot count the pool will not take.
  CHECK_THAT(f.refusal(f.join("bad host!", 2, f.joinCredential())), Catch::Contains("not an IP address or host name"));
  CHECK_THAT(f.refusal(f.join("node-x", 0, f.joinCredential())), Catch::Contains("slots 0"));
  CHECK_THAT(f.refusal(f.join("node-x", 5000, f.joinCredential())), Catch::Contains("slots 5000"));
  f.runFor(2s);
  CHECK(f.cluster->launches() == 0);
  CHECK(f.events("host_joined").empty());
  // Five credential refusals: written in full at most three a minute (the
  // listener's summary counts the rest).
  CHECK(f.events("connection_refused").size() <= 3);
  CHECK(f.events("join_refused").size() == 3);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("join: training waits for --min_hosts; a host that joins but never says hello is forgotten", "[join]") {
  JoinDaemon f("join_min_hosts", /*minHosts=*/2);
  REQUIRE(f.joinAndStartAgent("node-a"));
  f.runFor(5s);
  CHECK(f.cluster->launches() == 0);  // one of two

  // node-c's join is admitted but its agent never dials: after the hello
  // wait it is forgotten, and it never counted towards --min_hosts.
  REQUIRE(f.join("node-c", 2, f.joinCredential()));
  REQUIRE(f.runUntil([&] { return f.events("join_abandoned").size() == 1; }, 30s));
  CHECK(f.cluster->launches() == 0);
  CHECK_FALSE(f.state()["hosts"].contains("node-c"));

  REQUIRE(f.joinAndStartAgent("node-b"));
  REQUIRE(f.training(1, 4));  // both hosts from the first launch
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("join: a joined agent gone silent is closed and leaves; a stop with joined agents up ends cleanly",
          "[join]") {
  // Both go through loops over the pool's agents that close connections
  // (silent agents; the shutdown): a joined host's entry must outlive them.
  JoinDaemon f("join_silent_then_stop");
  REQUIRE(f.joinAndStartAgent("node-a"));
  REQUIRE(f.joinAndStartAgent("node-b"));
  REQUIRE(f.runUntil([&] { return f.cluster->worldSize(f.cluster->generation()) == 4 &&
                                  f.cluster->minStep(f.cluster->generation()) >= 1; }, 20s));
  const int grown = f.cluster->generation();
  f.cluster->freezeAgent("node-b");  // a frozen or cut-off agent: no heartbeat, no close
  REQUIRE(f.training(grown + 1, 2));
  REQUIRE(f.events("host_lost").size() == 1);
  CHECK(f.events("host_lost")[0]["host"] == "node-b");
  f.runFor(1s);  // the deferred forgetting has run
  CHECK_FALSE(f.state()["hosts"].contains("node-b"));
  // The name is free again: the host rejoins (a new agent) and the job grows.
  f.cluster->thawAgent("node-b");
  REQUIRE(f.joinAndStartAgent("node-b"));
  REQUIRE(f.training(grown + 2, 4));

  f.daemon->requestStop("the test is over");
  REQUIRE(f.runUntil([&] { return f.daemon->phase() == DaemonPhase::kFinished; }, 20s));
  f.runFor(1s);
  CHECK(f.events("stop")[0]["exit_code"] == 0);
  CHECK(f.cluster->count(sim::PeerKind::kAgent, "shutdown") >= 2);
  CHECK(f.daemon->handlerFailures() == 0);
}
