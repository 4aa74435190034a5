// The chunked schedules (interleaved 1F1B, zbv) must train exactly as one
// process does, like every other schedule (pipeline_equivalence_test.cpp):
// same losses, gradient norms, parameters and evaluation loss after several
// SGD steps with clipping and tied weights, within fp32 rounding. Layouts
// cover a rank holding both ends of the model (zbv, where the tied embedding
// and head meet on stage 0), the turn of the V on one rank, one rank holding
// every chunk (P = 1), data parallelism, and 3 or 4 stages. Gloo matches
// messages by order here, as NCCL does (VARUNA_P2P_MATCH_BY_ORDER, comm.h):
// with several cuts between one pair of ranks, only the agreed order of
// step_messages.h pairs each message with its own receive. Two cases keep
// Gloo's own matching by tag, where a step posts every receive first.

#include <cmath>
#include <memory>
#include <tuple>

#include "char_dataset.h"
#include "gpt_model.h"
#include "reference_trainer.h"
#include "test_env.h"
#include "worker_job.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;
using namespace varuna::test;

namespace {

constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;

struct ChunkedCase {
  std::string schedule;
  int stages;
  int replicas;
  int layers;          // the model has layers + 2 pieces; stages x chunks must not exceed it
  int64_t globalBatch;  // micro-batches of 2: interleaved needs a multiple of the stages per replica
  // Declare the tied pair (head, embedding), with buckets of 1 KiB (one
  // tensor each): with both on one stage, the tied weight's bucket must wait
  // for the embedding's backward, though the head's finishes first.
  bool tieHeadFirst = false;
  // Gloo pairs messages by tag, as it does by default on the CPU: each step
  // posts all its receives at its start (receivesFirst, step_messages.h).
  bool byTag = false;
};

gpt::GptConfig tinyGpt(int64_t vocab, int layers, bool tieHeadFirst) {
  gpt::GptConfig c;
  c.tieHeadFirst = tieHeadFirst;
  c.vocabSize = vocab;
  c.dModel = 32;
  c.heads = 2;
  c.layers = layers;
  c.seqLen = 16;
  c.seed = 1234;
  return c;
}

std::vector<std::string> trainArgs(const ChunkedCase& c, const ReferenceConfig& rc) {
  std::vector<std::string> args{
      "--schedule", c.schedule, "--optimizer", "sgd", "--lr", std::to_string(rc.lr), "--momentum",
      std::to_string(rc.momentum), "--clip", std::to_string(rc.clip), "--steps", std::to_string(rc.steps),
      "--d_model", "32", "--heads", "2", "--layers", std::to_string(c.layers), "--seq_len", "16",
      "--model_seed", "1234", "--data_seed", std::to_string(rc.dataSeed), "--peer_timeout_s", "60"};
  if (c.tieHeadFirst) args.insert(args.end(), {"--tie_head_first", "--bucket_bytes", "1024"});
  return args;
}

}  // namespace

TEST_CASE("interleaved and zbv training equal single-process training", "[integration]") {
  const auto data = gpt::CharDataset::fromPath("/usr/share/common-licenses");
  const std::vector<ChunkedCase> cases = {
      {"interleaved", 2, 1, 4, 8}, {"interleaved", 2, 2, 4, 8}, {"interleaved", 3, 1, 4, 6},
      {"interleaved", 1, 2, 4, 8}, {"interleaved:3", 2, 1, 4, 8}, {"interleaved", 4, 1, 6, 8},
      {"zbv", 2, 1, 4, 8},         {"zbv", 2, 2, 4, 8},         {"zbv", 3, 1, 4, 8},
      {"zbv", 1, 2, 4, 8},         {"zbv", 4, 1, 6, 8},         {"zbv", 3, 2, 4, 8},
      {"zbv", 2, 2, 4, 8, true},   {"1f1b", 1, 2, 4, 8, true},
      {"zbv", 3, 2, 4, 8, false, true}, {"interleaved", 2, 2, 4, 8, false, true},
  };
  std::map<std::tuple<int, int64_t, bool>, ReferenceRun> references;  // by (layers, global batch, head first)
  for (const auto& c : cases) {
    DYNAMIC_SECTION(c.schedule << " P=" << c.stages << " D=" << c.replicas << (c.tieHeadFirst ? " head first" : "")
                               << (c.byTag ? " by tag" : "")) {
      ReferenceConfig rc;
      rc.globalBatch = c.globalBatch;
      auto key = std::make_tuple(c.layers, c.globalBatch, c.tieHeadFirst);
      if (!references.count(key)) {
        references.emplace(
            key, trainReference(gpt::makeGptModel(tinyGpt(data.vocabSize(), c.layers, c.tieHeadFirst)), data, rc));
      }
      const auto& reference = references.at(key);
      REQUIRE(reference.gradNorms.front() > rc.clip);  // the clip bites

      WorkerJobSpec spec;
      spec.stages = c.stages;
      spec.replicas = c.replicas;
      spec.perReplicaBatch = c.globalBatch / c.replicas;
      spec.chunkSize = 2;
      if (!c.byTag) spec.env["VARUNA_P2P_MATCH_BY_ORDER"] = "1";
      spec.trainArgs = trainArgs(c, rc);
      WorkerJob job(spec, scratchDir("chunked-" + c.schedule + "-" + std::to_string(c.stages) + "x" +
                                     std::to_string(c.replicas) + (c.tieHeadFirst ? "-head-first" : "") +
                                     (c.byTag ? "-by-tag" : "")));
      requireAllSucceeded(job);
      CHECK_THAT(job.worker(0).stderrText(), Catch::Contains("schedule " + c.schedule));
      // Tag matching takes the receives-first plan; matching by order (NCCL's way) never does.
      const bool receivesFirst =
          job.worker(0).stderrText().find("receives posted at each step's start") != std::string::npos;
      CHECK(receivesFirst == c.byTag);
      // zbv: stage 0 holds the first and the last virtual stage.
      if (c.schedule == "zbv") {
        CHECK_THAT(job.worker(0).stderrText(),
                   Catch::Contains("virtual stages per stage: 0: 0," + std::to_string(2 * c.stages - 1)));
      }

      for (int r = 0; r < job.worldSize(); ++r) {
        const auto steps = job.steps(r);
        REQUIRE(steps.size() == reference.losses.size());
        for (size_t s = 0; s < steps.size(); ++s) {
          INFO("rank " << r << " step " << s);
          CHECK(steps[s].loss == Approx(reference.losses[s]).epsilon(kRtol));
          CHECK(steps[s].gradNorm == Approx(reference.gradNorms[s]).epsilon(kRtol));
        }
      }
      for (int replica = 0; replica < c.replicas; ++replica) {
        std::map<std::string, torch::Tensor> seen;
        for (int s = 0; s < c.stages; ++s) {
          for (auto& [name, tensor] : job.params(replica * c.stages + s)) seen[name] = tensor;
        }
        REQUIRE(seen.size() == reference.params.size());
        for (const auto& [name, expected] : reference.params) {
          INFO("replica " << replica << " parameter " << name);
          REQUIRE(seen.count(name));
          CHECK(((seen[name] - expected).abs() - kRtol * expected.abs()).max().item<double>() <= kAtol);
        }
        CHECK(torch::equal(seen.at("embed.wte.weight"), seen.at("head.lm_head.weight")));
      }
      for (int r = 0; r < job.worldSize(); ++r) CHECK(job.evalLoss(r) == Approx(reference.evalLoss).epsilon(kRtol));
    }
  }
}

TEST_CASE("a chunked schedule on too few pieces, or interleaved on a micro-batch count it cannot split, is refused",
          "[integration]") {
  ReferenceConfig rc;
  SECTION("zbv on 4 stages needs 8 pieces; the model has 6") {
    WorkerJobSpec spec;
    spec.stages = 4;
    spec.replicas = 1;
    spec.trainArgs = trainArgs({"zbv", 4, 1, 4, 8}, rc);
    WorkerJob job(spec, scratchDir("chunked-too-few-pieces"));
    for (int code : job.waitAll(std::chrono::seconds(120))) CHECK(code > 0);
    CHECK_THAT(job.worker(0).stderrText(), Catch::Contains("needs 8 pieces (stages x chunks) but the model has 6"));
  }
  SECTION("interleaved on 3 stages with 4 micro-batches") {
    WorkerJobSpec spec;
    spec.stages = 3;
    spec.replicas = 1;
    spec.trainArgs = trainArgs({"interleaved", 3, 1, 4, 8}, rc);
    WorkerJob job(spec, scratchDir("chunked-indivisible"));
    for (int code : job.waitAll(std::chrono::seconds(120))) CHECK(code > 0);
    CHECK_THAT(job.worker(0).stderrText(), Catch::Contains("multiple of the 3 stages, got 4"));
  }
}
