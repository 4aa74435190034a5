// Pipeline x data-parallel training must equal single-process training:
// same losses and same parameters after several SGD steps with gradient
// clipping, for every schedule (zero-bubble included) and several (P, D), within fp32 rounding
// (relative 1e-5, absolute 1e-6 for values near zero). Gloo matches the
// messages by order here, as NCCL does (VARUNA_P2P_MATCH_BY_ORDER, comm.h):
// the order each rank issues them in (step_messages.h) must pair every
// message with its own receive, or the losses differ.

#include <cmath>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "char_dataset.h"
#include "gpt_model.h"
#include "reference_trainer.h"
#include "test_env.h"
#include "varuna/common/errors.h"
#include "worker_job.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;
using namespace varuna::test;

namespace {

constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;

struct Layout {
  int stages;
  int replicas;
  std::string pieceCosts;  // empty: balance by parameter count
};

gpt::GptConfig tinyGpt(int64_t vocab) {
  gpt::GptConfig c;
  c.vocabSize = vocab;
  c.dModel = 32;
  c.heads = 2;
  c.layers = 4;
  c.seqLen = 16;
  c.seed = 1234;
  return c;
}

std::vector<std::string> trainArgs(const std::string& schedule, const ReferenceConfig& rc) {
  return {"--schedule", schedule, "--optimizer", "sgd", "--lr", std::to_string(rc.lr), "--momentum",
          std::to_string(rc.momentum), "--clip", std::to_string(rc.clip), "--steps", std::to_string(rc.steps),
          "--d_model", "32", "--heads", "2", "--layers", "4", "--seq_len", "16", "--model_seed", "1234",
          "--data_seed", std::to_string(rc.dataSeed), "--peer_timeout_s", "60"};
}

}  // namespace

TEST_CASE("pipeline and data-parallel training equal single-process training", "[integration]") {
  const auto data = gpt::CharDataset::fromPath("/usr/share/common-licenses");
  ReferenceConfig rc;
  const auto reference = trainReference(gpt::makeGptModel(tinyGpt(data.vocabSize())), data, rc);
  REQUIRE(reference.losses.size() == static_cast<size_t>(rc.steps));
  // The clip must actually bite, or clipping would go untested.
  REQUIRE(reference.gradNorms.front() > rc.clip);

  const std::vector<Layout> layouts = {{2, 1, ""}, {2, 2, ""}, {4, 1, ""}, {1, 2, ""}, {3, 1, "1,1,4,1,1,1"}, {3, 2, ""}};
  for (const std::string schedule : {"varuna", "1f1b", "gpipe", "zb-h1"}) {
    for (const auto& layout : layouts) {
      DYNAMIC_SECTION(schedule << " P=" << layout.stages << " D=" << layout.replicas) {
        WorkerJobSpec spec;
        spec.stages = layout.stages;
        spec.replicas = layout.replicas;
        spec.perReplicaBatch = rc.globalBatch / layout.replicas;
        spec.chunkSize = 2;
        spec.env["VARUNA_P2P_MATCH_BY_ORDER"] = "1";
        spec.trainArgs = trainArgs(schedule, rc);
        if (!layout.pieceCosts.empty()) spec.trainArgs.insert(spec.trainArgs.end(), {"--piece_costs", layout.pieceCosts});
        WorkerJob job(spec, scratchDir(schedule + "-" + std::to_string(layout.stages) + "x" +
                                       std::to_string(layout.replicas)));
        requireAllSucceeded(job);
        if (!layout.pieceCosts.empty()) {
          // Balanced by cost: the heavy block1 gets a stage of its own.
          CHECK_THAT(job.worker(0).stderrText(), Catch::Contains("stage 1: pieces 2-2"));
        }

        for (int r = 0; r < job.worldSize(); ++r) {
          const auto steps = job.steps(r);
          REQUIRE(steps.size() == reference.losses.size());
          for (size_t s = 0; s < steps.size(); ++s) {
            INFO("rank " << r << " step " << s);
            CHECK(steps[s].loss == Approx(reference.losses[s]).epsilon(kRtol));
            CHECK(steps[s].gradNorm == Approx(reference.gradNorms[s]).epsilon(kRtol));
            CHECK_FALSE(steps[s].overflow);
          }
        }

        // Every replica holds every parameter of its stage, equal to the reference.
        for (int replica = 0; replica < layout.replicas; ++replica) {
          std::map<std::string, torch::Tensor> seen;
          for (int s = 0; s < layout.stages; ++s) {
            for (auto& [name, tensor] : job.params(replica * layout.stages + s)) seen[name] = tensor;
          }
          REQUIRE(seen.size() == reference.params.size());
          for (const auto& [name, expected] : reference.params) {
            INFO("replica " << replica << " parameter " << name);
            REQUIRE(seen.count(name));
            const double worst = ((seen[name] - expected).abs() - kRtol * expected.abs()).max().item<double>();
            CHECK(worst <= kAtol);
          }
          // Tied weights: bit-identical copies, wherever they live.
          CHECK(torch::equal(seen.at("embed.wte.weight"), seen.at("head.lm_head.weight")));
        }
        // evaluate(): the same held-out loss on every rank, equal to the reference's.
        for (int r = 0; r < job.worldSize(); ++r) CHECK(job.evalLoss(r) == Approx(reference.evalLoss).epsilon(kRtol));
      }
    }
  }
}

TEST_CASE("without shared weights the pipeline equals single-process training too", "[integration]") {
  const auto data = gpt::CharDataset::fromPath("/usr/share/common-licenses");
  ReferenceConfig rc;
  auto config = tinyGpt(data.vocabSize());
  config.tieEmbeddings = false;
  const auto reference = trainReference(gpt::makeGptModel(config), data, rc);
  WorkerJobSpec spec;
  spec.stages = 2;
  spec.replicas = 2;
  spec.perReplicaBatch = rc.globalBatch / 2;
  spec.trainArgs = trainArgs("varuna", rc);
  spec.trainArgs.push_back("--untied");
  WorkerJob job(spec, scratchDir("untied"));
  requireAllSucceeded(job);
  const auto steps = job.steps(0);
  REQUIRE(steps.size() == reference.losses.size());
  for (size_t s = 0; s < steps.size(); ++s) CHECK(steps[s].loss == Approx(reference.losses[s]).epsilon(kRtol));
  std::map<std::string, torch::Tensor> seen;
  for (int r : {0, 1}) {
    for (auto& [name, tensor] : job.params(r)) seen[name] = tensor;
  }
  REQUIRE(seen.size() == reference.params.size());
  for (const auto& [name, expected] : reference.params) {
    INFO(name);
    CHECK(((seen.at(name) - expected).abs() - kRtol * expected.abs()).max().item<double>() <= kAtol);
  }
  CHECK_FALSE(torch::equal(seen.at("embed.wte.weight"), seen.at("head.lm_head.weight")));
}

TEST_CASE("the example learns: loss falls in fp32 and bf16, and in bf16 under zbv", "[integration]") {
  for (const auto& [precision, schedule] : std::vector<std::pair<std::string, std::string>>{
           {"fp32", "varuna"}, {"bf16", "varuna"}, {"bf16", "zbv"}}) {
    DYNAMIC_SECTION(precision << " " << schedule) {
      WorkerJobSpec spec;
      spec.stages = 2;
      spec.replicas = 1;
      spec.perReplicaBatch = 8;
      spec.chunkSize = 4;
      spec.trainArgs = {"--d_model", "64", "--heads", "2", "--layers", "2", "--seq_len", "32", "--steps", "40",
                        "--lr", "3e-3", "--precision", precision, "--schedule", schedule};
      WorkerJob job(spec, scratchDir("learns-" + precision + "-" + schedule));
      requireAllSucceeded(job);
      const auto steps = job.steps(0);
      REQUIRE(steps.size() == 40);
      double first = 0, last = 0;
      for (int i = 0; i < 5; ++i) {
        first += steps[i].loss / 5;
        last += steps[35 + i].loss / 5;
      }
      INFO("mean loss of the first 5 steps " << first << ", of the last 5 " << last);
      CHECK(last < first - 0.7);
      CHECK(std::isfinite(job.evalLoss(0)));
    }
  }
}

TEST_CASE("--nonfinite stop (the update queued before the exchange is read) trains bit for bit as skip",
          "[integration]") {
  ReferenceConfig rc;  // its clip bites at the first step: clipping on the device is checked too
  // 2x2: stages and tied weights across them; 1x3: the norm's division by
  // the replica count is not exact, as a division by 2 is.
  for (const auto& [stages, replicas] : std::vector<std::pair<int, int>>{{2, 2}, {1, 3}}) {
    DYNAMIC_SECTION(stages << "x" << replicas) {
      auto run = [&](const std::string& mode) {
        WorkerJobSpec spec;
        spec.stages = stages;
        spec.replicas = replicas;
        spec.perReplicaBatch = 4;
        spec.chunkSize = 2;
        spec.trainArgs = trainArgs("varuna", rc);
        spec.trainArgs.insert(spec.trainArgs.end(), {"--nonfinite", mode});
        auto job = std::make_unique<WorkerJob>(
            spec, scratchDir("nonfinite-" + mode + "-" + std::to_string(stages) + "x" + std::to_string(replicas)));
        requireAllSucceeded(*job);
        return job;
      };
      const auto skip = run("skip");
      const auto stop = run("stop");
      for (int r = 0; r < skip->worldSize(); ++r) {
        const auto a = skip->steps(r), b = stop->steps(r);
        REQUIRE(a.size() == b.size());
        for (size_t s = 0; s < a.size(); ++s) {
          INFO("rank " << r << " step " << s);
          CHECK(a[s].loss == b[s].loss);
          CHECK(a[s].gradNorm == b[s].gradNorm);
        }
        for (const auto& [name, tensor] : skip->params(r)) {
          INFO("rank " << r << " parameter " << name);
          CHECK(torch::equal(stop->params(r).at(name), tensor));
        }
      }
    }
  }
}

TEST_CASE("a non-finite gradient on one rank: skip skips that step everywhere; stop stops every rank, naming it",
          "[integration][fault]") {
  ReferenceConfig rc;
  auto spec = [&](const std::string& mode) {
    WorkerJobSpec s;
    s.stages = 2;
    s.perReplicaBatch = rc.globalBatch;
    s.chunkSize = 2;
    s.trainArgs = trainArgs("varuna", rc);
    s.trainArgs.insert(s.trainArgs.end(), {"--nonfinite", mode, "--test_nonfinite_at_step", "2"});
    return s;
  };
  SECTION("skip") {
    WorkerJob job(spec("skip"), scratchDir("poisoned-skip"));
    requireAllSucceeded(job);
    for (int r = 0; r < job.worldSize(); ++r) {
      const auto steps = job.steps(r);
      REQUIRE(steps.size() == static_cast<size_t>(rc.steps));
      for (size_t s = 0; s < steps.size(); ++s) CHECK(steps[s].overflow == (s == 2));
    }
    CHECK_THAT(job.worker(0).stderrText(), Catch::Contains("non-finite gradients in fp32 training: step skipped"));
  }
  SECTION("stop") {
    WorkerJob job(spec("stop"), scratchDir("poisoned-stop"));
    const auto codes = job.waitAll(std::chrono::seconds(120));
    for (int r = 0; r < job.worldSize(); ++r) {
      INFO("rank " << r << " stderr:\n" << job.worker(r).stderrText());
      CHECK(codes[r] == kExitTrainingFailed);
      CHECK(job.steps(r).size() == 2);  // steps 0 and 1
      CHECK_THAT(job.worker(r).stderrText(), Catch::Contains("non-finite gradients at step 2 in fp32 training") &&
                                                 Catch::Contains("Resume from the latest checkpoint"));
    }
  }
}

TEST_CASE("a step's time splits into compute, waits on neighbours and the optimizer", "[integration]") {
  ReferenceConfig rc;
  WorkerJobSpec spec;
  spec.stages = 2;
  spec.replicas = 1;
  spec.perReplicaBatch = rc.globalBatch;
  spec.chunkSize = 2;
  spec.trainArgs = trainArgs("zbv", rc);
  WorkerJob job(spec, scratchDir("step-time-parts"));
  requireAllSucceeded(job);
  const int m = static_cast<int>(rc.globalBatch / spec.chunkSize);
  for (int r = 0; r < job.worldSize(); ++r) {
    std::ifstream in(job.dir() / ("rank" + std::to_string(r) + "_steps.jsonl"));
    int rows = 0;
    for (std::string line; std::getline(in, line); ++rows) {
      const auto row = nlohmann::json::parse(line);
      INFO("rank " << r << ": " << line);
      const double parts = row.at("compute_s_per_microbatch").get<double>() * m + row.at("wait_s").get<double>() +
                           row.at("optimizer_s").get<double>();
      CHECK(row.at("wait_s").get<double>() >= 0);
      CHECK(parts <= row.at("time_s").get<double>());
      // Rank 1 waits at least for the first activation of every step.
      if (r == 1) CHECK(row.at("wait_s").get<double>() > 0);
    }
    CHECK(rows == rc.steps);
  }
}
