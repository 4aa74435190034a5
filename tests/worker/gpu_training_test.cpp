// The same training run on CUDA tensors (ProcessGroupNCCL, autocast on CUDA):
// one worker per GPU, up to 2 stages. Skipped (exit 77) without a GPU, so the
// suite stays green on CPU-only machines while the code path stays compiled.
#define CATCH_CONFIG_RUNNER
#include <torch/cuda.h>

#include <iostream>

#include "test_env.h"
#include "worker_job.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna::test;

TEST_CASE("training on GPUs with NCCL: loss falls, ranks agree", "[gpu]") {
  WorkerJobSpec spec;
  spec.stages = torch::cuda::device_count() >= 2 ? 2 : 1;
  spec.perReplicaBatch = 16;
  spec.chunkSize = 4;
  spec.trainArgs = {"--device", "cuda", "--steps", "30", "--precision", "bf16", "--d_model", "128", "--layers", "4"};
  WorkerJob job(spec, scratchDir("gpu"));
  requireAllSucceeded(job, std::chrono::seconds(240));
  const auto steps = job.steps(0);
  REQUIRE(steps.size() == 30);
  CHECK(steps.back().loss < steps.front().loss - 0.5);
}

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::cout << "no CUDA device: gpu tests skipped" << std::endl;
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
