// The runtime on CUDA, as real multi-process jobs of train_gpt on the GPUs of
// this machine (one is enough): exact against a plain libtorch loop on the
// same GPU in deterministic fp32, pipelines of several stages sharing one GPU
// through Gloo, mixed precision, checkpoints moving between CUDA and CPU, and
// a salvage after a kill -9.
// Skipped (exit 77, with a line saying so) without a GPU, so the suite stays
// green on CPU-only machines while the code path stays compiled.
#define CATCH_CONFIG_RUNNER
#include <torch/cuda.h>

#include <iostream>

#include "char_dataset.h"
#include "gpt_model.h"
#include "reference_trainer.h"
#include "salvage_manager.h"
#include "test_env.h"
#include "varuna/worker/devices.h"
#include "worker_job.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;
using namespace varuna::test;

namespace {

constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;
const auto kJobTimeout = std::chrono::seconds(240);

gpt::GptConfig smallGpt(int64_t vocab) {
  gpt::GptConfig c;
  c.vocabSize = vocab;
  c.dModel = 64;
  c.heads = 4;
  c.layers = 4;
  c.seqLen = 32;
  c.seed = 1234;
  return c;
}

std::vector<std::string> exactArgs(const std::string& schedule, const ReferenceConfig& rc) {
  return {"--device", "cuda", "--comm_backend", "gloo", "--deterministic", "--schedule", schedule,
          "--optimizer", "sgd", "--lr", std::to_string(rc.lr), "--momentum", std::to_string(rc.momentum),
          "--clip", std::to_string(rc.clip), "--steps", std::to_string(rc.steps), "--d_model", "64", "--heads", "4",
          "--layers", "4", "--seq_len", "32", "--model_seed", "1234", "--data_seed", std::to_string(rc.dataSeed),
          "--peer_timeout_s", "120"};
}

bool closeEnough(double a, double b) { return std::abs(a - b) <= kAtol + kRtol * std::abs(b); }

// Every rank's parameters of replica 0, by full name.
std::map<std::string, torch::Tensor> replicaParams(const WorkerJob& job, int stages,
                                                   std::map<std::string, torch::Tensor> (WorkerJob::*read)(int) const =
                                                       &WorkerJob::params) {
  std::map<std::string, torch::Tensor> all;
  for (int stage = 0; stage < stages; ++stage) all.merge((job.*read)(stage));
  return all;
}

void checkAgainstReference(const WorkerJob& job, int stages, int replicas, const ReferenceRun& reference) {
  for (int r = 0; r < stages * replicas; ++r) {
    const auto steps = job.steps(r);
    REQUIRE(steps.size() == reference.losses.size());
    for (size_t s = 0; s < steps.size(); ++s) {
      INFO("rank " << r << " step " << s << ": loss " << steps[s].loss << " vs " << reference.losses[s]);
      CHECK(closeEnough(steps[s].loss, reference.losses[s]));
      CHECK(closeEnough(steps[s].gradNorm, reference.gradNorms[s]));
    }
  }
  for (int replica = 0; replica < replicas; ++replica) {
    for (int stage = 0; stage < stages; ++stage) {
      for (const auto& [name, tensor] : job.params(replica * stages + stage)) {
        const auto& expected = reference.params.at(name);
        INFO(name << " (replica " << replica << "): max difference "
                  << (tensor - expected).abs().max().item<double>());
        CHECK(torch::allclose(tensor, expected, kRtol, kAtol));
      }
    }
  }
}

}  // namespace

TEST_CASE("1 stage x 1 replica on CUDA equals a plain libtorch loop on the same GPU", "[gpu]") {
  const auto data = gpt::CharDataset::fromPath("/usr/share/common-licenses");
  ReferenceConfig rc;
  rc.seqLen = 32;
  rc.chunkSize = 2;  // the runtime's micro-batches, in the same order: the same kernels
  rc.device = torch::Device(torch::kCUDA, 0);
  const auto reference = trainReference(gpt::makeGptModel(smallGpt(data.vocabSize())), data, rc);
  REQUIRE(reference.gradNorms.front() > rc.clip);  // clipping bites

  WorkerJobSpec spec;
  spec.perReplicaBatch = rc.globalBatch;
  spec.chunkSize = 2;
  spec.trainArgs = exactArgs("1f1b", rc);
  spec.trainArgs.insert(spec.trainArgs.end(), {"--comm_backend", "nccl"});  // the default path of one GPU per rank
  WorkerJob job(spec, scratchDir("gpu-1x1"));
  requireAllSucceeded(job, kJobTimeout);
  checkAgainstReference(job, 1, 1, reference);
}

TEST_CASE("2x1 and 2x2 sharing one GPU through Gloo equal the plain loop, every schedule", "[gpu]") {
  const auto data = gpt::CharDataset::fromPath("/usr/share/common-licenses");
  ReferenceConfig rc;
  rc.seqLen = 32;
  rc.chunkSize = 2;
  rc.device = torch::Device(torch::kCUDA, 0);
  const auto reference = trainReference(gpt::makeGptModel(smallGpt(data.vocabSize())), data, rc);
  for (const std::string schedule : {"varuna", "1f1b", "gpipe", "zb-h1", "interleaved", "zbv"}) {
    for (const auto& [stages, replicas] : std::vector<std::pair<int, int>>{{2, 1}, {2, 2}}) {
      DYNAMIC_SECTION(schedule << " " << stages << "x" << replicas) {
        WorkerJobSpec spec;
        spec.stages = stages;
        spec.replicas = replicas;
        spec.perReplicaBatch = rc.globalBatch / replicas;
        spec.chunkSize = 2;
        spec.trainArgs = exactArgs(schedule, rc);
        WorkerJob job(spec, scratchDir("gpu-" + schedule + "-" + std::to_string(stages) + "x" +
                                       std::to_string(replicas)));
        requireAllSucceeded(job, kJobTimeout);
        checkAgainstReference(job, stages, replicas, reference);
      }
    }
  }
}

TEST_CASE("bf16 and fp16 on CUDA learn; fp16 overflows are skipped by every rank alike", "[gpu]") {
  constexpr size_t kSteps = 60;
  for (const std::string precision : {"bf16", "fp16"}) {
    DYNAMIC_SECTION(precision) {
      WorkerJobSpec spec;
      spec.stages = 2;
      spec.replicas = 2;
      spec.perReplicaBatch = 16;
      spec.chunkSize = 4;
      spec.trainArgs = {"--device", "cuda", "--comm_backend", "gloo", "--steps", std::to_string(kSteps), "--precision",
                        precision, "--d_model", "128", "--layers", "4", "--seq_len", "32", "--lr", "3e-3"};
      // fp16: a scale too large (2^30), so the first steps overflow and halve
      // it until the scaled gradients fit fp16, leaving most steps to learn.
      // (1e30 needs over 80 halvings: every step of 40 overflowed on an H100.)
      if (precision == "fp16") spec.trainArgs.insert(spec.trainArgs.end(), {"--init_loss_scale", "1073741824"});
      WorkerJob job(spec, scratchDir("gpu-" + precision));
      requireAllSucceeded(job, kJobTimeout);
      const auto steps = job.steps(0);
      REQUIRE(steps.size() == kSteps);
      CHECK(steps.back().loss < steps.front().loss - 0.5);
      if (precision == "fp16") {
        CHECK(steps.front().overflow);
        CHECK_FALSE(steps.back().overflow);
      } else {
        for (const auto& s : steps) CHECK_FALSE(s.overflow);
      }
      for (int r = 1; r < job.worldSize(); ++r) {
        const auto theirs = job.steps(r);
        REQUIRE(theirs.size() == steps.size());
        for (size_t s = 0; s < steps.size(); ++s) {
          CHECK(theirs[s].overflow == steps[s].overflow);
          CHECK(theirs[s].lossScale == steps[s].lossScale);
        }
      }
    }
  }
}

TEST_CASE("a checkpoint of a CUDA job resumes in a CPU job and the reverse, parameters bit-exact", "[gpu]") {
  const auto root = scratchDir("gpu-checkpoint");
  auto args = [&](const std::string& device, const std::string& store, int steps) {
    return std::vector<std::string>{"--device", device, "--comm_backend", "gloo", "--steps", std::to_string(steps),
                                    "--optimizer", "adamw", "--d_model", "64", "--layers", "4", "--seq_len", "32",
                                    "--checkpoint_dir", (root / store).string()};
  };
  auto layout = [](int stages, int replicas, std::vector<std::string> trainArgs) {
    WorkerJobSpec spec;
    spec.stages = stages;
    spec.replicas = replicas;
    spec.perReplicaBatch = 8 / replicas;
    spec.chunkSize = 2;
    spec.trainArgs = std::move(trainArgs);
    return spec;
  };
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{{"cuda", "cpu"}, {"cpu", "cuda"}}) {
    DYNAMIC_SECTION(from << " to " << to) {
      const std::string store = from + "-store";
      WorkerJob written(layout(2, 2, args(from, store, 3)), root / (from + "-written"));
      requireAllSucceeded(written, kJobTimeout);
      auto resumeArgs = args(to, store, 4);
      resumeArgs.insert(resumeArgs.end(), {"--resume_step", "3"});
      // Another layout too: pieces, not stages, are the unit of a checkpoint.
      WorkerJob resumed(layout(3, 1, resumeArgs), root / (from + "-resumed-on-" + to));
      requireAllSucceeded(resumed, kJobTimeout);
      const auto saved = replicaParams(written, 2);
      const auto loaded = replicaParams(resumed, 3, &WorkerJob::initialParams);
      REQUIRE(loaded.size() == saved.size());
      for (const auto& [name, tensor] : saved) {
        INFO(name);
        CHECK(torch::equal(loaded.at(name), tensor));
      }
      CHECK(resumed.steps(0).size() == 1);  // step 3 only
    }
  }
}

TEST_CASE("a kill -9 of one rank of a 2x2 CUDA job (Gloo) salvages with 0 steps lost", "[gpu]") {
  requireKillSalvagedWithNoStepLost({"--device", "cuda", "--comm_backend", "gloo", "--deterministic", "--d_model", "64",
                                     "--heads", "2", "--layers", "4", "--seq_len", "32", "--optimizer", "adamw",
                                     "--lr", "3e-3"},
                                    scratchDir("gpu-salvage"), /*rtol=*/1e-5);
}

TEST_CASE("NCCL with more ranks than GPUs is refused at start-up, naming the fix", "[gpu]") {
  const int gpus = static_cast<int>(torch::cuda::device_count());
  WorkerJobSpec spec;
  spec.stages = gpus + 1;  // one rank more than this host has GPUs
  spec.perReplicaBatch = 4;
  spec.chunkSize = 1;
  spec.trainArgs = {"--device", "cuda", "--comm_backend", "nccl", "--steps", "2", "--d_model", "32",
                    "--layers", std::to_string(gpus + 1), "--peer_timeout_s", "10"};
  WorkerJob job(spec, scratchDir("gpu-nccl-refused"));
  const auto codes = job.waitAll(std::chrono::seconds(120));
  CHECK(codes.at(gpus) == 2);  // a configuration error
  CHECK_THAT(job.worker(gpus).stderrText(), Catch::Contains("--comm_backend gloo"));
}

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::cout << "no CUDA device: gpu tests skipped" << std::endl;
    return 77;
  }
  // The plain loops run in this process: deterministic kernels, as the workers' --deterministic.
  varuna::useDeterministicAlgorithms();
  return Catch::Session().run(argc, argv);
}
