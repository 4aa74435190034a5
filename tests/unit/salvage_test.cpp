// Salvage's decisions (docs/salvage.md): which step is written and by whom
// (chooseSalvage), and the MorphController's rounds, with a fake clock.
// Layout of the controller cases: 2 stages x 2 replicas on hosts a and b,
// clustered: a holds replica 0 (rank 0 = stage 0, rank 1 = stage 1), b
// replica 1 (rank 2 = stage 0, rank 3 = stage 1).
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "varuna/common/errors.h"
#include "varuna/manager/morph_controller.h"
#include "varuna/manager/salvage_choice.h"

using namespace varuna;
using namespace std::chrono_literals;

namespace {

struct SalvageHarness {
  std::optional<int64_t> latest = 10;
  TimePoint now{};
  MorphController controller;

  explicit SalvageHarness(std::vector<Machine> machines = {{"a", 2, 1}, {"b", 2, 2}}, ControllerOptions options = defaults())
      : controller(options, std::move(machines), [this] { return latest; }) {
    controller.start(now);
  }

  static ControllerOptions defaults() {
    ControllerOptions o;
    o.stages = 2;
    o.globalBatch = 16;
    o.chunkSize = 4;
    o.checkpointTimeout = 30s;
    o.restartBackoff = 1s;
    o.salvage = true;
    o.salvageTimeout = 20s;
    return o;
  }
};

template <typename A>
const A& find(const std::vector<Action>& actions) {
  for (const auto& a : actions) {
    if (std::holds_alternative<A>(a)) return std::get<A>(a);
  }
  FAIL("no such action among " << actions.size());
  throw std::logic_error("unreachable");
}

template <typename A>
bool has(const std::vector<Action>& actions) {
  for (const auto& a : actions) {
    if (std::holds_alternative<A>(a)) return true;
  }
  return false;
}

}  // namespace

// --- chooseSalvage --------------------------------------------------------------------------

TEST_CASE("salvage choice: the newest step every stage holds, one writer per stage", "[salvage]") {
  SECTION("all survivors agree") {
    const auto choice = chooseSalvage({{0, 0, 41, "a"}, {1, 1, 41, "a"}}, 2, {});
    REQUIRE(choice);
    CHECK(choice->step == 41);
    CHECK(choice->writers == std::vector<int>{0, 1});
  }
  SECTION("a peer died during the job-wide exchange: survivors on both sides of it") {
    // Stage 0 has survivors at 41 and 42, stage 1 only at 41: 42 is not whole.
    const auto choice = chooseSalvage({{0, 0, 42, "a"}, {2, 0, 41, "b"}, {1, 1, 41, "a"}}, 2, {});
    REQUIRE(choice);
    CHECK(choice->step == 41);
    CHECK(choice->writers == std::vector<int>{2, 1});
  }
  SECTION("every stage past the exchange: the newer step wins") {
    const auto choice = chooseSalvage({{0, 0, 42, "a"}, {2, 0, 41, "b"}, {1, 1, 42, "a"}, {3, 1, 41, "b"}}, 2, {});
    REQUIRE(choice);
    CHECK(choice->step == 42);
  }
  SECTION("no step common to every stage") {
    const std::vector<SalvageReport> reports{{0, 0, 42, "a"}, {1, 1, 41, "a"}};
    CHECK_FALSE(chooseSalvage(reports, 2, {}));
    CHECK(whyNoSalvage(reports, 2) == "no step is held by a survivor of every stage (stage 0 holds 42, stage 1 holds 41)");
  }
  SECTION("a stage without survivors, or whose survivors hold no whole step") {
    CHECK_FALSE(chooseSalvage({{1, 1, 41, "a"}, {3, 1, 41, "b"}}, 2, {}));
    CHECK(whyNoSalvage({{1, 1, 41, "a"}, {2, 0, -1, "b"}}, 2) == "no surviving replica of stage 0 holds a whole step");
  }
}

TEST_CASE("salvage choice: survivors the exchange failed under finish the step from the relayed result",
          "[salvage]") {
  const std::vector<double> result = {96.5, 0.25, 0.0};
  const auto held = [&](int rank, int stage, int64_t step, const char* host) {
    return SalvageReport{rank, stage, step, host, -1, result};
  };
  const auto finishable = [](int rank, int stage, int64_t step, const char* host) {
    return SalvageReport{rank, stage, step, host, step + 1, {}};
  };
  SECTION("stage 0 finished step 96, stage 1's exchange failed: stage 1 finishes 96") {
    const auto choice = chooseSalvage({held(0, 0, 96, "a"), finishable(1, 1, 95, "a")}, 2, {});
    REQUIRE(choice);
    CHECK(choice->step == 96);
    CHECK(choice->writers == std::vector<int>{0, 1});
    CHECK(choice->finishing == std::vector<int>{1});
    CHECK(choice->exchange == result);
  }
  SECTION("a survivor holding the step writes in preference to one that must finish it") {
    const auto choice = chooseSalvage(
        {held(0, 0, 96, "a"), held(2, 0, 96, "b"), finishable(1, 1, 95, "a"), held(3, 1, 96, "b")}, 2, {});
    REQUIRE(choice);
    CHECK(choice->step == 96);
    CHECK(choice->writers == std::vector<int>{0, 3});
    CHECK(choice->finishing.empty());
    CHECK(choice->exchange.empty());  // nobody needs it
  }
  SECTION("no survivor holds the step's exchange result: nothing to finish from") {
    const std::vector<SalvageReport> reports{{0, 0, 96, "a"}, finishable(1, 1, 95, "a")};
    CHECK_FALSE(chooseSalvage(reports, 2, {}));
    CHECK(whyNoSalvage(reports, 2) ==
          "no step is held by a survivor of every stage (stage 0 holds 96, stage 1 holds 95 and could finish 96 "
          "given its exchange result, which no survivor holds)");
  }
  SECTION("the result comes from a rank holding no whole step (it missed replica 0's buffer broadcast)") {
    // 1 stage x 2 replicas of a model with BatchNorm: replica 0's exchange of
    // step 96 failed; replica 1's completed, then the broadcast of replica
    // 0's buffers did not come. Replica 1 vouches for no step, yet holds the
    // result replica 0 needs to finish 96.
    SalvageReport noStep{1, 0, -1, "b", -1, result, 96};
    const auto choice = chooseSalvage({finishable(0, 0, 95, "a"), noStep}, 1, {});
    REQUIRE(choice);
    CHECK(choice->step == 96);
    CHECK(choice->writers == std::vector<int>{0});
    CHECK(choice->finishing == std::vector<int>{0});
    CHECK(choice->exchange == result);
    // Without that result the step before is common; a result of another step does not help.
    noStep.exchangeStep = 97;
    CHECK(chooseSalvage({finishable(0, 0, 95, "a"), noStep}, 1, {})->step == 95);
  }
  SECTION("reports that disagree on a step's result: nobody finishes from it") {
    SalvageReport other = held(2, 0, 96, "b");
    other.exchange = {96.5, 0.5, 0.0};
    const auto choice = chooseSalvage({held(0, 0, 96, "a"), other, finishable(1, 1, 95, "a")}, 2, {});
    CHECK_FALSE(choice);  // stage 1 cannot finish 96, and stage 0 holds nothing older
    // Alike bit for bit (a non-finite value as any other non-finite one): agreed.
    SalvageReport overflowA = held(0, 0, 96, "a"), overflowB = held(2, 0, 96, "b");
    overflowA.exchange = {1.0, std::numeric_limits<double>::infinity(), 0.0};
    overflowB.exchange = {1.0, std::nan(""), 0.0};
    const auto agreed = chooseSalvage({overflowA, overflowB, finishable(1, 1, 95, "a")}, 2, {});
    REQUIRE(agreed);
    CHECK(agreed->finishing == std::vector<int>{1});
  }
  SECTION("every stage only finishable: no survivor finished the exchange, the step before is common") {
    const auto choice = chooseSalvage({finishable(0, 0, 95, "a"), finishable(1, 1, 95, "a")}, 2, {});
    REQUIRE(choice);
    CHECK(choice->step == 95);
    CHECK(choice->finishing.empty());
  }
}

TEST_CASE("a split exchange: the controller's order carries the result to the finishing writer", "[salvage]") {
  SalvageHarness h;
  find<action::SalvageStop>(h.controller.hostLost("b", h.now));
  const std::vector<double> result = {12.0, 3.5, 1.0};
  CHECK(h.controller.salvageReady(SalvageReport{0, 0, 41, {}, -1, result}, h.now).empty());
  const auto write = find<action::SalvageWrite>(h.controller.salvageReady(SalvageReport{1, 1, 40, {}, 41, {}}, h.now));
  CHECK(write.step == 41);
  CHECK(write.writers == std::vector<int>{0, 1});
  CHECK(write.finishing == std::vector<int>{1});
  CHECK(write.exchange == result);
}

TEST_CASE("salvage choice: writers spread over hosts, a leaving host only when nothing else holds the step",
          "[salvage]") {
  const std::vector<SalvageReport> reports{{0, 0, 7, "a"}, {1, 1, 7, "a"}, {2, 0, 7, "b"}, {3, 1, 7, "b"}};
  CHECK(chooseSalvage(reports, 2, {})->writers == std::vector<int>{0, 3});  // a and b write in parallel
  CHECK(chooseSalvage(reports, 2, {"a"})->writers == std::vector<int>{2, 3});
  CHECK(chooseSalvage({{0, 0, 7, "a"}, {3, 1, 7, "b"}}, 2, {"a"})->writers == std::vector<int>{0, 3});
}

// --- the controller's rounds ------------------------------------------------------------------

TEST_CASE("a host lost: the survivors report, one per stage writes, the job relaunches from that step", "[salvage]") {
  SalvageHarness h;
  auto actions = h.controller.hostLost("b", h.now);
  CHECK(find<action::SalvageStop>(actions).reason == "host b was lost");
  CHECK(h.controller.phase() == Phase::kSalvaging);
  CHECK(h.controller.salvageReady(0, 0, 33, h.now).empty());
  auto write = find<action::SalvageWrite>(h.controller.salvageReady(1, 1, 33, h.now));
  CHECK(write.step == 33);
  CHECK(write.writers == std::vector<int>{0, 1});
  CHECK(h.controller.phase() == Phase::kSalvageWriting);
  CHECK(h.controller.workerExited(0, kExitSalvaged, h.now).empty());
  h.latest = 33;  // the writers completed it
  const auto launch = find<action::Launch>(h.controller.workerExited(1, kExitSalvaged, h.now));
  CHECK(launch.resumeStep == 33);  // no backoff: the job goes on at once
  CHECK(launch.plan.replicas == 1);
  CHECK(h.controller.lastLaunchSalvaged());
  CHECK(h.controller.phase() == Phase::kRunning);
}

TEST_CASE("a survivor's report may be the first sign of the loss", "[salvage]") {
  SalvageHarness h;
  const auto actions = h.controller.salvageReady(2, 0, 12, h.now);  // before the manager saw anything
  CHECK(find<action::SalvageStop>(actions).reason == "rank 2 lost a peer");
  CHECK(h.controller.workerExited(1, -1, h.now).empty());  // the lost one
  CHECK(h.controller.workerExited(0, -1, h.now).empty());
  const auto write = find<action::SalvageWrite>(h.controller.salvageReady(3, 1, 12, h.now));
  CHECK(write.writers == std::vector<int>{2, 3});
}

TEST_CASE("a stage lost with all its replicas falls back to the latest checkpoint", "[salvage]") {
  SalvageHarness h;
  h.controller.workerExited(0, -1, h.now);  // stage 0, both replicas
  h.controller.workerExited(2, -1, h.now);
  h.controller.salvageReady(1, 1, 33, h.now);
  const auto actions = h.controller.salvageReady(3, 1, 33, h.now);
  CHECK(find<action::SalvageAbandoned>(actions).reason == "no surviving replica of stage 0 holds a whole step");
  CHECK(has<action::KillAll>(actions));
  CHECK(h.controller.phase() == Phase::kStopping);
  h.controller.workerExited(1, kExitSuperseded, h.now);
  h.controller.workerExited(3, kExitSuperseded, h.now);
  CHECK(h.controller.phase() == Phase::kBackoff);
  CHECK(h.controller.tick(h.now + 1s).empty());  // two crashes counted: the backoff doubled
  const auto launch = find<action::Launch>(h.controller.tick(h.now + 2s));
  CHECK(launch.resumeStep == 10);
  CHECK_FALSE(h.controller.lastLaunchSalvaged());
}

TEST_CASE("salvage rounds are bounded: missing reports, slow writes", "[salvage]") {
  SECTION("a survivor that never reports is not waited for past the deadline") {
    SalvageHarness h({{"a", 1, 1}, {"b", 1, 2}, {"c", 1, 3}, {"d", 1, 4}});
    h.controller.hostLost("d", h.now);
    h.controller.salvageReady(0, 0, 5, h.now);
    h.controller.salvageReady(1, 1, 5, h.now);
    CHECK(h.controller.tick(h.now + 19s).empty());
    const auto write = find<action::SalvageWrite>(h.controller.tick(h.now + 20s));  // without rank 2
    CHECK(write.writers == std::vector<int>{0, 1});
    h.controller.workerExited(0, kExitSalvaged, h.now + 21s);
    CHECK(has<action::KillAll>(h.controller.workerExited(1, kExitSalvaged, h.now + 21s)));  // rank 2 goes
    CHECK(has<action::Launch>(h.controller.workerExited(2, -1, h.now + 22s)));
  }
  SECTION("without the missing report no stage is whole: abandoned") {
    SalvageHarness h;
    h.controller.hostLost("b", h.now);
    h.controller.salvageReady(0, 0, 5, h.now);
    const auto actions = h.controller.tick(h.now + 20s);
    CHECK(find<action::SalvageAbandoned>(actions).reason == "no surviving replica of stage 1 holds a whole step");
    CHECK(has<action::KillAll>(actions));
  }
  SECTION("a writer that never finishes: the write round gets the checkpoint timeout (30 s here)") {
    SalvageHarness h;
    h.controller.hostLost("b", h.now);
    h.controller.salvageReady(0, 0, 5, h.now);
    h.controller.salvageReady(1, 1, 5, h.now + 3s);
    CHECK(h.controller.tick(h.now + 32s).empty());
    const auto actions = h.controller.tick(h.now + 33s);
    CHECK(find<action::SalvageAbandoned>(actions).reason == "the salvage writes did not finish within 30 s");
  }
  SECTION("the writes done, a rank that does not leave is killed at the deadline; the salvage stands") {
    SalvageHarness h({{"a", 1, 1}, {"b", 1, 2}, {"c", 1, 3}, {"d", 1, 4}});
    h.controller.hostLost("d", h.now);
    h.controller.salvageReady(0, 0, 5, h.now);
    h.controller.salvageReady(1, 1, 5, h.now);
    h.controller.salvageReady(2, 0, 5, h.now);  // ordered out, but its exit never comes
    h.controller.workerExited(0, kExitSalvaged, h.now);
    CHECK(h.controller.workerExited(1, kExitSalvaged, h.now).empty());
    CHECK(has<action::KillAll>(h.controller.tick(h.now + 30s)));
    CHECK(has<action::Launch>(h.controller.workerExited(2, -1, h.now + 31s)));
    CHECK(h.controller.lastLaunchSalvaged());
  }
}

TEST_CASE("a writer failing or lost abandons the salvage; a non-writer lost does not", "[salvage]") {
  SECTION("a writer exits with a storage error") {
    SalvageHarness h;
    h.controller.hostLost("b", h.now);
    h.controller.salvageReady(0, 0, 5, h.now);
    h.controller.salvageReady(1, 1, 5, h.now);
    const auto actions = h.controller.workerExited(1, kExitStorageError, h.now);
    CHECK(find<action::SalvageAbandoned>(actions).reason ==
          "writer rank 1 exited with code 74 (checkpoint storage failed)");
  }
  SECTION("a writer's host is lost") {
    SalvageHarness h({{"a", 1, 1}, {"b", 1, 2}, {"c", 1, 3}, {"d", 1, 4}});
    h.controller.hostLost("d", h.now);  // rank 3
    h.controller.salvageReady(0, 0, 5, h.now);
    h.controller.salvageReady(1, 1, 5, h.now);
    const auto write = find<action::SalvageWrite>(h.controller.salvageReady(2, 0, 5, h.now));
    CHECK(write.writers == std::vector<int>{0, 1});
    const auto actions = h.controller.hostLost("b", h.now);
    CHECK(find<action::SalvageAbandoned>(actions).reason == "host b of salvage writer rank 1 was lost");
  }
  SECTION("a non-writer's host is lost") {
    SalvageHarness h({{"a", 1, 1}, {"b", 1, 2}, {"c", 1, 3}, {"d", 1, 4}});
    h.controller.hostLost("d", h.now);
    h.controller.salvageReady(0, 0, 5, h.now);
    h.controller.salvageReady(1, 1, 5, h.now);
    h.controller.salvageReady(2, 0, 5, h.now);
    CHECK(h.controller.hostLost("c", h.now).empty());
    h.controller.workerExited(0, kExitSalvaged, h.now);
    CHECK(has<action::Launch>(h.controller.workerExited(1, kExitSalvaged, h.now)));
    CHECK(h.controller.lastLaunchSalvaged());
  }
}

TEST_CASE("a notice too short for the on-demand checkpoint: the remaining machines salvage", "[salvage]") {
  SalvageHarness h;
  h.controller.preemptNotice("b", h.now, h.now + 5s);
  CHECK(h.controller.phase() == Phase::kCheckpointing);
  const auto actions = h.controller.tick(h.now + 5s);
  CHECK(find<action::SalvageStop>(actions).reason == "the on-demand checkpoint did not finish in time");
  h.controller.hostLost("b", h.now + 6s);  // taken at the deadline
  h.controller.salvageReady(0, 0, 50, h.now + 6s);
  const auto write = find<action::SalvageWrite>(h.controller.salvageReady(1, 1, 50, h.now + 6s));
  CHECK(write.writers == std::vector<int>{0, 1});
}

TEST_CASE("during a salvage other faults do not start a second round", "[salvage]") {
  SalvageHarness h;
  h.controller.hostLost("b", h.now);
  CHECK(h.controller.workerExited(2, -1, h.now).empty());  // b's, reported late
  CHECK(h.controller.preemptNotice("a", h.now).empty());
  CHECK(h.controller.machinesChanged({{"a", 2, 1}}, h.now).empty());
  CHECK(h.controller.phase() == Phase::kSalvaging);
  h.controller.salvageReady(0, 0, 5, h.now);
  CHECK(has<action::SalvageWrite>(h.controller.salvageReady(1, 1, 5, h.now)));
}

TEST_CASE("a rank that hangs during the salvage is not waited for, and is killed once the writes are done",
          "[salvage]") {
  SalvageHarness h({{"a", 1, 1}, {"b", 1, 2}, {"c", 1, 3}, {"d", 1, 4}});
  h.controller.hostLost("d", h.now);  // rank 3
  h.controller.salvageReady(0, 0, 5, h.now);
  h.controller.salvageReady(1, 1, 5, h.now);
  const auto write = find<action::SalvageWrite>(h.controller.workerHung(2, h.now + 4s));
  CHECK(write.writers == std::vector<int>{0, 1});
  CHECK(h.controller.workerExited(0, kExitSalvaged, h.now + 5s).empty());
  const auto kill = find<action::KillAll>(h.controller.workerExited(1, kExitSalvaged, h.now + 5s));
  CHECK(kill.reason == "the salvage is written; killing hung rank 2 and what is left");
  CHECK(h.controller.tick(h.now + 6s).empty());
  CHECK(has<action::Launch>(h.controller.workerExited(2, -1, h.now + 7s)));
  CHECK(h.controller.lastLaunchSalvaged());
}

TEST_CASE("a stop asked for during a salvage (or a checkpoint that becomes one) stops once it is written",
          "[salvage]") {
  SECTION("SIGTERM, then a loss during the stop's checkpoint") {
    SalvageHarness h;
    CHECK(has<action::Checkpoint>(h.controller.stop("SIGTERM", h.now)));
    CHECK(has<action::SalvageStop>(h.controller.hostLost("b", h.now)));
    h.controller.salvageReady(0, 0, 5, h.now);
    h.controller.salvageReady(1, 1, 5, h.now);
    h.controller.workerExited(0, kExitSalvaged, h.now);
    const auto stop = find<action::Stop>(h.controller.workerExited(1, kExitSalvaged, h.now));
    CHECK(stop.exitCode == 0);
    CHECK(h.controller.phase() == Phase::kFinished);
  }
  SECTION("SIGTERM during the salvage; a second one kills at once") {
    SalvageHarness h;
    h.controller.hostLost("b", h.now);
    CHECK(h.controller.stop("SIGTERM", h.now).empty());  // the salvage goes on
    h.controller.salvageReady(0, 0, 5, h.now);
    CHECK(has<action::SalvageWrite>(h.controller.salvageReady(1, 1, 5, h.now)));
    CHECK(has<action::KillAll>(h.controller.stop("SIGTERM again", h.now)));
  }
}

TEST_CASE("a crash counts towards --max_failures even when a survivor's report came first", "[salvage]") {
  auto options = SalvageHarness::defaults();
  options.maxFailures = 0;
  SalvageHarness h({{"a", 2, 1}, {"b", 2, 2}}, options);
  CHECK(has<action::SalvageStop>(h.controller.salvageReady(0, 0, 5, h.now)));  // not counted: an echo
  const auto actions = h.controller.workerExited(1, -1, h.now);  // the crash itself
  CHECK(find<action::Stop>(actions).exitCode == 1);
  CHECK(h.controller.phase() == Phase::kFailed);
}

TEST_CASE("salvage choice: a report of a stage outside the plan is ignored", "[salvage]") {
  SalvageHarness h;
  CHECK(h.controller.salvageReady(0, 7, 5, h.now).empty());
  CHECK(h.controller.phase() == Phase::kRunning);
  CHECK_FALSE(chooseSalvage({{0, 0, 5, "a"}, {1, 5, 5, "a"}}, 2, {}));
}

TEST_CASE("salvage off: a sudden loss kills and rolls back as before", "[salvage]") {
  auto options = SalvageHarness::defaults();
  options.salvage = false;
  SalvageHarness h({{"a", 2, 1}, {"b", 2, 2}}, options);
  const auto actions = h.controller.hostLost("b", h.now);
  CHECK(has<action::KillAll>(actions));
  CHECK_FALSE(has<action::SalvageStop>(actions));
  CHECK(h.controller.salvageReady(0, 0, 5, h.now).empty());
}

TEST_CASE("a loss before the generation got past its checkpoint: nothing to salvage, relaunched at once",
          "[salvage]") {
  bool progressed = false;
  auto options = SalvageHarness::defaults();
  options.generationProgressed = [&progressed] { return progressed; };
  SECTION("no rank finished a step since the resume: no salvage round, no wait for reports") {
    SalvageHarness h({{"a", 2, 1}, {"b", 2, 2}}, options);
    const auto actions = h.controller.hostLost("b", h.now);
    CHECK_FALSE(has<action::SalvageStop>(actions));
    CHECK(has<action::KillAll>(actions));
    CHECK(h.controller.phase() == Phase::kStopping);
    h.controller.workerExited(0, -1, h.now);
    h.controller.workerExited(1, -1, h.now);
    h.controller.workerExited(2, -1, h.now);
    h.controller.workerExited(3, -1, h.now);
    const auto launch = find<action::Launch>(h.controller.tick(h.now + 1s));  // the backoff, not 20 s of reports
    CHECK(launch.resumeStep == 10);
    CHECK_FALSE(h.controller.lastLaunchSalvaged());
  }
  SECTION("a survivor's report is the first sign: the same") {
    SalvageHarness h({{"a", 2, 1}, {"b", 2, 2}}, options);
    const auto actions = h.controller.salvageReady(2, 0, 10, h.now);
    CHECK_FALSE(has<action::SalvageStop>(actions));
    CHECK(has<action::KillAll>(actions));
  }
  SECTION("a step finished past it: the salvage runs as before") {
    SalvageHarness h({{"a", 2, 1}, {"b", 2, 2}}, options);
    progressed = true;
    CHECK(has<action::SalvageStop>(h.controller.hostLost("b", h.now)));
  }
}
