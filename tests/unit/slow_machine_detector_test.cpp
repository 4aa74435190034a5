// Slow-machine verdicts: per stage, each replica against the stage median.
#include <catch2/catch.hpp>

#include <limits>

#include "varuna/manager/slow_machine_detector.h"

using namespace varuna;

namespace {

Plan plan2x3() {  // 2 stages x 3 replicas, ranks r*2+s on host "h<r>"
  Plan p = makePlan({{{"h0", 2, 1}, {"h1", 2, 2}, {"h2", 2, 3}}, 2, 12, 2, {}});
  REQUIRE(p.replicas == 3);
  return p;
}

proto::StepReport report(int rank, int stage, double seconds, int64_t step) {
  return proto::StepReport{rank, stage, rank / 2, step, 1.0, 1.0, seconds};
}

}  // namespace

TEST_CASE("a replica slower than its stage median by more than the threshold is flagged", "[slow]") {
  SlowMachineDetector detector(0.15, 3);
  detector.reset(plan2x3());
  std::optional<std::vector<SlowMachine>> verdict;
  int verdicts = 0;
  for (int step = 0; step < 6; ++step) {
    for (int rank = 0; rank < 6; ++rank) {
      const int stage = rank % 2;
      double seconds = stage == 0 ? 0.010 : 0.020;  // stages differ: only compared within a stage
      if (rank == 3) seconds = 0.020 * 1.3;          // host h1, stage 1: 30 % slower
      if (rank == 4) seconds = 0.010 * 1.1;          // host h2, stage 0: 10 %: within the threshold
      auto v = detector.add(report(rank, stage, seconds, step));
      if (step % 3 < 2 || rank < 5) CHECK_FALSE(v);  // the window is not complete before the last report
      if (v) {
        verdict = v;
        // One slow window is noise; the second in a row names the machine.
        CHECK(v->size() == (++verdicts == 1 ? 0u : 1u));
      }
    }
  }
  REQUIRE(verdict);
  REQUIRE(verdict->size() == 1);
  CHECK((*verdict)[0].host == "h1");
  CHECK((*verdict)[0].stage == 1);
  CHECK((*verdict)[0].ratio() == Approx(1.3));
  CHECK(formatSlowMachines(*verdict).find("h1 3 1 26.000 20.000 1.30") != std::string::npos);
}

TEST_CASE("a machine slow in one window only is not flagged", "[slow]") {
  SlowMachineDetector detector(0.15, 1);
  detector.reset(plan2x3());
  for (int step = 0; step < 4; ++step) {
    std::optional<std::vector<SlowMachine>> v;
    for (int rank = 0; rank < 6; ++rank) v = detector.add(report(rank, rank % 2, rank == 2 && step % 2 ? 0.02 : 0.01, step));
    REQUIRE(v);
    CHECK(v->empty());
  }
}

TEST_CASE("equal machines give an empty verdict; one replica per stage is never compared", "[slow]") {
  SlowMachineDetector detector(0.15, 1);
  detector.reset(plan2x3());
  std::optional<std::vector<SlowMachine>> verdict;
  for (int rank = 0; rank < 6; ++rank) verdict = detector.add(report(rank, rank % 2, 0.01, 0));
  REQUIRE(verdict);
  CHECK(verdict->empty());

  SlowMachineDetector single(0.15, 1);
  single.reset(makePlan({{{"h0", 2, 1}}, 2, 8, 2, {}}));
  single.add(report(0, 0, 0.01, 0));
  const auto v = single.add(report(1, 1, 10.0, 0));
  REQUIRE(v);
  CHECK(v->empty());
}

TEST_CASE("reports of ranks outside the plan are ignored; reset starts a new window", "[slow]") {
  SlowMachineDetector detector(0.15, 1);
  detector.reset(plan2x3());
  CHECK_FALSE(detector.add(report(17, 0, 0.01, 0)));
  for (int rank = 0; rank < 5; ++rank) detector.add(report(rank, rank % 2, 0.01, 0));
  detector.reset(plan2x3());
  CHECK_FALSE(detector.add(report(5, 1, 0.01, 0)));  // the earlier five are forgotten
}

TEST_CASE("a non-finite compute time (a relayed null) is left out of the window", "[slow]") {
  SlowMachineDetector detector(0.15, 2);
  detector.reset(plan2x3());
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::optional<std::vector<SlowMachine>> verdict;
  for (int window = 0; window < 2; ++window) {
    for (int step = window * 2; step < window * 2 + 2; ++step) {
      for (int rank = 0; rank < 6; ++rank) {
        const int stage = rank % 2;
        // Rank 3 is 30 % slower; rank 5 also sends a NaN and an infinity now and then.
        CHECK_FALSE(detector.add(report(5, 1, step % 2 ? nan : std::numeric_limits<double>::infinity(), step)));
        auto v = detector.add(report(rank, stage, rank == 3 ? 0.026 : (stage == 0 ? 0.010 : 0.020), step));
        if (v) verdict = v;
      }
    }
  }
  REQUIRE(verdict);
  REQUIRE(verdict->size() == 1);  // the NaNs neither counted as samples nor hid the slow machine
  CHECK((*verdict)[0].rank == 3);
  CHECK((*verdict)[0].stageMedianSeconds == Approx(0.020));
}
