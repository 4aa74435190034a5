// The manager's decisions, driven by a fake clock and fake events.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "varuna/common/errors.h"
#include "varuna/manager/morph_controller.h"
#include "varuna/manager/morph_timer.h"

using namespace varuna;
using namespace std::chrono_literals;

namespace {

struct Harness {
  std::optional<int64_t> latest;
  TimePoint now{};
  MorphController controller;

  Harness(std::vector<Machine> machines, ControllerOptions options = defaults())
      : controller(options, std::move(machines), [this] { return latest; }) {}

  static ControllerOptions defaults() {
    ControllerOptions o;
    o.stages = 2;
    o.globalBatch = 16;
    o.chunkSize = 4;
    o.checkpointTimeout = 30s;
    o.restartBackoff = 1s;
    o.maxFailures = 2;
    o.failureWindow = 10min;
    return o;
  }
  // Every running worker exits with `code`; returns the actions of the last exit.
  std::vector<Action> allExit(int code) {
    std::vector<Action> last;
    const auto ranks = controller.runningRanks();
    for (int r : ranks) last = controller.workerExited(r, code, now);
    return last;
  }
};

template <typename A>
const A& only(const std::vector<Action>& actions) {
  REQUIRE(actions.size() == 1);
  REQUIRE(std::holds_alternative<A>(actions[0]));
  return std::get<A>(actions[0]);
}

std::vector<Machine> twoHosts() { return {{"a", 2, 1}, {"b", 2, 2}}; }

}  // namespace

TEST_CASE("planner: clustered placement, most replicas, constant global batch", "[planner]") {
  auto plan = makePlan({twoHosts(), 2, 16, 4, {}});
  CHECK(plan.replicas == 2);
  CHECK(plan.perReplicaBatch == 8);
  CHECK(plan.stageToRankMap == "0,2;1,3;");
  CHECK(plan.hosts == std::vector<std::string>{"a", "b"});
  REQUIRE(plan.ranksOn("a").size() == 2);
  CHECK(plan.ranksOn("a")[0].rank == 0);  // stages 0 and 1 of replica 0 share host a
  CHECK(plan.ranksOn("a")[1].rank == 1);
  CHECK(plan.ranksOn("b")[1].localRank == 1);
  // 3 slots for 1 stage, batch 16: 3 does not divide 16, so 2 replicas and one idle slot.
  auto odd = makePlan({{{"a", 3, 1}}, 1, 16, 4, {}});
  CHECK(odd.replicas == 2);
  CHECK(odd.unusedSlots == 1);
  // Excluded hosts hold nothing; too few slots is a clear error.
  CHECK(makePlan({twoHosts(), 2, 16, 4, {"b"}}).replicas == 1);
  CHECK_THROWS_WITH(makePlan({twoHosts(), 3, 16, 4, {"b"}}),
                    Catch::Contains("cannot hold one pipeline: 3 stages need 3 worker slots, 2 are available"));
  CHECK_THROWS_AS(makePlan({twoHosts(), 2, 0, 4, {}}), ConfigError);
}

TEST_CASE("a preemption notice checkpoints, then morphs onto the remaining hosts", "[morph]") {
  Harness h(twoHosts());
  auto launch = only<action::Launch>(h.controller.start(h.now));
  CHECK(launch.plan.replicas == 2);
  CHECK(launch.resumeStep == -1);

  only<action::Checkpoint>(h.controller.preemptNotice("b", h.now));
  CHECK(h.controller.phase() == Phase::kCheckpointing);
  h.latest = 40;  // the workers wrote their on-demand checkpoint
  auto relaunch = only<action::Launch>(h.allExit(kExitCheckpointed));
  CHECK(relaunch.plan.replicas == 1);
  CHECK(relaunch.plan.hosts == std::vector<std::string>{"a"});
  CHECK(relaunch.plan.globalBatch == 16);
  CHECK(relaunch.resumeStep == 40);
  CHECK(relaunch.generation == 2);
  // The preempted host's agent disconnecting afterwards is no failure.
  CHECK(h.controller.hostLost("b", h.now).empty());
  CHECK(h.controller.phase() == Phase::kRunning);
}

TEST_CASE("a sudden loss kills everyone and relaunches from the latest checkpoint after a backoff", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  h.latest = 20;
  only<action::KillAll>(h.controller.workerExited(3, -1, h.now));
  CHECK(h.controller.phase() == Phase::kStopping);
  CHECK(h.allExit(-1).empty());  // killed: now backing off
  CHECK(h.controller.phase() == Phase::kBackoff);
  CHECK(h.controller.tick(h.now + 500ms).empty());
  auto relaunch = only<action::Launch>(h.controller.tick(h.now + 1s));
  CHECK(relaunch.resumeStep == 20);
  CHECK(relaunch.plan.replicas == 2);  // the host is still there: same shape
}

TEST_CASE("a lost host is left out of the next plan", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  only<action::KillAll>(h.controller.hostLost("b", h.now));
  h.allExit(-1);
  auto relaunch = only<action::Launch>(h.controller.tick(h.now + 1s));
  CHECK(relaunch.plan.hosts == std::vector<std::string>{"a"});
}

TEST_CASE("repeated failures stop the manager instead of looping", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  for (int i = 0; i < 2; ++i) {
    h.controller.workerHung(0, h.now);
    h.allExit(-1);
    h.now += 10s;
    only<action::Launch>(h.controller.tick(h.now));
  }
  auto actions = h.controller.workerExited(1, 1, h.now);
  REQUIRE(actions.size() == 2);
  const auto& stop = std::get<action::Stop>(actions[1]);
  CHECK(stop.exitCode == 1);
  CHECK_THAT(stop.reason, Catch::Contains("3 failures within 10 min") && Catch::Contains("rank 1 exited with code 1"));
  CHECK(h.controller.phase() == Phase::kFailed);
}

TEST_CASE("hosts lost and ranks that lost a peer never stop the job; their own crashes do", "[morph]") {
  // maxFailures 2 in 10 min: ten losses of the environment in a minute are
  // survived, each relaunched after the base backoff.
  Harness h({{"a", 2, 1}, {"b", 2, 2}, {"c", 2, 3}});
  h.controller.start(h.now);
  for (int i = 0; i < 10; ++i) {
    const std::string second = h.controller.plan().placement.back().host;  // holds the last replica
    const auto actions = i % 2 == 0 ? h.controller.hostLost(second, h.now)
                                    : h.controller.workerExited(*h.controller.runningRanks().begin(), kExitPeerLost, h.now);
    only<action::KillAll>(actions);
    h.allExit(i % 3 == 0 ? kExitSuperseded : kExitPeerLost);
    h.now += 1s;  // the base backoff: none of these counted
    only<action::Launch>(h.controller.tick(h.now));
    if (i % 2 == 0) h.controller.readmitHost(second);
    h.now += 5s;
  }
  CHECK(h.controller.phase() == Phase::kRunning);
  // A rank crashing by itself (a signal, code 1) counts: the third stops it.
  for (int i = 0; i < 2; ++i) {
    only<action::KillAll>(h.controller.workerExited(*h.controller.runningRanks().begin(), -1, h.now));
    h.allExit(kExitPeerLost);
    h.now += 10s;
    only<action::Launch>(h.controller.tick(h.now));
  }
  const auto stop = h.controller.workerExited(*h.controller.runningRanks().begin(), 1, h.now);
  REQUIRE(stop.size() == 2);
  CHECK_THAT(std::get<action::Stop>(stop[1]).reason, Catch::Contains("3 failures within 10 min"));
}

TEST_CASE("the backoff doubles with each recent failure", "[morph]") {
  auto options = Harness::defaults();
  options.maxFailures = 5;
  Harness h(twoHosts(), options);
  h.controller.start(h.now);
  h.controller.workerExited(0, 1, h.now);
  h.allExit(-1);
  only<action::Launch>(h.controller.tick(h.now + 1s));
  h.controller.workerExited(0, 1, h.now);
  h.allExit(-1);
  CHECK(h.controller.tick(h.now + 1500ms).empty());  // second failure: 2 s
  only<action::Launch>(h.controller.tick(h.now + 2s));
}

TEST_CASE("a checkpoint that does not finish in time becomes a failure", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  h.controller.preemptNotice("b", h.now);
  CHECK(h.controller.tick(h.now + 29s).empty());
  only<action::KillAll>(h.controller.tick(h.now + 30s));
  h.latest = 10;  // only an older checkpoint is complete
  h.allExit(-1);
  auto relaunch = only<action::Launch>(h.controller.tick(h.now + 31s));
  CHECK(relaunch.resumeStep == 10);
  CHECK(relaunch.plan.hosts == std::vector<std::string>{"a"});  // b is still leaving
}

TEST_CASE("the checkpoint is waited for until the notice's deadline at most", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  // Taken in 8 s: waiting the full 30 s checkpointTimeout would be pointless.
  only<action::Checkpoint>(h.controller.preemptNotice("b", h.now, h.now + 8s));
  CHECK(h.controller.tick(h.now + 7s).empty());
  only<action::KillAll>(h.controller.tick(h.now + 8s));
}

TEST_CASE("a more urgent second notice shortens the wait; a later one does not lengthen it", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  only<action::Checkpoint>(h.controller.preemptNotice("b", h.now, h.now + 20s));
  CHECK(h.controller.preemptNotice("b", h.now + 1s, h.now + 60s).empty());
  CHECK(h.controller.preemptNotice("b", h.now + 1s, h.now + 5s).empty());
  CHECK(h.controller.tick(h.now + 4s).empty());
  only<action::KillAll>(h.controller.tick(h.now + 5s));
}

TEST_CASE("a notice whose deadline has passed still checkpoints; the wait ends at the next tick", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  only<action::Checkpoint>(h.controller.preemptNotice("b", h.now, h.now - 3s));
  only<action::KillAll>(h.controller.tick(h.now));
}

TEST_CASE("events during a morph are coalesced into the next plan", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  only<action::Checkpoint>(h.controller.preemptNotice("b", h.now));
  // While checkpointing: a new machine arrives and another notice comes in.
  CHECK(h.controller.machinesChanged({{"a", 2, 1}, {"b", 2, 2}, {"c", 2, 3}}, h.now).empty());
  CHECK(h.controller.preemptNotice("b", h.now).empty());
  auto relaunch = only<action::Launch>(h.allExit(kExitCheckpointed));
  CHECK(relaunch.plan.hosts == std::vector<std::string>{"a", "c"});
  CHECK(relaunch.plan.replicas == 2);
}

TEST_CASE("the machine list growing morphs the job wider", "[morph]") {
  Harness h({{"a", 2, 1}});
  CHECK(only<action::Launch>(h.controller.start(h.now)).plan.replicas == 1);
  only<action::Checkpoint>(h.controller.machinesChanged(twoHosts(), h.now));
  CHECK(only<action::Launch>(h.allExit(kExitCheckpointed)).plan.replicas == 2);
  // An unchanged list changes nothing.
  CHECK(h.controller.machinesChanged(twoHosts(), h.now).empty());
}

TEST_CASE("too few machines: wait for more instead of failing", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  h.controller.preemptNotice("a", h.now);
  h.controller.preemptNotice("b", h.now);
  CHECK(h.allExit(kExitCheckpointed).empty());
  CHECK(h.controller.phase() == Phase::kWaitingForMachines);
  CHECK(only<action::Launch>(h.controller.machinesChanged({{"c", 2, 1}}, h.now)).plan.hosts ==
        std::vector<std::string>{"c"});
}

TEST_CASE("without morphing the job runs once and a failure stops it", "[morph]") {
  auto options = Harness::defaults();
  options.morphing = false;
  Harness h(twoHosts(), options);
  h.controller.start(h.now);
  CHECK(h.controller.preemptNotice("b", h.now).empty());
  auto actions = h.controller.workerExited(2, 3, h.now);
  REQUIRE(actions.size() == 2);
  CHECK(std::holds_alternative<action::KillAll>(actions[0]));
  CHECK_THAT(std::get<action::Stop>(actions[1]).reason, Catch::Contains("--no_morphing"));
}

TEST_CASE("all workers finishing stops the manager with success", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  const auto stop = only<action::Stop>(h.allExit(0));
  CHECK(stop.exitCode == 0);
  CHECK(h.controller.phase() == Phase::kFinished);
  // Machines that cannot hold a pipeline at start are a configuration error.
  Harness small({{"a", 1, 1}});
  CHECK(only<action::Stop>(small.controller.start(small.now)).exitCode == kExitConfigError);
}

TEST_CASE("a machine change that leaves the plan as it is does not morph", "[morph]") {
  Harness h({{"a", 2, 1}, {"b", 2, 2}, {"c", 1, 3}});
  only<action::Launch>(h.controller.start(h.now));
  // c's single slot cannot hold a third pipeline: losing it changes nothing.
  CHECK(h.controller.machinesChanged(twoHosts(), h.now).empty());
  CHECK(h.controller.phase() == Phase::kRunning);
  // Losing b does change the plan.
  only<action::Checkpoint>(h.controller.machinesChanged({{"a", 2, 1}}, h.now));
}

TEST_CASE("a host back that the plan would only move onto does not morph; one it needs does", "[morph]") {
  // Three hosts of 2 slots, batch 16: two 2-stage replicas on a and b.
  Harness h({{"a", 2, 1}, {"b", 2, 2}, {"c", 2, 3}});
  only<action::Launch>(h.controller.start(h.now));
  only<action::KillAll>(h.controller.hostLost("b", h.now));
  h.allExit(kExitPeerLost);
  h.now += 1s;
  const auto onAC = only<action::Launch>(h.controller.tick(h.now));
  CHECK(onAC.plan.hosts == std::vector<std::string>{"a", "c"});
  // b is back: the next plan would be a and b, the same shape: stay on a and c.
  h.controller.readmitHost("b");
  CHECK(h.controller.machinesChanged({{"a", 2, 1}, {"b", 2, 2}, {"c", 2, 3}}, h.now).empty());
  CHECK(h.controller.phase() == Phase::kRunning);
  // c removed from the list: the plan must move (onto b), though its shape is the same.
  only<action::Checkpoint>(h.controller.machinesChanged({{"a", 2, 1}, {"b", 2, 2}}, h.now));
}

TEST_CASE("a stop request checkpoints, then stops with success instead of relaunching", "[morph]") {
  Harness h(twoHosts());
  only<action::Launch>(h.controller.start(h.now));
  only<action::Checkpoint>(h.controller.stop("SIGTERM", h.now));
  h.latest = 7;
  const auto stop = only<action::Stop>(h.allExit(kExitCheckpointed));
  CHECK(stop.exitCode == 0);
  CHECK(stop.reason == "SIGTERM");
  CHECK(h.controller.phase() == Phase::kFinished);
}

TEST_CASE("a second stop request kills at once", "[morph]") {
  Harness h(twoHosts());
  only<action::Launch>(h.controller.start(h.now));
  only<action::Checkpoint>(h.controller.stop("SIGTERM", h.now));
  only<action::KillAll>(h.controller.stop("SIGTERM again", h.now));
  CHECK(only<action::Stop>(h.allExit(-1)).exitCode == 0);
}

TEST_CASE("a restarted manager continues the generation numbering", "[morph]") {
  auto options = Harness::defaults();
  options.firstGeneration = 5;
  Harness h(twoHosts(), options);
  CHECK(only<action::Launch>(h.controller.start(h.now)).generation == 5);
}

TEST_CASE("a worker's configuration error stops the job instead of retrying", "[morph]") {
  Harness h(twoHosts());
  only<action::Launch>(h.controller.start(h.now));
  const auto actions = h.controller.workerExited(0, kExitConfigError, h.now);
  REQUIRE(actions.size() == 2);
  CHECK(std::holds_alternative<action::KillAll>(actions[0]));
  CHECK(std::get<action::Stop>(actions[1]).exitCode == kExitConfigError);
  CHECK(h.controller.phase() == Phase::kFailed);
}

TEST_CASE("an injected planner chooses the shape at every (re)launch", "[morph]") {
  // Stands in for AutoConfig: two stages on 4 slots or more, one below.
  std::vector<PlanRequest> asked;
  auto options = Harness::defaults();
  options.stages = 0;  // the planner decides
  options.planner = [&asked](const PlanRequest& request) {
    asked.push_back(request);
    int slots = 0;
    for (const auto& m : request.machines) slots += request.excludedHosts.count(m.host) ? 0 : m.slots;
    PlanRequest chosen = request;
    chosen.stages = slots >= 4 ? 2 : 1;
    Plan plan = makePlan(chosen);
    plan.pieceCosts = {1.0, 2.0};
    return plan;
  };
  Harness h(twoHosts(), options);
  auto launch = only<action::Launch>(h.controller.start(h.now));
  CHECK(launch.plan.stages == 2);
  CHECK(launch.plan.replicas == 2);
  CHECK(launch.plan.pieceCosts == std::vector<double>{1.0, 2.0});  // what the workers balance by
  REQUIRE(asked.size() == 1);
  CHECK(asked[0].stages == 0);
  CHECK(asked[0].globalBatch == 16);

  only<action::Checkpoint>(h.controller.preemptNotice("b", h.now));
  h.latest = 12;
  auto relaunch = only<action::Launch>(h.allExit(kExitCheckpointed));
  CHECK(relaunch.plan.stages == 1);  // a different P on fewer machines
  CHECK(relaunch.plan.replicas == 2);
  CHECK(relaunch.plan.hosts == std::vector<std::string>{"a"});
  CHECK(relaunch.resumeStep == 12);
  CHECK(asked.back().excludedHosts == std::set<std::string>{"b"});

  // b leaves the list (the plan stays as it is), then comes back: the
  // planner's wider plan morphs the job.
  CHECK(h.controller.machinesChanged({{"a", 2, 1}}, h.now).empty());
  only<action::Checkpoint>(h.controller.machinesChanged(twoHosts(), h.now));
  CHECK(only<action::Launch>(h.allExit(kExitCheckpointed)).plan.stages == 2);
  // A planner that throws ConfigError (nothing fits) makes the controller wait for machines.
  h.controller.excludeHost("a");
  only<action::Checkpoint>(h.controller.preemptNotice("b", h.now));
  CHECK(h.allExit(kExitCheckpointed).empty());
  CHECK(h.controller.phase() == Phase::kWaitingForMachines);
}

TEST_CASE("storage faults (74) and a superseded generation (76) relaunch from the latest checkpoint; code 2 stops",
          "[morph]") {
  struct Case {
    int code;
    const char* meaning;
  };
  for (const Case c : {Case{kExitStorageError, "checkpoint storage failed"}, Case{kExitSuperseded, "superseded"}}) {
    INFO("exit code " << c.code);
    Harness h(twoHosts());
    only<action::Launch>(h.controller.start(h.now));
    h.latest = 40;  // the newest complete checkpoint that still verifies
    const auto kill = only<action::KillAll>(h.controller.workerExited(1, c.code, h.now));
    CHECK_THAT(kill.reason, Catch::Contains("rank 1 exited with code " + std::to_string(c.code)) &&
                                Catch::Contains(c.meaning));
    CHECK(h.controller.phase() == Phase::kStopping);  // not kFailed: retrying can help
    CHECK(h.allExit(-1).empty());
    CHECK(h.controller.phase() == Phase::kBackoff);
    const auto relaunch = only<action::Launch>(h.controller.tick(h.now + 1s));
    CHECK(relaunch.resumeStep == 40);
    CHECK(relaunch.generation == 2);
    CHECK(relaunch.plan.replicas == 2);
  }
  // The same code during an on-demand checkpoint is a failure too, named the same way.
  Harness h(twoHosts());
  only<action::Launch>(h.controller.start(h.now));
  only<action::Checkpoint>(h.controller.preemptNotice("b", h.now));
  CHECK_THAT(only<action::KillAll>(h.controller.workerExited(0, kExitStorageError, h.now)).reason,
             Catch::Contains("checkpoint storage failed") && Catch::Contains("during the on-demand checkpoint"));
  // Code 2 still stops the job.
  Harness config(twoHosts());
  only<action::Launch>(config.controller.start(config.now));
  const auto stop = config.controller.workerExited(2, kExitConfigError, config.now);
  REQUIRE(stop.size() == 2);
  CHECK(std::get<action::Stop>(stop[1]).exitCode == kExitConfigError);
  CHECK_THAT(std::get<action::Stop>(stop[1]).reason, Catch::Contains("configuration error (code 2)"));
}

TEST_CASE("a launch that cannot be carried out backs off and retries; repeated ones stop", "[morph]") {
  Harness h(twoHosts());
  h.latest = 30;
  CHECK(only<action::Launch>(h.controller.start(h.now)).generation == 1);
  // Nothing was started: no kill, straight to the backoff.
  CHECK(h.controller.launchFailed("cannot record the generation: No space left on device", h.now).empty());
  CHECK(h.controller.phase() == Phase::kBackoff);
  CHECK(h.controller.runningRanks().empty());
  CHECK(h.controller.tick(h.now + 500ms).empty());
  auto retry = only<action::Launch>(h.controller.tick(h.now + 1s));
  CHECK(retry.generation == 2);
  CHECK(retry.resumeStep == 30);
  CHECK(h.controller.phase() == Phase::kRunning);
  CHECK(h.controller.launchFailed("again", h.now + 1s).empty());  // 2nd failure: backoff 2 s
  CHECK(h.controller.phase() == Phase::kBackoff);
  only<action::Launch>(h.controller.tick(h.now + 3s));
  const auto last = h.controller.launchFailed("still full", h.now + 3s);  // 3rd > maxFailures (2)
  REQUIRE(last.size() == 2);
  CHECK_THAT(std::get<action::Stop>(last[1]).reason, Catch::Contains("still full"));
  CHECK(std::get<action::Stop>(last[1]).exitCode == 1);
  CHECK(h.controller.launchFailed("after the end", h.now + 4s).empty());  // not running: nothing to do
}

TEST_CASE("a readmitted host is planned on again, with the same machines, only if the plan improves", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  // b preempted: the job goes on without it; its machine stays in the list.
  only<action::Checkpoint>(h.controller.preemptNotice("b", h.now));
  CHECK(only<action::Launch>(h.allExit(kExitCheckpointed)).plan.hosts == std::vector<std::string>{"a"});
  CHECK(h.controller.machinesChanged(twoHosts(), h.now).empty());  // the same machines: nothing
  // b is back (its agent answered after the deadline, or the list was written).
  h.controller.readmitHost("b");
  only<action::Checkpoint>(h.controller.machinesChanged(twoHosts(), h.now));
  CHECK(only<action::Launch>(h.allExit(kExitCheckpointed)).plan.hosts == std::vector<std::string>{"a", "b"});
  // Slow and excluded, then readmitted while still in the plan: nothing changes.
  h.controller.excludeHost("b");
  h.controller.readmitHost("b");
  CHECK(h.controller.machinesChanged(twoHosts(), h.now).empty());
  // Readmitting a host that was never out does not re-plan.
  h.controller.readmitHost("a");
  CHECK(h.controller.machinesChanged(twoHosts(), h.now).empty());
}

TEST_CASE("a lost host readmitted comes back in the next plan", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  only<action::KillAll>(h.controller.hostLost("b", h.now));
  h.allExit(-1);
  CHECK(only<action::Launch>(h.controller.tick(h.now + 1s)).plan.hosts == std::vector<std::string>{"a"});
  h.controller.readmitHost("b");
  only<action::Checkpoint>(h.controller.machinesChanged(twoHosts(), h.now + 2s));
  CHECK(only<action::Launch>(h.allExit(kExitCheckpointed)).plan.hosts == std::vector<std::string>{"a", "b"});
}

// --- an asynchronous planner (AutoConfig off the event loop) ---------------------

TEST_CASE("a planner that is still computing: the launch waits for planReady", "[morph][plan]") {
  bool ready = false;
  ControllerOptions options = Harness::defaults();
  options.planner = [&](const PlanRequest& request) {
    if (!ready) throw PlanPending();
    return makePlan(request);
  };
  Harness h(twoHosts(), options);
  CHECK(h.controller.start(h.now).empty());
  CHECK(h.controller.phase() == Phase::kPlanning);
  CHECK(std::string(toString(Phase::kPlanning)) == "planning");
  CHECK(h.controller.tick(h.now + 1s).empty());  // nothing else moves it
  ready = true;
  auto launch = only<action::Launch>(h.controller.planReady(h.now));
  CHECK(launch.plan.replicas == 2);
  CHECK(launch.generation == 1);
  CHECK(h.controller.phase() == Phase::kRunning);
  CHECK(h.controller.planReady(h.now).empty());  // nothing waits any more

  // Running: a machine change asks whether the plan changes; while that is
  // computed the job runs on, and it morphs once the answer says so.
  ready = false;
  CHECK(h.controller.machinesChanged({{"a", 2, 1}}, h.now).empty());
  CHECK(h.controller.phase() == Phase::kRunning);
  ready = true;
  only<action::Checkpoint>(h.controller.planReady(h.now));
  ready = false;
  CHECK(h.allExit(kExitCheckpointed).empty());  // the relaunch waits for its plan
  CHECK(h.controller.phase() == Phase::kPlanning);
  // A stop while planning stops at once (nothing runs).
  auto stop = h.controller.stop("operator", h.now);
  REQUIRE(stop.size() == 2);
  CHECK(std::get<action::Stop>(stop[1]).exitCode == 0);
}

TEST_CASE("a planner's answer that no plan fits stops a first launch and waits later", "[morph][plan]") {
  bool ready = false;
  ControllerOptions options = Harness::defaults();
  options.planner = [&](const PlanRequest&) -> Plan {
    if (!ready) throw PlanPending();
    throw ConfigError("no plan fits in 1 GiB");
  };
  Harness h(twoHosts(), options);
  CHECK(h.controller.start(h.now).empty());
  ready = true;
  auto actions = h.controller.planReady(h.now);
  REQUIRE(actions.size() == 1);
  CHECK(std::get<action::Stop>(actions[0]).exitCode == kExitConfigError);
}

TEST_CASE("a hang names its cause in the kill", "[morph]") {
  Harness h(twoHosts());
  h.controller.start(h.now);
  CHECK(only<action::KillAll>(h.controller.workerHung(1, h.now, "rank(s) 1 hung: no progress")).reason ==
        "rank(s) 1 hung: no progress");
  Harness silent(twoHosts());
  silent.controller.start(silent.now);
  CHECK_THAT(only<action::KillAll>(silent.controller.workerHung(1, silent.now)).reason,
             Catch::Contains("stopped sending heartbeats"));
}

TEST_CASE("morph timer: phases from the cause to the first step; events during a morph fold in", "[morph]") {
  MorphTimer timer;
  const TimePoint t0{};
  CHECK_FALSE(timer.finish(t0 + 1s));  // no morph
  timer.launched(t0 + 1s);             // no-ops without one
  timer.start("preemption of b", t0 + 10s);
  timer.start("loss of host a", t0 + 11s);  // folded in: the first cause stays
  CHECK(timer.active());
  CHECK(timer.cause() == "preemption of b");
  timer.launched(t0 + 14s);
  timer.connected(t0 + 15s);
  const auto phases = timer.finish(t0 + 20s);
  REQUIRE(phases);
  CHECK(phases->cause == "preemption of b");
  CHECK(phases->checkpointAndTeardownS == Approx(4));
  CHECK(phases->launchAndConnectS == Approx(1));
  CHECK(phases->rendezvousLoadFirstStepS == Approx(5));
  CHECK(phases->totalS == Approx(10));
  const auto json = phases->toJson();
  CHECK(json["total_s"] == Approx(10));
  CHECK(json["cause"] == "preemption of b");
  CHECK_FALSE(timer.active());
  // Never connected: those phases are 0, not negative.
  timer.start("rank 3 failed", t0 + 30s);
  timer.launched(t0 + 31s);
  const auto unconnected = timer.finish(t0 + 32s);
  REQUIRE(unconnected);
  CHECK(unconnected->launchAndConnectS == 0);
  CHECK(unconnected->rendezvousLoadFirstStepS == 0);
}
