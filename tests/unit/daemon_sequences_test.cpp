// Fault sequences against the real ManagerDaemon, in-process, on loopback:
// SimHostLauncher starts a simulated agent (tests/support/sim_cluster.h) for
// every host of the machine list; the agents start simulated workers that
// say hello, heartbeat and report steps. The daemon and the cluster share one
// io_context, polled by the test thread (DaemonHarness::runUntil,
// daemon_harness.h), and one FakeClock: every wait is on a condition with a
// deadline of job time, never a bare sleep, and the seconds of job time a
// case spans pass in milliseconds.
#include <catch2/catch.hpp>

#include <cmath>

#include <functional>

#include <nlohmann/json.hpp>

#include "daemon/job_metrics.h"
#include "sim_daemon_harness.h"
#include "varuna/common/checkpoint_files.h"
#include "varuna/manager/manager_daemon.h"

using namespace varuna;
using namespace std::chrono_literals;
using sim::PeerKind;

namespace {

struct Job {
  std::vector<std::string> hosts;
  int slots = 2;
  int stages = 2;
  int64_t batch = 4;
};

// run_varuna in-process on `job`'s hosts, its agents and workers simulated.
struct SimDaemon : test::SimDaemonHarness {
  SimDaemon(const std::string& name, const Job& job, const std::function<void(JobConfig&)>& tweak = {},
            sim::SimOptions simOptions = sim::fastSimOptions())
      : SimDaemonHarness(name, 10s) {
    test::writeMachineList(dir / "machines.txt", job.hosts, job.slots);
    // agentPath never runs: SimHostLauncher starts a simulated agent.
    JobConfig config = test::daemonTestConfig(dir, "sequences", job.batch, job.stages);
    test::fastFaultTimings(config);
    if (tweak) tweak(config);
    simOptions.globalStore = config.globalStore;  // checkpoint orders write real (tiny) checkpoints
    useFakeClock();  // and in-memory streams to the daemon: no socket
    simulate(simOptions);
    startSimulated(config);
  }
  ~SimDaemon() { CHECK(noSockets() == ""); }  // the whole test ran without a socket

  // Every rank of `generation` has been welcomed and finished `steps` steps.
  bool training(int generation, int64_t steps = 2) const {
    const int world = cluster->worldSize(generation);
    return world > 0 && cluster->welcomedWorkers(generation) == world && cluster->liveWorkers(generation) == world &&
           cluster->minStep(generation) >= steps - 1;
  }
  bool waitTraining(int generation, std::chrono::milliseconds limit = 15s) {
    return runUntil([&] { return cluster->generation() == generation && training(generation); }, limit);
  }
};

std::vector<proto::WorkerSpec> specs(std::initializer_list<std::pair<int, int>> rankAndLocal) {
  std::vector<proto::WorkerSpec> out;
  for (const auto& [rank, local] : rankAndLocal) out.push_back({rank, local});
  return out;
}

// Exit reports of `generation` for `rank`.
std::vector<sim::ExitReport> exitsOf(const sim::SimCluster& cluster, int rank, int generation) {
  std::vector<sim::ExitReport> out;
  for (const auto& e : cluster.exitReports()) {
    if (e.rank == rank && e.generation == generation) out.push_back(e);
  }
  return out;
}

}  // namespace

TEST_CASE("sequences: an agent that drops is written off, the job relaunches on the rest", "[sequences]") {
  SimDaemon f("seq_agent_dropped", Job{{"node-a", "node-b"}, 2, 2, 4});
  REQUIRE(f.waitTraining(1));
  const auto first = f.cluster->launchesTo("node-b");
  REQUIRE(first.size() == 1);
  CHECK(first[0].stageToRankMap == "0,2;1,3;");
  CHECK(first[0].workers == specs({{2, 0}, {3, 1}}));

  f.cluster->setHostReachable("node-a", false);  // if the daemon starts its agent again, that fails
  f.cluster->dropAgent("node-a");                // its workers run on: the manager must order them out
  REQUIRE(f.waitTraining(2));

  // node-a's workers were ordered out over their own connections.
  CHECK(f.cluster->workerGot("exit_now", 0, 1));
  CHECK(f.cluster->workerGot("exit_now", 1, 1));
  // The survivor killed its generation-1 workers (each reported once) and got the new plan.
  CHECK(f.cluster->count(PeerKind::kAgent, "kill_workers", "node-b") >= 1);
  for (int rank : {2, 3}) {
    const auto exits = exitsOf(*f.cluster, rank, 1);
    REQUIRE(exits.size() == 1);
    const bool killedOrOrderedOut = (exits[0].exitCode == -1 && exits[0].signal == 9) || exits[0].exitCode == 76;
    CHECK(killedOrOrderedOut);
  }
  const auto launches = f.cluster->launchesTo("node-b");
  REQUIRE(launches.size() == 2);
  const auto& relaunch = launches[1];
  CHECK(relaunch.generation == 2);
  CHECK(relaunch.worldSize == 2);
  CHECK(relaunch.stageToRankMap == "0;1;");
  CHECK(relaunch.workers == specs({{0, 0}, {1, 1}}));
  CHECK(relaunch.batchSize == 4);  // the global batch is kept: one replica takes all of it
  CHECK(relaunch.masterAddr == "node-b");
  CHECK(relaunch.resumeStep == -1);  // killed, never checkpointed: a fresh start
  CHECK(f.cluster->launchesTo("node-a").size() == 1);
  CHECK(f.events("host_lost").size() == 1);
  CHECK(f.events("kill_all").size() == 1);
  CHECK(f.cluster->launches() == 2);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("sequences: a preemption notice during the checkpoint of a morph makes one next generation", "[sequences]") {
  auto sim = sim::fastSimOptions();
  sim.checkpointDelay = 800ms;  // the checkpoint phase lasts long enough for a second notice
  SimDaemon f("seq_preempt_during_morph", Job{{"node-a", "node-b", "node-c"}, 2, 2, 6}, {}, sim);
  REQUIRE(f.waitTraining(1));
  REQUIRE(f.cluster->worldSize(1) == 6);

  f.cluster->sendPreemptNotice("node-a");
  REQUIRE(f.runUntil([&] { return f.cluster->count(PeerKind::kAgent, "checkpoint_and_exit") >= 3; }));
  // The checkpoint is under way: nobody has exited yet.
  REQUIRE(f.cluster->exitReports().empty());
  f.cluster->sendPreemptNotice("node-b");
  REQUIRE(f.runUntil([&] { return f.cluster->count(PeerKind::kNotifier, "ack") == 2; }));
  CHECK(f.cluster->exitReports().empty());  // the second notice came inside the checkpoint phase
  for (const auto& ack : f.cluster->ordersTo(PeerKind::kNotifier, "", "ack")) {
    CHECK(std::get<proto::Ack>(ack.message).ok);
  }

  REQUIRE(f.waitTraining(2));
  f.runFor(1500ms);  // time for a second, inconsistent relaunch to show
  CHECK(f.cluster->launches() == 2);
  CHECK(f.cluster->generation() == 2);
  // One checkpoint for both notices; every rank of generation 1 checkpointed.
  CHECK(f.events("checkpoint_ordered").size() == 1);
  CHECK(f.cluster->count(PeerKind::kAgent, "checkpoint_and_exit") == 3);
  for (int rank = 0; rank < 6; ++rank) {
    const auto exits = exitsOf(*f.cluster, rank, 1);
    REQUIRE(exits.size() == 1);
    CHECK(exits[0].exitCode == 75);
  }
  // Generation 2 leaves both preempted hosts out; they are released.
  const auto launches = f.cluster->launchesTo("node-c");
  REQUIRE(launches.size() == 2);
  CHECK(launches[1].generation == 2);
  CHECK(launches[1].worldSize == 2);
  CHECK(launches[1].stageToRankMap == "0;1;");
  CHECK(launches[1].batchSize == 6);
  // It resumes from the one checkpoint the six ranks wrote together.
  CHECK(launches[1].resumeStep >= 0);
  CHECK(ckpt::latestComplete(f.dir / "store") == launches[1].resumeStep);
  CHECK(ckpt::listCheckpoints(f.dir / "store").size() == 1);
  CHECK(f.cluster->launchesTo("node-a").size() == 1);
  CHECK(f.cluster->launchesTo("node-b").size() == 1);
  CHECK(f.cluster->count(PeerKind::kAgent, "shutdown", "node-a") == 1);
  CHECK(f.cluster->count(PeerKind::kAgent, "shutdown", "node-b") == 1);
  CHECK(f.cluster->count(PeerKind::kAgent, "shutdown", "node-c") == 0);
  CHECK(f.events("kill_all").empty());
  CHECK(f.events("launch").size() == 2);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("sequences: a preemption notice during the kill and backoff after a loss makes one next generation",
          "[sequences]") {
  SimDaemon f("seq_preempt_during_backoff", Job{{"node-a", "node-b", "node-c"}, 2, 2, 6},
              [](JobConfig& config) { config.restartBackoffS = 1; });
  REQUIRE(f.waitTraining(1));
  f.cluster->setHostReachable("node-a", false);
  f.cluster->dropAgent("node-a", /*withWorkers=*/true);
  REQUIRE(f.runUntil([&] { return f.events("kill_all").size() == 1; }));
  f.cluster->sendPreemptNotice("node-b");  // inside the backoff: no generation 2 yet
  REQUIRE(f.runUntil([&] { return f.cluster->count(PeerKind::kNotifier, "ack") == 1; }));
  CHECK(f.cluster->launches() == 1);
  REQUIRE(f.waitTraining(2));
  f.runFor(1500ms);
  CHECK(f.cluster->launches() == 2);
  const auto launches = f.cluster->launchesTo("node-c");
  REQUIRE(launches.size() == 2);
  CHECK(launches[1].generation == 2);
  CHECK(launches[1].worldSize == 2);  // neither the lost host nor the preempted one
  CHECK(f.cluster->launchesTo("node-b").size() == 1);
  CHECK(f.cluster->count(PeerKind::kAgent, "shutdown", "node-b") == 1);
  CHECK(f.events("checkpoint_ordered").empty());  // the generation was being killed: nothing to checkpoint
  CHECK(f.events("launch").size() == 2);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("sequences: a stopped worker is written off as hung and the job relaunches", "[sequences]") {
  SimDaemon f("seq_worker_stopped", Job{{"node-a", "node-b"}, 2, 2, 4});
  REQUIRE(f.waitTraining(1));
  f.cluster->freezeWorker(3);  // SIGSTOP: no heartbeat, no step; its peers wait on it
  const auto stoppedAt = f.now();
  REQUIRE(f.runUntil([&] { return !f.events("worker_hung").empty(); }));
  const double detectedAfter = std::chrono::duration<double>(f.now() - stoppedAt).count();
  CHECK(detectedAfter >= 1.8);  // heartbeat_timeout_s 2
  CHECK(f.events("worker_hung")[0]["rank"] == 3);
  REQUIRE(f.waitTraining(2));
  CHECK(f.cluster->worldSize(2) == 4);  // every host still answers: the same plan
  // Its agent killed it (a stopped process dies of SIGKILL) and said so.
  const auto exits = exitsOf(*f.cluster, 3, 1);
  REQUIRE(exits.size() == 1);
  CHECK(exits[0].exitCode == -1);
  CHECK(exits[0].signal == 9);
  CHECK(f.cluster->launches() == 2);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("sequences: workers of a generation the manager does not run are ordered out", "[sequences]") {
  SimDaemon f("seq_stale_worker", Job{{"node-a", "node-b"}, 1, 1, 2});
  REQUIRE(f.waitTraining(1));
  f.cluster->connectStaleWorker("node-a", 0, 0);   // an earlier generation's straggler
  f.cluster->connectStaleWorker("node-b", 1, 7);   // one of a generation not launched (an earlier manager's)
  f.cluster->connectStaleWorker("node-b", 5, 1);   // the current generation, a rank it does not have
  REQUIRE(f.runUntil([&] { return f.events("stale_worker").size() == 3; }));
  REQUIRE(f.runUntil([&] {
    return f.cluster->workerGot("exit_now", 0, 0) && f.cluster->workerGot("exit_now", 1, 7) &&
           f.cluster->workerGot("exit_now", 5, 1);
  }));
  for (const auto& order : f.cluster->ordersTo(PeerKind::kWorker, "", "exit_now")) {
    CHECK(std::get<proto::ExitNow>(order.message).generation == order.generation);  // its own: it obeys
  }
  CHECK(f.cluster->count(PeerKind::kWorker, "welcome") == 2);  // only the launched ranks
  // The running generation goes on undisturbed.
  const int64_t step = f.cluster->minStep(1);
  REQUIRE(f.runUntil([&] { return f.cluster->minStep(1) >= step + 3; }));
  CHECK(f.cluster->launches() == 1);
  CHECK(f.events("kill_all").empty());
  CHECK(f.cluster->ordersTo(PeerKind::kWorker, "", "exit_now").size() == 3);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("sequences: a frozen agent's workers are ordered out and the job relaunches without it", "[sequences]") {
  SimDaemon f("seq_agent_frozen", Job{{"node-a", "node-b"}, 2, 2, 4});
  REQUIRE(f.waitTraining(1));
  f.cluster->setHostReachable("node-b", false);
  f.cluster->freezeAgent("node-b");  // silent, socket open: only the heartbeat timeout finds it
  const auto frozenAt = f.now();
  REQUIRE(f.runUntil([&] { return f.cluster->workerGot("exit_now", 2, 1) && f.cluster->workerGot("exit_now", 3, 1); }));
  const double detectedAfter = std::chrono::duration<double>(f.now() - frozenAt).count();
  CHECK(detectedAfter >= 2.5);  // the agent timeout is max(heartbeat_timeout_s, 3) s
  REQUIRE(f.waitTraining(2));
  const auto lost = f.events("host_lost");
  REQUIRE(lost.size() == 1);
  CHECK(lost[0]["host"] == "node-b");
  const auto launches = f.cluster->launchesTo("node-a");
  REQUIRE(launches.size() == 2);
  CHECK(launches[1].generation == 2);
  CHECK(launches[1].stageToRankMap == "0;1;");
  CHECK(launches[1].workers == specs({{0, 0}, {1, 1}}));
  // node-b's workers were gone before anyone could report them (their agent is frozen).
  CHECK(exitsOf(*f.cluster, 2, 1).empty());
  CHECK(exitsOf(*f.cluster, 3, 1).empty());
  CHECK(f.events("worker_hung").empty());  // the host's loss, not its workers'
  // Thawed, the agent finds its connection closed: it reports nothing and gets nothing more.
  f.cluster->thawAgent("node-b");
  f.runFor(300ms);
  CHECK_FALSE(f.cluster->agentUp("node-b"));
  CHECK(f.cluster->launchesTo("node-b").size() == 1);
  CHECK(f.cluster->launches() == 2);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("sequences: a lost host whose agent starts again grows the job back", "[sequences]") {
  SimDaemon f("seq_host_back", Job{{"node-a", "node-b"}, 2, 2, 4}, [](JobConfig& config) {
    config.hostRetryS = 0.3;
    config.hostRetryMaxS = 0.6;
  });
  REQUIRE(f.waitTraining(1));
  f.cluster->setHostReachable("node-b", false);
  f.cluster->dropAgent("node-b", /*withWorkers=*/true);  // the host is gone, its workers with it
  REQUIRE(f.waitTraining(2));
  CHECK(f.cluster->worldSize(2) == 2);
  CHECK(f.cluster->launchesTo("node-b").size() == 1);
  // The manager keeps trying the host's agent; the host does not answer yet.
  REQUIRE(f.runUntil([&] { return f.cluster->agentStarts("node-b") >= 3; }));
  CHECK(f.cluster->launches() == 2);
  CHECK(f.events("host_back").empty());

  f.cluster->setHostReachable("node-b", true);
  REQUIRE(f.waitTraining(3, 20s));
  const auto back = f.events("host_back");
  REQUIRE(back.size() == 1);
  CHECK(back[0]["host"] == "node-b");
  const auto launches = f.cluster->launchesTo("node-b");
  REQUIRE(launches.size() == 2);
  CHECK(launches[1].generation == 3);
  CHECK(launches[1].worldSize == 4);
  CHECK(launches[1].stageToRankMap == "0,2;1,3;");
  CHECK(launches[1].workers == specs({{2, 0}, {3, 1}}));
  CHECK(launches[1].batchSize == 2);
  CHECK(launches[1].resumeStep >= 0);  // from generation 2's checkpoint
  CHECK(ckpt::latestComplete(f.dir / "store") == launches[1].resumeStep);
  // Growing is a morph: generation 2 checkpointed (75) rather than being killed.
  CHECK(f.cluster->count(PeerKind::kAgent, "checkpoint_and_exit", "node-a") == 1);
  for (int rank : {0, 1}) {
    const auto exits = exitsOf(*f.cluster, rank, 2);
    REQUIRE(exits.size() == 1);
    CHECK(exits[0].exitCode == 75);
  }
  CHECK(f.events("kill_all").size() == 1);  // only for the loss
  CHECK(f.cluster->launches() == 3);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("sequences: a rank whose step stalls while its peers wait is declared hung", "[sequences]") {
  SimDaemon f("seq_hang", Job{{"node-a", "node-b"}, 2, 2, 4}, [](JobConfig& config) { config.hangTimeoutS = 1; });
  REQUIRE(f.waitTraining(1));
  // Rank 1 computes forever (heartbeats go on, its step stays); the others wait on it.
  f.cluster->freezeProgress(1);
  const auto frozenAt = f.now();
  REQUIRE(f.runUntil([&] { return !f.events("hang").empty(); }));
  const double detectedAfter = std::chrono::duration<double>(f.now() - frozenAt).count();
  CHECK(detectedAfter >= 0.9);
  const auto hang = f.events("hang");
  REQUIRE(hang.size() == 1);
  REQUIRE(hang[0]["ranks"].size() == 1);
  CHECK(hang[0]["ranks"][0]["rank"] == 1);
  CHECK(hang[0]["ranks"][0]["host"] == "node-a");
  CHECK(hang[0]["ranks"][0]["waiting"] == false);
  CHECK(hang[0]["waiting_ranks"] == nlohmann::json::array({0, 2, 3}));
  REQUIRE(f.runUntil([&] { return f.cluster->workerGot("exit_now", 1, 1); }));
  // The rest is killed and the same plan relaunched.
  REQUIRE(f.waitTraining(2));
  CHECK(f.cluster->worldSize(2) == 4);
  CHECK(f.cluster->launchesTo("node-a").back().stageToRankMap == "0,2;1,3;");
  CHECK(f.events("kill_all").size() == 1);
  CHECK(f.events("hang").size() == 1);
  CHECK(f.cluster->launches() == 2);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("sequences: workers heard only through their agents' relayed beats stay alive", "[sequences]") {
  // No step reports: after its hello a worker's only word is the beat its
  // agent relays (WorkerBeats), which must count as its heartbeat.
  sim::SimOptions options = sim::fastSimOptions();
  options.step = 0ms;
  REQUIRE(options.beatsThroughAgent);
  SimDaemon f("seq_relayed_beats", Job{{"node-a", "node-b"}, 2, 2, 4}, {}, options);
  REQUIRE(f.runUntil([&] { return f.cluster->welcomedWorkers(1) == 4; }));
  f.runFor(5000ms);  // 2.5 x heartbeat_timeout_s
  CHECK(f.events("worker_hung").empty());
  CHECK(f.cluster->liveWorkers(1) == 4);
  CHECK(f.cluster->launches() == 1);
  // One heartbeat of each to the manager (the first, after its hello), every
  // other one through a relay.
  CHECK(f.cluster->directHeartbeats() == 4);
  CHECK(f.cluster->relayedBeats() > 100);
  CHECK(f.cluster->relays() > 20);
  CHECK(f.daemon->handlerFailures() == 0);
}

namespace {

// The value of an unlabelled gauge or counter of the daemon's metrics; NaN if none.
double gauge(const SimDaemon& f, const std::string& name) {
  for (const auto& family : f.daemon->metrics().collect()) {
    if (family.name != name || family.metric.empty()) continue;
    const auto& metric = family.metric.front();
    return family.type == prometheus::MetricType::Counter ? metric.counter.value : metric.gauge.value;
  }
  return std::nan("");
}

}  // namespace

TEST_CASE("sequences: step reports relayed by the agents count as the ranks' own, through a host's loss",
          "[sequences]") {
  // Every step report goes through the agent (one frame per host and
  // relay, as varuna_agent's workers send them): steps complete, losses
  // reach the metrics, and after a host is lost the survivors' relayed
  // reports carry the next generation.
  sim::SimOptions options = sim::fastSimOptions();
  options.reportsThroughAgent = true;
  SimDaemon f("seq_relayed_reports", Job{{"node-a", "node-b"}, 2, 2, 4}, {}, options);
  REQUIRE(f.runUntil([&] { return f.cluster->welcomedWorkers(1) == 4 && gauge(f, "varuna_step") >= 5; }));
  CHECK(gauge(f, "varuna_generation") == 1);
  CHECK(std::isfinite(gauge(f, "varuna_loss")));
  f.cluster->setHostReachable("node-b", false);
  f.cluster->freezeAgent("node-b");
  REQUIRE(f.runUntil([&] { return f.cluster->launches() == 2; }));
  // Steps of the survivors' generation complete from their relayed reports
  // (each completed step counts the global batch of 4 once).
  REQUIRE(f.runUntil([&] { return gauge(f, "varuna_generation") == 2 && gauge(f, "varuna_morph_in_progress") == 0; }));
  const double trained = gauge(f, "varuna_trained_samples_total");
  REQUIRE(f.runUntil([&] { return gauge(f, "varuna_trained_samples_total") >= trained + 3 * 4; }));
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("sequences: a frozen agent whose workers are heard only through it is a lost host, not hung workers",
          "[sequences]") {
  sim::SimOptions options = sim::fastSimOptions();
  options.step = 0ms;  // no step reports: the relays are all the manager hears of a worker
  SimDaemon f("seq_relay_frozen", Job{{"node-a", "node-b"}, 2, 2, 4}, {}, options);
  REQUIRE(f.runUntil([&] { return f.cluster->welcomedWorkers(1) == 4; }));
  f.runFor(500ms);
  f.cluster->setHostReachable("node-b", false);
  f.cluster->freezeAgent("node-b");
  const auto frozenAt = f.now();
  // Its workers fall silent after heartbeat_timeout_s (2 s), but so did their
  // agent: the agent's own timeout (3 s) decides, for the whole host.
  REQUIRE(f.runUntil([&] { return !f.events("host_lost").empty(); }));
  CHECK(std::chrono::duration<double>(f.now() - frozenAt).count() >= 2.5);
  CHECK(f.events("host_lost")[0]["host"] == "node-b");
  CHECK(f.events("worker_hung").empty());
  // The survivors' orders leave with the host_lost event; wait for them to arrive.
  CHECK(f.runUntil([&] { return f.cluster->workerGot("exit_now", 2, 1) && f.cluster->workerGot("exit_now", 3, 1); }));
  CHECK(f.daemon->handlerFailures() == 0);
}

// --- the daemon's lifecycle: starting agents, running, stopping, finished ------------------

TEST_CASE("lifecycle: a stop before the job started ends it at once; no launch, no checkpoint", "[lifecycle]") {
  SimDaemon f("life_stop_before_start", Job{{"node-a", "node-b"}, 2, 2, 4});
  // start() only queued the agents' start-ups: none is up yet, so no job runs.
  CHECK(f.daemon->phase() == DaemonPhase::kStartingAgents);
  f.daemon->requestStop("stopped before the start");
  CHECK(f.daemon->phase() == DaemonPhase::kFinished);
  REQUIRE(f.runUntil([&] { return f.events("stop").size() == 1; }));
  f.runFor(2000ms);  // time for anything that would still start
  const auto stop = f.events("stop");
  REQUIRE(stop.size() == 1);
  CHECK(stop[0]["reason"] == "stopped before the start");
  CHECK(stop[0]["exit_code"] == 0);
  CHECK(f.events("stop_requested").empty());  // nothing for the controller to stop
  CHECK(f.events("checkpoint_ordered").empty());
  CHECK(f.events("launch").empty());
  CHECK(f.cluster->launches() == 0);
  CHECK(f.daemon->exitCode() == 0);
  CHECK(f.state()["phase"] == "finished");
  // A second request after the end changes nothing.
  f.daemon->requestStop("again");
  f.runFor(500ms);
  CHECK(f.events("stop").size() == 1);
  CHECK(f.events("stop_requested").empty());
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("lifecycle: a stop while running checkpoints once, then ends; late peers change nothing",
          "[lifecycle]") {
  SimDaemon f("life_stop_running", Job{{"node-a", "node-b"}, 2, 2, 4});
  REQUIRE(f.waitTraining(1));
  CHECK(f.daemon->phase() == DaemonPhase::kRunning);
  f.daemon->requestStop("the test is over");
  CHECK(f.daemon->phase() == DaemonPhase::kStopping);
  REQUIRE(f.runUntil([&] { return f.events("stop").size() == 1; }));
  CHECK(f.daemon->phase() == DaemonPhase::kFinished);
  CHECK(f.events("stop_requested").size() == 1);
  CHECK(f.events("checkpoint_ordered").size() == 1);
  CHECK(f.events("kill_all").empty());
  for (int rank = 0; rank < 4; ++rank) {
    const auto exits = exitsOf(*f.cluster, rank, 1);
    REQUIRE(exits.size() == 1);
    CHECK(exits[0].exitCode == 75);
  }
  CHECK(f.events("stop")[0]["exit_code"] == 0);
  CHECK(f.cluster->count(PeerKind::kAgent, "shutdown") == 2);
  f.runFor(1000ms);
  CHECK(f.state()["phase"] == "finished");
  CHECK(f.state()["morphs"] == 0);
  // After the end, an agent that goes is no lost host and starts nothing.
  f.cluster->dropAgent("node-a", /*withWorkers=*/true);
  f.runFor(2000ms);
  CHECK(f.events("host_lost").empty());
  CHECK(f.cluster->agentStarts("node-a") == 1);
  CHECK(f.cluster->launches() == 1);
  CHECK(f.daemon->exitCode() == 0);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("lifecycle: a second stop during the stop's checkpoint kills at once and is no morph", "[lifecycle]") {
  auto sim = sim::fastSimOptions();
  sim.checkpointDelay = 3000ms;  // the stop's checkpoint lasts
  SimDaemon f("life_stop_twice", Job{{"node-a", "node-b"}, 2, 2, 4}, {}, sim);
  REQUIRE(f.waitTraining(1));
  f.daemon->requestStop("first");
  REQUIRE(f.runUntil([&] { return f.cluster->count(PeerKind::kAgent, "checkpoint_and_exit") == 2; }));
  CHECK(f.cluster->exitReports().empty());
  CHECK(f.daemon->phase() == DaemonPhase::kStopping);
  f.daemon->requestStop("second");
  REQUIRE(f.runUntil([&] { return f.events("stop").size() == 1; }));
  CHECK(f.daemon->phase() == DaemonPhase::kFinished);
  CHECK(f.events("stop_requested").size() == 2);
  const auto kill = f.events("kill_all");
  REQUIRE(kill.size() == 1);
  CHECK(kill[0]["reason"] == "second");
  for (int rank = 0; rank < 4; ++rank) {
    const auto exits = exitsOf(*f.cluster, rank, 1);
    REQUIRE(exits.size() == 1);
    CHECK(exits[0].exitCode == -1);  // killed before the checkpoint's delay was over
  }
  CHECK(f.events("stop")[0]["exit_code"] == 0);
  CHECK(f.daemon->exitCode() == 0);
  CHECK(f.cluster->launches() == 1);
  CHECK(f.state()["morphs"] == 0);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("lifecycle: too many failures end a running job; a stop request after that is ignored", "[lifecycle]") {
  SimDaemon f("life_failures", Job{{"node-a", "node-b"}, 2, 2, 4}, [](JobConfig& config) { config.maxFailures = 0; });
  REQUIRE(f.waitTraining(1));
  f.cluster->exitWorker(1, 1);  // a crash: the first failure is already one too many
  REQUIRE(f.runUntil([&] { return f.events("stop").size() == 1; }));
  f.runFor(1000ms);
  CHECK(f.events("stop")[0]["exit_code"] != 0);
  CHECK(f.daemon->exitCode() != 0);
  CHECK(f.state()["phase"] == "failed");
  CHECK(f.daemon->phase() == DaemonPhase::kFinished);  // from kRunning, no kStopping
  CHECK(f.cluster->launches() == 1);
  f.daemon->requestStop("too late");
  f.runFor(500ms);
  CHECK(f.events("stop_requested").empty());
  CHECK(f.events("stop").size() == 1);
  CHECK(f.daemon->handlerFailures() == 0);
}
