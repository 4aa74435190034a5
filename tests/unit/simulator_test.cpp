// The simulator against hand-worked cases, and the profile file format.
#include <catch2/catch.hpp>

#include <fstream>
#include <nlohmann/json.hpp>

#include "synthetic_profile.h"
#include "test_env.h"
#include "varuna/common/errors.h"
#include "varuna/common/simulator.h"

using namespace varuna;
using varuna::test::PieceSpec;
using varuna::test::syntheticProfile;
using varuna::test::uniformProfile;

namespace {

SimulationInput input(int P, int D, int64_t m, int64_t G, ScheduleKind kind) {
  SimulationInput in;
  in.stages = P;
  in.replicas = D;
  in.microBatch = m;
  in.globalBatch = G;
  in.schedule = kind;
  return in;
}

int countType(const StageSchedule& s, TaskType type) {
  int n = 0;
  for (const Task& t : s) n += t.type == type;
  return n;
}

const ScheduleKind kAllKinds[] = {ScheduleKind::kVaruna, ScheduleKind::k1F1B, ScheduleKind::kGPipe,
                                   ScheduleKind::kZeroBubbleH1};

}  // namespace

TEST_CASE("simulator: one stage is the sum of its tasks plus the optimizer", "[simulator]") {
  // Two pieces, each 0.5 s forward / 1 s backward per sample: at micro-batch 2
  // the stage takes 2 s forward and 4 s backward; 8 samples = 4 micro-batches.
  auto profile = uniformProfile(2, {1, 2}, PieceSpec{0.5, 1.0, 0.5, 0, 0, 100});
  profile.optimizerSecondsPerParam = 0.001;  // 200 parameters: 0.2 s
  for (auto kind : kAllKinds) {
    INFO(toString(kind));
    const Simulation sim = simulate(profile, input(1, 1, 2, 8, kind));
    CHECK(sim.microbatches == 4);
    CHECK(sim.pipelineSeconds == Approx(24.0));
    CHECK(sim.allreduceSeconds == Approx(0.0));  // one rank: nothing to reduce
    CHECK(sim.optimizerSeconds == Approx(0.2));
    CHECK(sim.stepSeconds == Approx(24.2));
    CHECK(sim.bubbleFraction == Approx(0.0).margin(1e-12));
    CHECK(sim.stageComputeSeconds == std::vector<double>{24.0});
    CHECK(sim.partition.firstPiece == std::vector<int>{0, 2});
  }
}

TEST_CASE("simulator: GPipe and 1F1B with zero transfer have the textbook bubble (p-1)/(m+p-1)", "[simulator]") {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int P : {2, 4}) {
      // P pieces of 1 s forward, 2 s backward: one piece per stage.
      const auto profile = uniformProfile(P, {1}, PieceSpec{1.0, 2.0, 1.0, 0, 0, 0});
      for (int m : {1, 4, 8}) {
        INFO(toString(kind) << " P=" << P << " m=" << m);
        const Simulation sim = simulate(profile, input(P, 1, 1, m, kind));
        CHECK(sim.microbatches == m);
        CHECK(sim.pipelineSeconds == Approx((m + P - 1) * 3.0));
        CHECK(sim.bubbleFraction == Approx(double(P - 1) / (m + P - 1)));
        CHECK(sim.stepSeconds == Approx(sim.pipelineSeconds));
      }
    }
  }
}

TEST_CASE("simulator: Varuna's recompute costs time exactly on the stages other than the last", "[simulator]") {
  // Recompute (0.5 s) differs from the forward (1 s) so the figure used shows.
  const int P = 3, m = 6;
  const auto profile = uniformProfile(P, {1}, PieceSpec{1.0, 2.0, 0.5, 0, 0, 0});
  const Simulation varuna = simulate(profile, input(P, 1, 1, m, ScheduleKind::kVaruna));
  const Simulation gpipe = simulate(profile, input(P, 1, 1, m, ScheduleKind::kGPipe));
  const auto schedule = generateSchedule(ScheduleKind::kVaruna, P, m);
  for (int s = 0; s < P; ++s) {
    INFO("stage " << s);
    const int recomputes = countType(schedule[s], TaskType::kRecompute);
    CHECK(varuna.stageComputeSeconds[s] == Approx(m * 3.0 + recomputes * 0.5));
    CHECK(gpipe.stageComputeSeconds[s] == Approx(m * 3.0));
    // With several micro-batches every one is recomputed on a non-last stage.
    CHECK(recomputes == (s == P - 1 ? 0 : m));
  }
  // One micro-batch: the forward keeps its activations, nothing to recompute.
  const Simulation single = simulate(profile, input(P, 1, 1, 1, ScheduleKind::kVaruna));
  for (double busy : single.stageComputeSeconds) CHECK(busy == Approx(3.0));
}

TEST_CASE("simulator: the partition balances forward + backward (+ recompute for Varuna)", "[simulator]") {
  // Pieces cost 1, 1, 1 (forward + backward); the last also recomputes for 3 s.
  const auto profile = syntheticProfile({PieceSpec{0.5, 0.5, 0, 0, 0, 0}, PieceSpec{0.5, 0.5, 0, 0, 0, 0},
                                         PieceSpec{0.5, 0.5, 3.0, 0, 0, 0}},
                                        {1});
  CHECK(pieceCosts(profile, 1, ScheduleKind::k1F1B) == std::vector<double>{1.0, 1.0, 1.0});
  CHECK(pieceCosts(profile, 1, ScheduleKind::kVaruna) == std::vector<double>{1.0, 1.0, 4.0});
  // 1F1B: a tie, the earliest cut wins; Varuna: the costly piece stands alone.
  CHECK(simulate(profile, input(2, 1, 1, 4, ScheduleKind::k1F1B)).partition.firstPiece == std::vector<int>{0, 1, 3});
  CHECK(simulate(profile, input(2, 1, 1, 4, ScheduleKind::kVaruna)).partition.firstPiece ==
        std::vector<int>{0, 2, 3});
  // A given partition is used as is.
  auto in = input(2, 1, 1, 4, ScheduleKind::kGPipe);
  in.firstPiece = {0, 2, 3};
  const Simulation given = simulate(profile, in);
  CHECK(given.partition.firstPiece == std::vector<int>{0, 2, 3});
  CHECK(given.stageComputeSeconds[0] == Approx(4 * 2.0));
  CHECK(given.stageComputeSeconds[1] == Approx(4 * 1.0));
}

TEST_CASE("simulator: transfers take the p2p time of the link the placement implies", "[simulator]") {
  // 1000 bytes cross the cut per micro-batch: 0.5 s on one host, 1 s across hosts.
  auto profile = uniformProfile(2, {1}, PieceSpec{1.0, 2.0, 1.0, 1000, 0, 0});
  profile.p2p = {{1000, 0.5, 1.0}};
  auto in = input(2, 1, 1, 1, ScheduleKind::kGPipe);
  // f (1) + activation + f (1) + b (2) + gradient + b (2).
  in.hostOfRank = {"a", "a"};
  CHECK(simulate(profile, in).pipelineSeconds == Approx(6.0 + 2 * 0.5));
  in.hostOfRank = {"a", "b"};
  CHECK(simulate(profile, in).pipelineSeconds == Approx(6.0 + 2 * 1.0));
  CHECK(simulate(profile, input(2, 1, 1, 1, ScheduleKind::kGPipe)).pipelineSeconds == Approx(7.0));  // one host
  // Two replicas, one split across hosts: the step waits for the slower one.
  auto two = input(2, 2, 1, 2, ScheduleKind::kGPipe);
  two.hostOfRank = {"a", "a", "b", "c"};
  CHECK(simulate(profile, two).pipelineSeconds == Approx(8.0));
}

TEST_CASE("simulator: gradient all-reduce overlaps the last backward, bucket by bucket", "[simulator]") {
  // Two pieces, 1000 gradient bytes each (250 fp32 parameters), one 1000-byte
  // bucket each. Forward 1 s, backward 2 s per piece: the last backward starts
  // at 2 s, piece 1 is final at 4 s, piece 0 at 6 s.
  auto profile = uniformProfile(2, {1}, PieceSpec{1.0, 2.0, 1.0, 0, 0, 250});
  profile.allreduce = {{1000, 2, false, 0.5}};
  auto in = input(1, 2, 1, 2, ScheduleKind::kVaruna);
  in.bucketBytes = 1000;
  const double stats = 0.5 * 24 / 1000;  // the job-wide 3-double all-reduce, same link

  SECTION("a fast all-reduce hides behind the backward except for the last bucket") {
    const Simulation sim = simulate(profile, in);
    CHECK(sim.pipelineSeconds == Approx(6.0));
    // Bucket of piece 1: 4.0-4.5 (hidden); bucket of piece 0: 6.0-6.5 (exposed).
    REQUIRE(sim.stageExposedAllreduceSeconds.size() == 1);
    CHECK(sim.stageExposedAllreduceSeconds[0] == Approx(0.5));
    CHECK(sim.allreduceSeconds == Approx(0.5 + stats));
    CHECK(sim.stepSeconds == Approx(6.5 + stats));
  }
  SECTION("only the last backward's buckets are reduced: more micro-batches, the same exposure") {
    in.globalBatch = 6;  // 3 micro-batches per replica
    const Simulation sim = simulate(profile, in);
    CHECK(sim.pipelineSeconds == Approx(18.0));
    CHECK(sim.allreduceSeconds == Approx(0.5 + stats));
  }
  SECTION("a slow all-reduce queues: buckets reduce one after another") {
    profile.allreduce = {{1000, 2, false, 3.0}};
    const Simulation sim = simulate(profile, in);
    // Piece 1's bucket 4-7, piece 0's 7-10 (ready at 6, waits for the first).
    CHECK(sim.allreduceSeconds == Approx(4.0 + 3.0 * 24 / 1000));
  }
  SECTION("replicas on different hosts use the cross-host figures") {
    profile.allreduce.push_back({1000, 2, true, 1.0});
    in.hostOfRank = {"a", "b"};
    const Simulation sim = simulate(profile, in);
    CHECK(sim.allreduceSeconds == Approx(1.0 + 1.0 * 24 / 1000));
  }
  SECTION("one large bucket cannot start before the whole stage's backward") {
    in.bucketBytes = 4 << 20;  // both pieces in one 2000-byte bucket, ready at 6 s
    CHECK(simulate(profile, in).allreduceSeconds == Approx(1.0 + stats));
  }
  SECTION("one replica reduces nothing") {
    const Simulation sim = simulate(profile, input(1, 1, 1, 2, ScheduleKind::kVaruna));
    CHECK(sim.allreduceSeconds == 0.0);
    CHECK(sim.stepSeconds == Approx(12.0));
  }
}

TEST_CASE("simulator: live activations per schedule, as the generator orders the tasks", "[simulator]") {
  const auto profile4 = uniformProfile(4, {1}, PieceSpec{1.0, 2.0, 1.0, 10, 100, 0});
  // GPipe keeps every micro-batch until the backwards.
  CHECK(simulate(profile4, input(4, 1, 1, 6, ScheduleKind::kGPipe)).stagePeakLiveMicrobatches ==
        std::vector<int>{6, 6, 6, 6});
  // 1F1B: stage s keeps at most P - s.
  CHECK(simulate(profile4, input(4, 1, 1, 8, ScheduleKind::k1F1B)).stagePeakLiveMicrobatches ==
        std::vector<int>{4, 3, 2, 1});
  // ZB-H1: P - s + 1, held until each micro-batch's W.
  CHECK(simulate(profile4, input(4, 1, 1, 8, ScheduleKind::kZeroBubbleH1)).stagePeakLiveMicrobatches ==
        std::vector<int>{5, 4, 3, 2});
  // Varuna: at most one per stage (the others keep only their input).
  for (int m : {1, 2, 8, 13}) {
    INFO("m=" << m);
    CHECK(simulate(profile4, input(4, 1, 1, m, ScheduleKind::kVaruna)).stagePeakLiveMicrobatches ==
          std::vector<int>{1, 1, 1, 1});
  }
}

TEST_CASE("simulator: stage memory is state + live activations + boundary buffers", "[simulator]") {
  // Piece 0: 10 parameters, keeps 100 B, sends 10 B per sample; piece 1: 20
  // parameters, keeps 300 B. State: 4 (weights) + 4 (gradients) + 8 (Adam) B
  // per parameter.
  const auto profile =
      syntheticProfile({PieceSpec{1.0, 2.0, 1.0, 10, 100, 10}, PieceSpec{1.0, 2.0, 1.0, 0, 300, 20}}, {1});
  SECTION("one stage: every GPipe micro-batch's activations") {
    CHECK(simulate(profile, input(1, 1, 1, 2, ScheduleKind::kGPipe)).stageMemoryBytes ==
          std::vector<int64_t>{30 * 16 + 2 * 400});
  }
  SECTION("GPipe, two stages, two micro-batches") {
    const Simulation sim = simulate(profile, input(2, 1, 1, 2, ScheduleKind::kGPipe));
    // Stage 0: two forwards each keep 100 B and hold the sent activation and
    // the gradient buffer (2 x 10 B).
    // Stage 1: both activation receives (2 x 10 B) are posted at the start;
    // peak at the first backward: 2 x 300 B live + its sent gradient (10 B).
    CHECK(sim.stageMemoryBytes == std::vector<int64_t>{160 + 4 * 10 + 2 * 100, 320 + 3 * 10 + 2 * 300});
  }
  SECTION("Varuna, two stages, two micro-batches: one micro-batch of activations") {
    const Simulation sim = simulate(profile, input(2, 1, 1, 2, ScheduleKind::kVaruna));
    // Stage 0: f0 f1 r0 b0 r1 b1: 4 x 10 B of boundary tensors + 100 B live.
    // Stage 1: f0 b0 f1 b1: 20 B received up front, 2 x 10 B of sent
    // gradients (held to the step's end), 300 B live.
    CHECK(sim.stageMemoryBytes == std::vector<int64_t>{160 + 40 + 100, 320 + 40 + 300});
  }
}

TEST_CASE("simulator: a smaller last micro-batch costs its own size", "[simulator]") {
  const auto profile = uniformProfile(1, {1, 2}, PieceSpec{1.0, 2.0, 1.0, 0, 0, 0});
  // 5 samples in micro-batches of 2: 2, 2, 1.
  const Simulation sim = simulate(profile, input(1, 1, 2, 5, ScheduleKind::kGPipe));
  CHECK(sim.microbatches == 3);
  CHECK(sim.pipelineSeconds == Approx(6 + 6 + 3));
  // Not profiled at 3: linear between the profiled 2 and 4.
  const auto sparse = uniformProfile(1, {2, 4}, PieceSpec{1.0, 2.0, 1.0, 0, 0, 0});
  CHECK(simulate(sparse, input(1, 1, 4, 7, ScheduleKind::kGPipe)).pipelineSeconds == Approx(12 + 9));
}

TEST_CASE("simulator: impossible inputs are refused with what is wrong", "[simulator]") {
  const auto profile = uniformProfile(2, {1, 2});
  CHECK_THROWS_WITH(simulate(profile, input(1, 1, 3, 6, ScheduleKind::kVaruna)),
                    Catch::Contains("no figures for micro-batch size 3") &&
                        Catch::Contains("profiled for every piece: 1, 2"));
  CHECK_THROWS_WITH(simulate(profile, input(3, 1, 1, 6, ScheduleKind::kVaruna)),
                    Catch::Contains("the profiled model has 2 pieces"));
  CHECK_THROWS_WITH(simulate(profile, input(1, 2, 1, 5, ScheduleKind::kVaruna)),
                    Catch::Contains("does not split evenly into 2 replicas"));
  CHECK_THROWS_WITH(simulate(profile, input(1, 4, 2, 4, ScheduleKind::kVaruna)),
                    Catch::Contains("micro-batch 2 exceeds the per-replica batch 1"));
  auto badHosts = input(2, 2, 1, 4, ScheduleKind::kVaruna);
  badHosts.hostOfRank = {"a", "b"};
  CHECK_THROWS_WITH(simulate(profile, badHosts), Catch::Contains("need 4"));
  auto badPartition = input(2, 1, 1, 4, ScheduleKind::kVaruna);
  badPartition.firstPiece = {0, 0, 2};
  CHECK_THROWS_WITH(simulate(profile, badPartition), Catch::Contains("is not a split of 2 pieces into 2 stages"));
  CHECK_THROWS_WITH(simulate(profile::Profile{}, input(1, 1, 1, 1, ScheduleKind::kVaruna)),
                    Catch::Contains("no pieces"));
  CHECK_THROWS_AS(simulate(profile, input(0, 1, 1, 1, ScheduleKind::kVaruna)), ConfigError);
}

TEST_CASE("simulator: stepLowerBound never exceeds the simulated step, and is exact for one stage", "[simulator]") {
  // Unequal pieces, real transfers and all-reduce, an optimizer: the bound
  // must stay below the replay for every plan shape and schedule.
  std::vector<PieceSpec> pieces;
  for (int k = 0; k < 5; ++k) pieces.push_back(PieceSpec{0.5 + 0.3 * k, 1.0 + 0.1 * k, 0.4, 64, 500, 1000 + 700 * k});
  auto profile = syntheticProfile(pieces, {1, 2, 4});
  profile.p2p = {{64, 0.05, 0.2}, {256, 0.1, 0.5}};
  profile.allreduce = {{4000, 2, false, 0.3}, {4000, 2, true, 0.9}};
  profile.optimizerSecondsPerParam = 1e-4;
  int strictlyBelow = 0;  // the bound is not the simulation itself: bubbles, transfers, recompute are left out
  for (int P = 1; P <= 5; ++P) {
    for (int D : {1, 2}) {
      for (int64_t m : {1, 2, 4}) {
        for (int64_t G : {8, 12}) {
          for (ScheduleKind kind : kAllKinds) {
            auto in = input(P, D, m, G, kind);
            in.bucketBytes = 3000;
            for (int r = 0; r < P * D; ++r) in.hostOfRank.push_back(r % 3 == 0 ? "a" : "b");
            INFO("P " << P << " D " << D << " m " << m << " G " << G << " " << toString(kind));
            const double bound = stepLowerBound(profile, in);
            CHECK(bound > 0);
            const double step = simulate(profile, in).stepSeconds;
            CHECK(bound <= step + 1e-12);
            if (P > 1) strictlyBelow += bound < step - 1e-9;
          }
        }
      }
    }
  }
  CHECK(strictlyBelow == 4 * 2 * 3 * 2 * 4);  // every multi-stage plan has a bubble, each of the 4 schedules
  // One stage, one replica, no recompute: no bubble, nothing to overlap: exact.
  const auto one = input(1, 1, 2, 8, ScheduleKind::k1F1B);
  CHECK(stepLowerBound(profile, one) == Approx(simulate(profile, one).stepSeconds).epsilon(1e-12));
  CHECK_THROWS_WITH(stepLowerBound(profile, input(6, 1, 1, 8, ScheduleKind::kVaruna)),
                    Catch::Contains("the profiled model has 5 pieces"));
}

TEST_CASE("simulator: describe() sums up the step", "[simulator]") {
  const auto profile = uniformProfile(2, {1}, PieceSpec{1.0, 2.0, 1.0, 10, 100, 10});
  const std::string text = simulate(profile, input(2, 1, 1, 4, ScheduleKind::k1F1B)).describe();
  CHECK_THAT(text, Catch::Contains("step 15.0000 s = pipeline 15.0000") && Catch::Contains("bubble 20.0%") &&
                       Catch::Contains("stage 1: pieces 1-1"));
  CHECK(formatBytes(512) == "512 B");
  CHECK(formatBytes(3 << 20) == "3.00 MiB");
  CHECK(formatBytes(int64_t{12} << 30) == "12.0 GiB");
}

// --- the profile file ---

namespace {

profile::Profile richProfile() {
  auto p = syntheticProfile({PieceSpec{0.25, 0.5, 0.25, 64, 512, 1000}, PieceSpec{0.125, 0.375, 0.125, 0, 256, 10}},
                            {1, 2, 8});
  p.pieces[0].bySize.at(2).peakBytes = 4096;
  p.pieces[1].bySize.at(8).forward.spread = 0.0625;
  p.device = "cuda";
  p.precision = "fp16";
  p.optimizerSecondsPerParam = 1.5e-9;
  p.p2p = {{1024, 1e-5, 3e-5}, {1 << 20, 2e-4, -1}};
  p.allreduce = {{1 << 20, 2, false, 1e-3}, {1 << 20, 4, true, 5e-3}};
  return p;
}

void writeText(const std::filesystem::path& path, const std::string& text) { std::ofstream(path) << text; }

}  // namespace

TEST_CASE("simulator: a profile survives the JSON and file round trips", "[simulator][profile]") {
  const auto p = richProfile();
  CHECK(profile::fromJson(profile::toJson(p), "memory") == p);
  const auto dir = varuna::test::scratchDir("profile_round_trip");
  const std::string path = (dir / "sub" / "profile.json").string();
  profile::writeProfile(p, path);
  CHECK(profile::readProfile(path) == p);
  CHECK(profile::readProfile(path, p.modelFingerprint) == p);
  CHECK(p.microBatchSizes() == std::vector<int64_t>{1, 2, 8});
}

TEST_CASE("simulator: malformed, foreign, old and stale profiles are refused with what to do",
          "[simulator][profile]") {
  const auto dir = varuna::test::scratchDir("profile_refused");
  const auto good = profile::toJson(richProfile());
  auto write = [&](const std::string& name, const nlohmann::json& j) {
    const auto path = (dir / name).string();
    writeText(path, j.dump());
    return path;
  };
  SECTION("missing file") {
    CHECK_THROWS_WITH(profile::readProfile((dir / "none.json").string()),
                      Catch::Contains("cannot be read (run the profiler first)"));
  }
  SECTION("not JSON") {
    writeText(dir / "broken.json", "{\"format\": \"varuna-profile\", ");
    CHECK_THROWS_WITH(profile::readProfile((dir / "broken.json").string()), Catch::Contains("is not valid JSON"));
  }
  SECTION("not a profile") {
    CHECK_THROWS_WITH(profile::readProfile(write("other.json", {{"format", "something"}})),
                      Catch::Contains("is not a varuna profile"));
  }
  SECTION("another version") {
    auto j = good;
    j["version"] = profile::kVersion + 1;
    CHECK_THROWS_WITH(profile::readProfile(write("v2.json", j)),
                      Catch::Contains(strCat("is a version ", profile::kVersion + 1, " profile")) &&
                          Catch::Contains("profile the model again"));
  }
  SECTION("a field missing or of the wrong type") {
    auto j = good;
    j["pieces"][0].erase("param_count");
    CHECK_THROWS_WITH(profile::readProfile(write("missing.json", j)),
                      Catch::Contains("is malformed") && Catch::Contains("profile the model again"));
    j = good;
    j["pieces"][0]["micro_batch"]["1"]["forward"]["median_s"] = "fast";
    CHECK_THROWS_AS(profile::readProfile(write("type.json", j)), profile::ProfileError);
    j = good;
    j["pieces"][0]["micro_batch"]["0"] = j["pieces"][0]["micro_batch"]["1"];
    CHECK_THROWS_WITH(profile::readProfile(write("zero.json", j)), Catch::Contains("is not positive"));
  }
  SECTION("a stale profile: the model changed") {
    const std::string path = write("stale.json", good);
    CHECK_THROWS_WITH(profile::readProfile(path, "fedcba9876543210"),
                      Catch::Contains("is stale: the model changed") && Catch::Contains("profile it again"));
    // A ProfileError is a ConfigError: run_varuna and workers exit with code 2.
    CHECK_THROWS_AS(profile::readProfile(path, "fedcba9876543210"), ConfigError);
  }
}

TEST_CASE("simulator: zb-h1 replays B and W as halves of the backward, and beats 1F1B's bubble", "[simulator]") {
  // F = 1, backward = 2 per piece and sample: B = W = 1 without a measured split.
  const auto profile = uniformProfile(2, {1}, PieceSpec{1.0, 2.0, 1.0, 0, 0, 0});
  const Simulation zb = simulate(profile, input(2, 1, 1, 8, ScheduleKind::kZeroBubbleH1));
  const Simulation ofob = simulate(profile, input(2, 1, 1, 8, ScheduleKind::k1F1B));
  CHECK(zb.pipelineSeconds == Approx(3.0 * 8 + 1));  // (P-1)(F+B) - W idle
  CHECK(ofob.pipelineSeconds == Approx(3.0 * (8 + 1)));
  CHECK(zb.stageComputeSeconds == ofob.stageComputeSeconds);  // the same work
  // A measured split moves the cost between B and W: the makespan follows.
  auto measured = profile;
  for (auto& piece : measured.pieces) {
    auto& s = piece.bySize.at(1);
    s.backwardInput = s.backwardWeight = s.backward;
    s.backwardInput.median = 1.5;
    s.backwardWeight.median = 0.5;
    s.backwardInput.samples = s.backwardWeight.samples = 5;
  }
  const Simulation heavyB = simulate(measured, input(2, 1, 1, 8, ScheduleKind::kZeroBubbleH1));
  CHECK(heavyB.pipelineSeconds > zb.pipelineSeconds);
  // What B keeps for W is memory from B to W: zb-h1's stages need more,
  // 1F1B's (whole backwards) the same.
  auto kept = measured;
  for (auto& piece : kept.pieces) piece.bySize.at(1).splitKeptBytes = 1 << 20;
  const Simulation keptZb = simulate(kept, input(2, 1, 1, 8, ScheduleKind::kZeroBubbleH1));
  CHECK(keptZb.maxStageMemoryBytes() >= heavyB.maxStageMemoryBytes() + (1 << 20));
  CHECK(simulate(kept, input(2, 1, 1, 8, ScheduleKind::k1F1B)).maxStageMemoryBytes() == ofob.maxStageMemoryBytes());
  // The split survives the profile's file format.
  const auto text = profile::toJson(measured).dump();
  const auto back = profile::fromJson(nlohmann::json::parse(text), "test").pieces[0].bySize.at(1);
  CHECK(back.backwardInput.median == 1.5);
  CHECK(back.backwardWeight.median == 0.5);
  const auto keptText = profile::toJson(kept).dump();
  CHECK(profile::fromJson(nlohmann::json::parse(keptText), "test").pieces[0].bySize.at(1).splitKeptBytes == 1 << 20);
}

TEST_CASE("simulator: chunked schedules place two virtual stages per stage and shrink the bubble", "[simulator]") {
  // Four pieces of F = 0.5, backward 1 per sample: P = 2 stages of two pieces,
  // as two chunks of one piece each under interleaved and zbv.
  const auto profile = uniformProfile(4, {1}, PieceSpec{0.5, 1.0, 0.5, 0, 0, 100});
  const int m = 8;
  const Simulation ofob = simulate(profile, input(2, 1, 1, m, ScheduleKind::k1F1B));
  const Simulation interleaved = simulate(profile, input(2, 1, 1, m, ScheduleKind::kInterleaved1F1B));
  const Simulation zbv = simulate(profile, input(2, 1, 1, m, ScheduleKind::kZeroBubbleV));
  CHECK(ofob.pipelineSeconds == Approx(3.0 * (m + 1)));         // bubble (P-1)(F+B)
  CHECK(interleaved.pipelineSeconds == Approx(3.0 * m + 1.5));  // (P-1)(F+B)/v
  CHECK(zbv.pipelineSeconds == Approx(3.0 * m + 0.5));
  CHECK(interleaved.stageComputeSeconds == ofob.stageComputeSeconds);  // the same work
  CHECK(interleaved.partition.firstPiece == std::vector<int>{0, 1, 2, 3, 4});
  // Interleaved: stage 0 holds virtual stages 0 and 2; zbv: 0 and 3.
  CHECK_THAT(interleaved.describe(), Catch::Contains("stage 0: pieces 0-0 and 2-2"));
  CHECK_THAT(zbv.describe(), Catch::Contains("stage 0: pieces 0-0 and 3-3"));
  // Every stage holds half the parameters either way (and these pieces keep
  // no activations): the same memory per stage.
  CHECK(zbv.stageMemoryBytes == ofob.stageMemoryBytes);
  CHECK(interleaved.stageMemoryBytes == ofob.stageMemoryBytes);
  // stepLowerBound sums both chunks of a stage.
  auto in = input(2, 1, 1, m, ScheduleKind::kZeroBubbleV);
  CHECK(stepLowerBound(profile, in) <= zbv.stepSeconds + 1e-9);
  CHECK(stepLowerBound(profile, in) == Approx(3.0 * m).epsilon(0.01));
  // Explicit chunks, and what does not fit.
  in.schedule = ScheduleKind::kInterleaved1F1B;
  in.chunks = 4;
  CHECK_THROWS_WITH(simulate(profile, in), Catch::Contains("2 stages x 4 chunks") && Catch::Contains("4 pieces"));
  CHECK_THROWS_WITH(simulate(profile, input(2, 1, 1, 7, ScheduleKind::kInterleaved1F1B)),
                    Catch::Contains("multiple of the 2 stages"));
}

TEST_CASE("simulator: data-parallel all-reduce under chunks waits for each chunk's last backward", "[simulator]") {
  // Four pieces of 250 parameters (a 1000-byte bucket each), a 0.5 s
  // all-reduce per bucket: each chunk's bucket is reduced while the stage
  // computes the rest, so only the one finished last is exposed.
  auto profile = uniformProfile(4, {1}, PieceSpec{0.5, 1.0, 0.5, 0, 0, 250});
  profile.allreduce = {{1000, 2, false, 0.5}, {24, 4, false, 0.0}};
  for (auto kind : {ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubbleV}) {
    INFO(toString(kind));
    auto in = input(2, 2, 1, 16, kind);
    in.bucketBytes = 1000;
    const Simulation sim = simulate(profile, in);
    REQUIRE(sim.stageExposedAllreduceSeconds.size() == 2);
    for (double exposed : sim.stageExposedAllreduceSeconds) CHECK(exposed == Approx(0.5).margin(1e-9));
    CHECK(sim.stepSeconds == Approx(sim.pipelineSeconds + sim.allreduceSeconds + sim.optimizerSeconds));
  }
}
