// A training program outside the source tree, built against an installed
// varuna with find_package(varuna) and varuna::worker only (install_test.sh).
// In one process (world size 1, CPU, the store on a free port) it trains a
// two-piece model and exits 0 only if
//   - the runtime's losses equal a plain libtorch loop's on the same batches
//     (the mean over micro-batches of each micro-batch's mean loss; rtol 1e-5),
//   - the loss fell (the last step's below a quarter of the first's),
//   - a second runtime loading the checkpoint written half-way repeats the
//     second half's losses (rtol 1e-6).
//
//   train_tiny CHECKPOINT_DIR
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "varuna/worker/varuna.h"

namespace {

constexpr int64_t kGlobalBatch = 16;
constexpr int64_t kChunk = 4;
constexpr int64_t kSteps = 12;
constexpr int64_t kCheckpointStep = 6;
constexpr uint64_t kSeed = 11;
constexpr double kLr = 0.05;
constexpr double kMomentum = 0.9;  // optimizer state, which the checkpoint carries

class Hidden : public varuna::Piece {
 public:
  Hidden() : fc_(register_module("fc", torch::nn::Linear(8, 16))) {}
  torch::Tensor forward(const torch::Tensor&, const varuna::Batch& batch) override {
    return torch::tanh(fc_(batch.at("x")));
  }

 private:
  torch::nn::Linear fc_;
};

class Head : public varuna::Piece {
 public:
  Head() : out_(register_module("out", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& activation, const varuna::Batch& batch) override {
    return torch::mse_loss(out_(activation), batch.at("y"));
  }

 private:
  torch::nn::Linear out_;
};

// Deterministic inputs, different at every step, and a learnable target (a
// fixed function of them).
varuna::Batch batchAt(int64_t step, int64_t size) {
  auto x = torch::sin(torch::arange(size * 8, torch::kFloat).reshape({size, 8}) * 0.37 + 1.3 * step);
  auto w = torch::linspace(-1.0, 1.0, 32).reshape({8, 4});
  return {{"x", x}, {"y", 0.5 * x.matmul(w)}};
}

varuna::ModelSpec modelSpec() {
  varuna::ModelSpec spec;
  spec.pieces.push_back({"hidden", [] { return std::make_shared<Hidden>(); }, 8 * 16 + 16});
  spec.pieces.push_back({"head", [] { return std::make_shared<Head>(); }, 16 * 4 + 4});
  spec.seed = kSeed;
  return spec;
}

std::unique_ptr<varuna::Varuna> makeRuntime() {
  varuna::VarunaOptions options;
  options.model = modelSpec();
  options.stageToRankMap = "0;";
  options.rendezvous.masterPort = 0;  // rank 0 hosts the store on a free port
  options.batchSize = kGlobalBatch;
  options.chunkSize = kChunk;
  options.getBatch = [](int64_t size, torch::Device) { return batchAt(0, size); };
  auto runtime = std::make_unique<varuna::Varuna>(std::move(options));
  runtime->setOptimizer(std::make_shared<torch::optim::SGD>(runtime->parameters(), torch::optim::SGDOptions(kLr).momentum(kMomentum)));
  return runtime;
}

// The plain loop: each piece built after manual_seed(seed + index), as the
// runtime builds it.
std::vector<double> referenceLosses() {
  auto spec = modelSpec();
  std::vector<std::shared_ptr<varuna::Piece>> pieces;
  std::vector<torch::Tensor> params;
  for (int i = 0; i < 2; ++i) {
    pieces.push_back(varuna::buildPiece(spec, i));
    for (auto& p : pieces.back()->parameters()) params.push_back(p);
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(kLr).momentum(kMomentum));
  std::vector<double> losses;
  const int64_t micro = kGlobalBatch / kChunk;
  for (int64_t step = 0; step < kSteps; ++step) {
    const auto batch = batchAt(step, kGlobalBatch);
    opt.zero_grad();
    double total = 0.0;
    for (int64_t k = 0; k < micro; ++k) {
      varuna::Batch chunk;
      for (const auto& [name, t] : batch) chunk[name] = t.slice(0, k * kChunk, (k + 1) * kChunk);
      torch::Tensor activation;
      for (auto& piece : pieces) activation = piece->forward(activation, chunk);
      (activation / micro).backward();
      total += activation.item<double>() / micro;
    }
    opt.step();
    losses.push_back(total);
  }
  return losses;
}

bool close(double got, double want, double rtol) {
  return std::isfinite(got) && std::abs(got - want) <= rtol * std::max(1.0, std::abs(want));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]);
    return 2;
  }
  const std::string store = argv[1];
  int failures = 0;
  auto fail = [&](const std::string& what) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures;
  };
  try {
    torch::set_num_threads(1);
    const auto reference = referenceLosses();

    std::vector<double> losses;
    {
      auto model = makeRuntime();
      if (model->numStages() != 1 || model->numReplicas() != 1 || model->namedParameters().size() != 4) {
        fail("expected 1 stage x 1 replica owning 4 parameters");
      }
      for (int64_t step = 0; step < kSteps; ++step) {
        const auto result = model->step(batchAt(step, kGlobalBatch));
        std::printf("step %ld loss %.6f (plain loop %.6f)\n", static_cast<long>(step), result.loss, reference[step]);
        losses.push_back(result.loss);
        if (!close(result.loss, reference[step], 1e-5)) fail("step " + std::to_string(step) + ": loss differs");
        if (model->stepsDone() == kCheckpointStep && !model->checkpoint(store)) fail("the checkpoint failed");
      }
    }
    if (!(losses.back() < 0.25 * losses.front())) {
      fail("the loss did not fall: " + std::to_string(losses.front()) + " -> " + std::to_string(losses.back()));
    }

    auto resumed = makeRuntime();
    const int64_t at = resumed->loadCheckpoint(store, kCheckpointStep);
    if (at != kCheckpointStep || resumed->stepsDone() != kCheckpointStep) fail("loadCheckpoint returned another step");
    for (int64_t step = kCheckpointStep; step < kSteps; ++step) {
      const auto result = resumed->step(batchAt(step, kGlobalBatch));
      std::printf("resumed step %ld loss %.6f\n", static_cast<long>(step), result.loss);
      if (!close(result.loss, losses[step], 1e-6)) fail("resumed step " + std::to_string(step) + ": loss differs");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
