// Faults the worker runtime claims to survive or report: a killed rank makes
// every other rank exit with a clear error naming it, in bounded time; with a
// manager that salvages (here SalvageManager, its part played on loopback),
// the survivors of a killed rank write the newest step and a job resumed from
// it trains on exactly as if uninterrupted; an fp16 overflow skips the same
// steps on every rank.

#include <signal.h>

#include "salvage_manager.h"
#include "test_env.h"
#include "varuna/common/errors.h"
#include "worker_job.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;
using namespace varuna::test;

namespace {

// 2 stages x 2 replicas of a small model, plus `extra` training arguments.
WorkerJobSpec smallJob(const std::vector<std::string>& extra) {
  WorkerJobSpec spec;
  spec.stages = 2;
  spec.replicas = 2;
  spec.perReplicaBatch = 4;
  spec.chunkSize = 2;
  spec.trainArgs = {"--d_model", "32", "--heads", "2", "--layers", "4", "--seq_len", "16", "--optimizer", "sgd",
                    "--lr", "0.05"};
  spec.trainArgs.insert(spec.trainArgs.end(), extra.begin(), extra.end());
  return spec;
}

}  // namespace

TEST_CASE("a killed rank makes every other rank fail fast, naming it", "[integration][fault]") {
  WorkerJob job(smallJob({"--steps", "1000000", "--peer_timeout_s", "20"}), scratchDir("kill-rank"));
  const int victim = 3;
  // Ready: the victim has finished a couple of steps.
  REQUIRE(waitUntil([&] { return job.steps(victim).size() >= 2; }, std::chrono::seconds(60)));
  const auto killedAt = std::chrono::steady_clock::now();
  job.worker(victim).kill(SIGKILL);

  const auto codes = job.waitAll(std::chrono::seconds(20));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killedAt).count();
  CHECK(codes[victim] == 128 + SIGKILL);
  for (int r = 0; r < job.worldSize(); ++r) {
    if (r == victim) continue;
    const std::string err = job.worker(r).stderrText();
    INFO("rank " << r << " stderr:\n" << err);
    CHECK(codes[r] == kExitPeerLost);
    CHECK_THAT(err, Catch::Contains("rank 3 (stage 1, replica 1) was lost"));
  }
  WARN("all survivors exited " << seconds << " s after the kill");
  CHECK(seconds < 20.0);
}

TEST_CASE("a rank killed with SIGKILL: the survivors salvage the newest step, and training resumes from it exactly",
          "[integration][fault][salvage]") {
  // AdamW: the optimizer's state must survive the salvage too.
  requireKillSalvagedWithNoStepLost({"--d_model", "32", "--heads", "2", "--layers", "4", "--seq_len", "16",
                                     "--optimizer", "adamw", "--lr", "0.01"},
                                    scratchDir("salvage-kill"), /*rtol=*/0.0);
}

TEST_CASE("an fp16 overflow skips the same steps on every rank", "[integration][fp16]") {
  // A loss scale far too large for fp16: the first steps must overflow.
  WorkerJob job(smallJob({"--steps", "14", "--precision", "fp16", "--init_loss_scale", "1e9", "--peer_timeout_s", "60"}),
                scratchDir("fp16-overflow"));
  requireAllSucceeded(job);
  const auto reference = job.steps(0);
  REQUIRE(reference.size() == 14);
  CHECK(reference.front().overflow);
  CHECK_FALSE(reference.back().overflow);
  for (size_t s = 1; s < reference.size(); ++s) {
    // Each overflow halves the scale; clean steps keep it (growth interval 1000).
    const double expected = reference[s - 1].overflow ? reference[s - 1].lossScale / 2 : reference[s - 1].lossScale;
    CHECK(reference[s].lossScale == expected);
  }
  for (int r = 1; r < job.worldSize(); ++r) {
    const auto steps = job.steps(r);
    REQUIRE(steps.size() == reference.size());
    for (size_t s = 0; s < steps.size(); ++s) {
      INFO("rank " << r << " step " << s);
      CHECK(steps[s].overflow == reference[s].overflow);
      CHECK(steps[s].lossScale == reference[s].lossScale);
      CHECK(steps[s].loss == reference[s].loss);
    }
  }
}
