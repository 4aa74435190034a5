// AutoConfig on synthetic profiles: what is enumerated, what fits, what wins.
#include <catch2/catch.hpp>

#include <random>
#include <set>
#include <tuple>

#include "synthetic_profile.h"
#include "varuna/common/errors.h"
#include "varuna/manager/autoconfig.h"
#include "varuna/manager/morph_controller.h"

using namespace varuna;
using varuna::test::PieceSpec;
using varuna::test::uniformProfile;

namespace {

// 4 pieces of 1 s forward / 2 s backward / 1 s recompute per sample, 100 B
// crossing each cut and 1000 B of activations kept per sample, 1000
// parameters (16000 B of state) each; links and all-reduce measured.
profile::Profile fourPieces() {
  auto p = uniformProfile(4, {1, 2, 4, 8}, PieceSpec{1.0, 2.0, 1.0, 100, 1000, 1000});
  p.p2p = {{100, 0.01, 0.05}, {800, 0.02, 0.2}};
  p.allreduce = {{4000, 2, false, 0.01}, {4000, 2, true, 0.04}, {4000, 4, true, 0.06}};
  return p;
}

AutoConfigRequest request(std::vector<Machine> machines, int64_t globalBatch) {
  AutoConfigRequest r;
  r.machines = std::move(machines);
  r.globalBatch = globalBatch;
  return r;
}

std::vector<Machine> twoByTwo() { return {{"a", 2, 1}, {"b", 2, 2}}; }

using Shape = std::tuple<int, int, int64_t>;  // P, D, micro-batch
Shape shape(const Candidate& c) { return {c.plan.stages, c.plan.replicas, c.plan.chunkSize}; }

}  // namespace

TEST_CASE("autoconfig: enumerates every P, every D dividing the batch, every micro-batch that fits", "[autoconfig]") {
  const auto profile = fourPieces();
  auto everything = request(twoByTwo(), 16);
  everything.simulateAll = true;
  const auto result = autoConfigure(profile, everything);
  CHECK(result.slots == 4);
  CHECK(result.simulatedCount == static_cast<int>(result.ranked.size()));
  std::set<Shape> expected;
  // P <= 4 pieces, P*D <= 4 slots, D | 16 (so not 3), micro-batch <= 16 / D.
  for (auto [P, D] : {std::pair{1, 1}, {1, 2}, {1, 4}, {2, 1}, {2, 2}, {3, 1}, {4, 1}}) {
    for (int64_t m : {1, 2, 4, 8}) {
      if (m <= 16 / D) expected.insert({P, D, m});
    }
  }
  std::set<Shape> got;
  for (const auto& c : result.ranked) {
    got.insert(shape(c));
    INFO(c.shortName());
    CHECK(c.feasible);  // no memory limit
    CHECK(c.schedule == ScheduleKind::kVaruna);
    CHECK(c.plan.schedule == ScheduleKind::kVaruna);
    CHECK(c.plan.globalBatch == 16);
    // The plan carries the costs the workers balance by, which reproduce the simulated partition.
    CHECK(c.plan.pieceCosts == pieceCosts(profile, c.plan.chunkSize, c.schedule.kind));
    CHECK(partitionPieces(c.plan.pieceCosts, c.plan.stages).firstPiece == c.simulation.partition.firstPiece);
    CHECK(c.samplesPerSecond == Approx(16.0 / c.simulation.stepSeconds));
  }
  CHECK(got == expected);
  CHECK(result.ranked.size() == expected.size());
  // The fastest is chosen, and the table is in order.
  CHECK(shape(result.best) == shape(result.ranked.front()));
  for (size_t i = 1; i < result.ranked.size(); ++i) {
    CHECK(result.ranked[i - 1].samplesPerSecond >= result.ranked[i].samplesPerSecond);
  }
}

TEST_CASE("autoconfig: each candidate is simulated on the planner's placement", "[autoconfig]") {
  const auto profile = fourPieces();
  auto ask = request(twoByTwo(), 16);
  ask.fixedStages = 2;
  ask.fixedChunk = 8;  // few micro-batches: the transfers are on the critical path
  ask.simulateAll = true;
  const auto result = autoConfigure(profile, ask);
  REQUIRE(result.ranked.size() == 2);  // D = 1 or 2
  for (const auto& c : result.ranked) {
    SimulationInput in;
    in.stages = 2;
    in.replicas = c.plan.replicas;
    in.microBatch = 8;
    in.globalBatch = 16;
    in.schedule = ScheduleKind::kVaruna;
    // Clustered: replica 0 on host a, replica 1 on host b.
    in.hostOfRank = c.plan.replicas == 2 ? std::vector<std::string>{"a", "a", "b", "b"}
                                         : std::vector<std::string>{"a", "a"};
    CHECK(c.simulation.stepSeconds == Approx(simulate(profile, in).stepSeconds));
  }
  // One host per slot: every cut crosses hosts, which is slower.
  auto spread = ask;
  spread.machines = {{"a", 1, 1}, {"b", 1, 2}, {"c", 1, 3}, {"d", 1, 4}};
  const auto slow = autoConfigure(profile, spread);
  for (const auto& c : slow.ranked) {
    const auto same = std::find_if(result.ranked.begin(), result.ranked.end(),
                                   [&](const Candidate& o) { return shape(o) == shape(c); });
    REQUIRE(same != result.ranked.end());
    CHECK(c.simulation.pipelineSeconds > same->simulation.pipelineSeconds);
  }
}

TEST_CASE("autoconfig: the memory limit excludes exactly the plans over it", "[autoconfig]") {
  const auto profile = fourPieces();
  auto everything = request(twoByTwo(), 16);
  everything.simulateAll = true;
  const auto unlimited = autoConfigure(profile, everything);
  std::vector<int64_t> memory;
  for (const auto& c : unlimited.ranked) memory.push_back(c.simulation.maxStageMemoryBytes());
  std::sort(memory.begin(), memory.end());
  const int64_t limit = memory[memory.size() / 2];  // about half fit

  auto ask = everything;
  ask.memoryPerDeviceBytes = limit;
  const auto limited = autoConfigure(profile, ask);
  REQUIRE(limited.ranked.size() == unlimited.ranked.size());
  int fitting = 0;
  bool infeasibleSeen = false;
  for (const auto& c : limited.ranked) {
    INFO(c.shortName() << " needs " << c.simulation.maxStageMemoryBytes() << " of " << limit);
    CHECK(c.feasible == (c.simulation.maxStageMemoryBytes() <= limit));
    if (c.feasible) {
      ++fitting;
      CHECK_FALSE(infeasibleSeen);  // feasible ones first
      CHECK(c.infeasibleBecause.empty());
    } else {
      infeasibleSeen = true;
      CHECK_THAT(c.infeasibleBecause, Catch::Contains("needs") && Catch::Contains("devices have"));
    }
  }
  CHECK(fitting == std::count_if(memory.begin(), memory.end(), [&](int64_t m) { return m <= limit; }));
  CHECK(fitting > 0);
  CHECK(fitting < static_cast<int>(memory.size()));
  // The best is the fastest of those that fit, which may be slower than the unconstrained best.
  CHECK(limited.best.feasible);
  for (const auto& c : unlimited.ranked) {
    if (c.simulation.maxStageMemoryBytes() <= limit) {
      CHECK(limited.best.simulation.stepSeconds <= c.simulation.stepSeconds + 1e-9);
    }
  }
  CHECK(limited.best.simulation.stepSeconds >= unlimited.best.simulation.stepSeconds);
  CHECK_THAT(limited.table(100), Catch::Contains("does not fit: stage"));
}

TEST_CASE("autoconfig: ties are broken deterministically", "[autoconfig]") {
  const auto profile = fourPieces();
  SECTION("equal step times: the larger micro-batch, then the schedule listed first") {
    // One stage: no bubble and compute linear in the micro-batch, so every
    // micro-batch size and GPipe / 1F1B take exactly as long.
    auto ask = request(twoByTwo(), 16);
    ask.fixedStages = 1;
    ask.schedules = {ScheduleKind::kGPipe, ScheduleKind::k1F1B};
    auto result = autoConfigure(profile, ask);
    CHECK(result.best.plan.replicas == 4);
    CHECK(result.best.plan.chunkSize == 4);
    CHECK(result.best.schedule == ScheduleKind::kGPipe);
    CHECK(result.ranked[1].schedule == ScheduleKind::k1F1B);
    CHECK(result.ranked[1].simulation.stepSeconds == result.best.simulation.stepSeconds);
    ask.schedules = {ScheduleKind::k1F1B, ScheduleKind::kGPipe};
    CHECK(autoConfigure(profile, ask).best.schedule == ScheduleKind::k1F1B);
  }
  SECTION("equal step times: fewer workers") {
    // Free compute and communication, an optimizer step per parameter: more
    // replicas buy nothing.
    auto p = uniformProfile(2, {1, 2}, PieceSpec{0.0, 0.0, 0.0, 0, 0, 1000});
    p.optimizerSecondsPerParam = 1e-3;
    auto ask = request(twoByTwo(), 8);
    ask.fixedStages = 1;
    const auto result = autoConfigure(p, ask);
    CHECK(result.best.plan.replicas == 1);
    CHECK(result.best.plan.chunkSize == 2);
    CHECK(result.best.simulation.stepSeconds == Approx(2.0));
  }
  SECTION("the same inputs give the same ranking") {
    const auto a = autoConfigure(profile, request(twoByTwo(), 16));
    const auto b = autoConfigure(profile, request(twoByTwo(), 16));
    REQUIRE(a.ranked.size() == b.ranked.size());
    for (size_t i = 0; i < a.ranked.size(); ++i) {
      CHECK(a.ranked[i].shortName() == b.ranked[i].shortName());
      CHECK(a.ranked[i].simulation.stepSeconds == b.ranked[i].simulation.stepSeconds);
    }
  }
}

TEST_CASE("autoconfig: skipping plans by their lower bound chooses what simulating all of them chooses",
          "[autoconfig]") {
  // Pseudo-random profiles and clusters (fixed seed): unequal pieces, real
  // transfers, all-reduce and optimizer costs, sometimes a memory limit.
  std::mt19937 rng(7);
  auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  int skippedSomewhere = 0, compared = 0;
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<PieceSpec> pieces;
    const int n = 2 + trial % 6;
    for (int k = 0; k < n; ++k) {
      pieces.push_back(PieceSpec{uniform(0.1, 1.0), uniform(0.2, 2.0), uniform(0.1, 1.0),
                                 static_cast<int64_t>(uniform(10, 400)), static_cast<int64_t>(uniform(100, 2000)),
                                 static_cast<int64_t>(uniform(100, 5000))});
    }
    auto profile = varuna::test::syntheticProfile(pieces, {1, 2, 4, 8});
    profile.p2p = {{100, uniform(0.001, 0.1), uniform(0.01, 0.5)}, {4000, uniform(0.1, 0.3), uniform(0.3, 1.0)}};
    profile.allreduce = {{4000, 2, false, uniform(0.01, 0.5)}, {4000, 2, true, uniform(0.1, 2.0)}};
    profile.optimizerSecondsPerParam = uniform(0, 1e-4);
    std::vector<Machine> machines;
    for (int h = 0; h < 1 + trial % 4; ++h) machines.push_back({"h" + std::to_string(h), 1 + (trial + h) % 4, h + 1});
    auto ask = request(machines, trial % 3 == 0 ? 24 : 32);
    ask.schedules = {ScheduleKind::kVaruna, ScheduleKind::k1F1B, ScheduleKind::kGPipe};
    ask.threads = 1 + trial % 4;
    if (trial % 5 == 4) ask.memoryPerDeviceBytes = 40000 + 2000 * trial;
    auto all = ask;
    all.simulateAll = true;
    INFO("trial " << trial);
    AutoConfigResult exhaustive, pruned;
    try {
      exhaustive = autoConfigure(profile, all);
    } catch (const ConfigError&) {
      CHECK_THROWS_AS(autoConfigure(profile, ask), ConfigError);  // nothing fits either way
      continue;
    }
    pruned = autoConfigure(profile, ask);
    ++compared;
    CHECK(pruned.best.shortName() == exhaustive.best.shortName());
    CHECK(pruned.best.simulation.stepSeconds == exhaustive.best.simulation.stepSeconds);
    REQUIRE(pruned.ranked.size() == exhaustive.ranked.size());
    const double best = pruned.best.simulation.stepSeconds;
    for (const auto& c : pruned.ranked) {
      INFO(c.shortName());
      if (c.simulated) {
        CHECK(c.lowerBoundSeconds <= c.simulation.stepSeconds + 1e-12);
        CHECK(c.lowerBoundSeconds <= best + 1.001e-6);  // the plans that could have won (1 us rounding slack)
      } else {
        CHECK(c.lowerBoundSeconds > best);
        CHECK_FALSE(c.feasible);
      }
    }
    // The same every run, whatever the number of threads.
    auto oneThread = ask;
    oneThread.threads = 1;
    const auto again = autoConfigure(profile, oneThread);
    REQUIRE(again.ranked.size() == pruned.ranked.size());
    for (size_t i = 0; i < again.ranked.size(); ++i) {
      CHECK(again.ranked[i].shortName() == pruned.ranked[i].shortName());
      CHECK(again.ranked[i].simulated == pruned.ranked[i].simulated);
    }
    CHECK(pruned.simulatedCount <= exhaustive.simulatedCount);
    skippedSomewhere += pruned.simulatedCount < static_cast<int>(pruned.ranked.size());
  }
  CHECK(compared >= 30);          // most trials have a feasible plan to compare
  CHECK(skippedSomewhere >= 10);  // the bound does prune
}

TEST_CASE("autoconfig: a plan whose bound is tight never rules out itself", "[autoconfig]") {
  // One stage, one replica: the bound is the replay's own sum in another
  // order, so the two can differ in the last bits. Measured profiles (odd
  // microsecond figures) once made every plan look ruled out: "no plan fits".
  std::mt19937 rng(11);
  auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<PieceSpec> pieces;
    for (int k = 0; k < 4; ++k) {
      pieces.push_back(PieceSpec{uniform(1e-5, 3e-3), uniform(1e-5, 6e-3), uniform(1e-5, 3e-3), 2048, 4096, 5000});
    }
    auto profile = varuna::test::syntheticProfile(pieces, {1, 2, 4});
    profile.optimizerSecondsPerParam = uniform(1e-9, 1e-7);
    profile.p2p = {{2048, uniform(1e-5, 1e-4), -1}};
    profile.allreduce = {{11264, 2, false, uniform(1e-4, 5e-3)}};
    auto ask = request({{"h0", 1 + trial % 4, 1}}, 16);
    ask.schedules = {ScheduleKind::kVaruna, ScheduleKind::k1F1B, ScheduleKind::kGPipe};
    ask.threads = 1 + trial % 3;
    INFO("trial " << trial);
    const auto result = autoConfigure(profile, ask);  // throws "no plan fits" if the best ruled out itself
    CHECK(result.best.feasible);
  }
  // The profile that did it (profile_gpt on the e2e tests' tiny model): its
  // 1x1 plans' bound was 1 ns above their replay.
  const auto measured = profile::readProfile(VARUNA_TEST_DATA_DIR "/measured_tiny_gpt_profile.json");
  auto ask = request({{"127.0.0.1", 2, 1}, {"127.0.0.2", 2, 2}}, 16);
  ask.schedules = {ScheduleKind::kVaruna, ScheduleKind::k1F1B, ScheduleKind::kGPipe};
  const auto result = autoConfigure(measured, ask);
  CHECK(result.best.feasible);
  CHECK(result.best.shortName() == "1x1 m=4 gpipe");
}

TEST_CASE("autoconfig: skipped plans are listed with their bound", "[autoconfig]") {
  // Many micro-batch sizes and stages on 8 slots: deep pipelines of tiny
  // micro-batches are hopeless next to 1 x 8.
  const auto profile = uniformProfile(8, {1, 2, 4, 8}, PieceSpec{1.0, 2.0, 1.0, 100, 1000, 1000});
  const auto result = autoConfigure(profile, request({{"a", 8, 1}}, 64));
  REQUIRE(result.simulatedCount < static_cast<int>(result.ranked.size()));
  const auto& last = result.ranked.back();
  CHECK_FALSE(last.simulated);
  CHECK_THAT(result.explain(), Catch::Contains("skipped (their lower bound is slower than the chosen plan)") &&
                                   Catch::Contains("planned in"));
  CHECK_THAT(result.table(1000), Catch::Contains("skipped: slower than the chosen") && Catch::Contains(">="));
}

TEST_CASE("autoconfig: pinned stages or micro-batch, several schedules, excluded hosts", "[autoconfig]") {
  const auto profile = fourPieces();
  auto ask = request(twoByTwo(), 16);
  ask.fixedStages = 2;
  for (const auto& c : autoConfigure(profile, ask).ranked) CHECK(c.plan.stages == 2);
  ask = request(twoByTwo(), 16);
  ask.fixedChunk = 2;
  for (const auto& c : autoConfigure(profile, ask).ranked) CHECK(c.plan.chunkSize == 2);
  ask = request(twoByTwo(), 16);
  ask.microBatchSizes = {1, 4};
  for (const auto& c : autoConfigure(profile, ask).ranked) CHECK((c.plan.chunkSize == 1 || c.plan.chunkSize == 4));
  ask = request(twoByTwo(), 16);
  ask.schedules = {ScheduleKind::kVaruna, ScheduleKind::k1F1B, ScheduleKind::kGPipe};
  CHECK(autoConfigure(profile, ask).ranked.size() == 3 * 27);
  ask = request(twoByTwo(), 16);
  ask.excludedHosts = {"b"};
  const auto half = autoConfigure(profile, ask);
  CHECK(half.slots == 2);
  for (const auto& c : half.ranked) CHECK(c.plan.hosts == std::vector<std::string>{"a"});
}

TEST_CASE("autoconfig: no feasible plan is a ConfigError that says why", "[autoconfig]") {
  const auto profile = fourPieces();
  auto ask = request(twoByTwo(), 16);
  ask.excludedHosts = {"a", "b"};
  CHECK_THROWS_WITH(autoConfigure(profile, ask), Catch::Contains("no worker slots"));
  ask = request(twoByTwo(), 16);
  ask.fixedStages = 5;
  CHECK_THROWS_WITH(autoConfigure(profile, ask), Catch::Contains("exceeds the model's 4 pieces"));
  ask = request({{"a", 2, 1}}, 16);
  ask.fixedStages = 3;
  CHECK_THROWS_WITH(autoConfigure(profile, ask), Catch::Contains("needs 3 worker slots, 2 are available"));
  ask = request(twoByTwo(), 16);
  ask.fixedChunk = 3;
  CHECK_THROWS_WITH(autoConfigure(profile, ask),
                    Catch::Contains("micro-batch size 3 was not profiled") && Catch::Contains("1, 2, 4, 8"));
  ask = request(twoByTwo(), 16);
  ask.memoryPerDeviceBytes = 1000;
  CHECK_THROWS_WITH(autoConfigure(profile, ask), Catch::Contains("no plan fits in 1000 B per device") &&
                                                     Catch::Contains("the smallest is") &&
                                                     Catch::Contains("add machines"));
  const auto large = uniformProfile(2, {4, 8});
  CHECK_THROWS_WITH(autoConfigure(large, request(twoByTwo(), 2)),
                    Catch::Contains("exceeds the per-replica batch") && Catch::Contains("global batch 2"));
  CHECK_THROWS_AS(autoConfigure(profile, request(twoByTwo(), 0)), ConfigError);
  CHECK_THROWS_WITH(autoConfigure(profile::Profile{}, request(twoByTwo(), 16)), Catch::Contains("no pieces"));
}

TEST_CASE("autoconfig: explain() and table() say what was chosen and why", "[autoconfig]") {
  const auto result = autoConfigure(fourPieces(), request(twoByTwo(), 16));
  const std::string why = result.explain();
  CHECK_THAT(why, Catch::Contains("AutoConfig chose " + std::to_string(result.best.plan.stages) + " stage(s) x ") &&
                      Catch::Contains("samples/s") && Catch::Contains("The next best") &&
                      Catch::Contains("27 plan(s) considered"));
  const std::string table = result.table(5);
  CHECK_THAT(table, Catch::StartsWith("#   stages") && Catch::Contains("chosen") && Catch::Contains("... 22 more"));
}

TEST_CASE("autoconfig: as the MorphController's planner it re-plans P when machines go", "[autoconfig][morph]") {
  // Six equal pieces whose state (16000 B each) allows at most three per
  // device: one stage never fits. On 4 slots two stages x two replicas wins;
  // on 3 slots, with one replica only, three shorter stages beat two.
  const auto profile = uniformProfile(6, {1, 2}, PieceSpec{1.0, 2.0, 1.0, 100, 100, 1000});
  AutoConfigRequest settings;
  settings.memoryPerDeviceBytes = 60000;
  std::vector<std::string> explanations;
  ControllerOptions options;
  options.stages = 0;  // AutoConfig chooses
  options.chunkSize = 0;
  options.globalBatch = 16;
  options.restartBackoff = std::chrono::milliseconds(0);
  options.planner = autoConfigPlanner(profile, settings,
                                      [&](const AutoConfigResult& r) { explanations.push_back(r.explain()); });
  const std::vector<Machine> machines = {{"a", 1, 1}, {"b", 1, 2}, {"c", 1, 3}, {"d", 1, 4}};
  std::optional<int64_t> latest;
  MorphController controller(options, machines, [&] { return latest; });
  TimePoint now{};

  auto actions = controller.start(now);
  REQUIRE(actions.size() == 1);
  const Plan first = std::get<action::Launch>(actions[0]).plan;
  auto expected = request(machines, 16);
  expected.memoryPerDeviceBytes = 60000;
  CHECK(first.describe() == autoConfigure(profile, expected).best.plan.describe());
  CHECK(first.stages == 2);
  CHECK(first.replicas == 2);
  CHECK_FALSE(first.pieceCosts.empty());
  REQUIRE(explanations.size() == 1);

  REQUIRE(controller.preemptNotice("d", now).size() == 1);  // checkpoint
  latest = 10;
  for (int r : std::set<int>(controller.runningRanks())) actions = controller.workerExited(r, kExitCheckpointed, now);
  REQUIRE(actions.size() == 1);
  const auto& relaunch = std::get<action::Launch>(actions[0]);
  CHECK(relaunch.plan.stages == 3);
  CHECK(relaunch.plan.replicas == 1);
  CHECK(relaunch.plan.hosts == std::vector<std::string>{"a", "b", "c"});
  CHECK(relaunch.resumeStep == 10);
  CHECK(explanations.size() >= 2);
}

TEST_CASE("autoconfig: zb-h1 wins where its smaller bubble pays and it fits; 1F1B where only 1F1B's memory fits",
          "[autoconfig]") {
  const auto profile = fourPieces();
  auto ask = request({{"a", 2, 1}}, 8);
  ask.fixedStages = 2;
  ask.fixedChunk = 1;  // 8 micro-batches on 2 stages
  ask.schedules = {ScheduleKind::k1F1B, ScheduleKind::kZeroBubbleH1};
  ask.simulateAll = true;
  const auto free = autoConfigure(profile, ask);
  REQUIRE(free.ranked.size() == 2);
  CHECK(free.best.plan.schedule == ScheduleKind::kZeroBubbleH1);
  const Candidate& oneFOneB = free.ranked[1];
  REQUIRE(oneFOneB.plan.schedule == ScheduleKind::k1F1B);
  CHECK(free.best.simulation.stepSeconds < oneFOneB.simulation.stepSeconds);
  // One micro-batch more in flight per stage, held until its W: more memory.
  CHECK(free.best.simulation.maxStageMemoryBytes() > oneFOneB.simulation.maxStageMemoryBytes());

  ask.memoryPerDeviceBytes = oneFOneB.simulation.maxStageMemoryBytes();
  const auto tight = autoConfigure(profile, ask);
  CHECK(tight.best.plan.schedule == ScheduleKind::k1F1B);
  CHECK(tight.best.feasible);
  CHECK_FALSE(tight.ranked.back().feasible);
  CHECK(tight.ranked.back().plan.schedule == ScheduleKind::kZeroBubbleH1);
}

TEST_CASE("autoconfig: chooses the chunked schedule and its chunks where the bubble pays, only where they fit",
          "[autoconfig]") {
  const auto profile = fourPieces();
  auto ask = request({{"a", 2, 1}}, 8);
  ask.fixedStages = 2;
  ask.fixedChunk = 1;  // 8 micro-batches on 2 stages
  ask.schedules = {ScheduleKind::k1F1B, ScheduleKind::kZeroBubbleH1, ScheduleKind::kInterleaved1F1B,
                   ScheduleChoice{ScheduleKind::kInterleaved1F1B, 4}, ScheduleKind::kZeroBubbleV};
  ask.simulateAll = true;
  const auto result = autoConfigure(profile, ask);
  // interleaved:4 on 2 stages needs 8 pieces; the model has 4: never planned.
  REQUIRE(result.ranked.size() == 4);
  for (const auto& c : result.ranked) CHECK(c.plan.schedule != ScheduleChoice{ScheduleKind::kInterleaved1F1B, 4});
  CHECK(result.best.plan.schedule == ScheduleKind::kZeroBubbleV);
  CHECK(result.best.simulation.layout.vShape);
  auto stepOf = [&](ScheduleKind kind) {
    for (const auto& c : result.ranked) {
      if (c.plan.schedule == kind) return c.simulation.stepSeconds;
    }
    FAIL("no candidate for " << toString(kind));
    return 0.0;
  };
  CHECK(stepOf(ScheduleKind::kInterleaved1F1B) < stepOf(ScheduleKind::k1F1B));
  CHECK(stepOf(ScheduleKind::kZeroBubbleV) < stepOf(ScheduleKind::kZeroBubbleH1));
  CHECK_THAT(result.best.shortName(), Catch::Contains("zbv"));

  // 7 micro-batches do not split into groups of 2 stages: no interleaved plan.
  auto odd = request({{"a", 2, 1}}, 7);
  odd.fixedStages = 2;
  odd.fixedChunk = 1;
  odd.schedules = {ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B};
  odd.simulateAll = true;
  const auto oddResult = autoConfigure(profile, odd);
  REQUIRE(oddResult.ranked.size() == 1);
  CHECK(oddResult.best.plan.schedule == ScheduleKind::k1F1B);
  // Nothing but schedules that cannot run: the error says why.
  odd.schedules = {ScheduleKind::kInterleaved1F1B};
  CHECK_THROWS_WITH(autoConfigure(profile, odd),
                    Catch::Contains("no schedule listed in --schedules fits") &&
                        Catch::Contains("needs a multiple of 2 micro-batches per replica, not 7"));
  auto few = request({{"a", 4, 1}}, 8);
  few.fixedStages = 4;
  few.schedules = {ScheduleKind::kZeroBubbleV};
  CHECK_THROWS_WITH(autoConfigure(profile, few), Catch::Contains("zbv on 4 stages needs 8 pieces, the model has 4"));
}
