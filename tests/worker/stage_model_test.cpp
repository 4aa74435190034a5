// Stage-level behaviour that needs no peers: recompute fidelity, and the early
// errors for misuse, checked through a one-process Varuna job.

#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "stage_model.h"
#include "varuna/common/errors.h"
#include "varuna/worker/varuna.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;

namespace {

class NoisyLinear : public Piece {
 public:
  NoisyLinear() : fc_(register_module("fc", torch::nn::Linear(8, 8))), drop_(register_module("drop", torch::nn::Dropout(0.5))) {}
  torch::Tensor forward(const torch::Tensor& x, const Batch& batch) override {
    return drop_(fc_(x.defined() ? x : batch.at("x")));
  }
  torch::nn::Linear fc_;
  torch::nn::Dropout drop_;
};

class LossPiece : public Piece {
 public:
  torch::Tensor forward(const torch::Tensor& x, const Batch&) override { return x.pow(2).mean(); }
};

// Returns a tensor whose batch dimension is wrong.
class Transposing : public Piece {
 public:
  Transposing() : fc_(register_module("fc", torch::nn::Linear(8, 8))) {}
  torch::Tensor forward(const torch::Tensor& x, const Batch& batch) override { return fc_(batch.at("x")).t(); }
  torch::nn::Linear fc_;
};

ModelSpec twoPieceModel() {
  ModelSpec spec;
  spec.pieces.push_back({"noisy", [] { return std::make_shared<NoisyLinear>(); }, 72});
  spec.pieces.push_back({"loss", [] { return std::make_shared<LossPiece>(); }, 0});
  return spec;
}

VarunaOptions singleProcess(ModelSpec spec, const std::string& map = "0;") {
  VarunaOptions o;
  o.model = std::move(spec);
  o.stageToRankMap = map;
  o.batchSize = 4;
  o.chunkSize = 2;
  o.rendezvous.masterPort = 0;  // rank 0 hosts the store on a free port
  o.getBatch = [](int64_t n, torch::Device) { return Batch{{"x", torch::randn({n, 8})}}; };
  return o;
}

}  // namespace

TEST_CASE("a recompute reproduces the dropped forward exactly, dropout included", "[stage_model]") {
  StageModel stage(twoPieceModel(), 0, 1, torch::kCPU);
  Batch batch{{"x", torch::randn({4, 8})}};
  MicrobatchState state;
  auto first = stage.forward(state, torch::Tensor(), batch, 4, /*keepGraph=*/false, /*isLastStage=*/false).clone();
  CHECK_FALSE(state.hasGraph);
  auto unrelated = torch::rand({100});  // the generator moves on
  stage.recompute(state, batch, 4, false);
  REQUIRE(state.hasGraph);
  CHECK(torch::equal(state.outputs.back(), first));
  // A plain second forward draws new dropout masks.
  MicrobatchState other;
  auto second = stage.forward(other, torch::Tensor(), batch, 4, true, false);
  CHECK_FALSE(torch::equal(second, first));
  // Backward after recompute reaches the parameters.
  stage.backward(state, torch::ones_like(first), nullptr);
  CHECK(stage.namedParams().at("noisy.fc.weight").grad().abs().sum().item<double>() > 0);
}

TEST_CASE("misuse is refused early with a clear error", "[varuna]") {
  SECTION("a shared weight that does not exist") {
    auto spec = twoPieceModel();
    spec.sharedWeights = {{"noisy.fc.weight", "noisy.fc.missing"}};
    CHECK_THROWS_WITH(Varuna(singleProcess(spec)),
                      Catch::Contains("shared weight 'noisy.fc.missing' does not exist") &&
                          Catch::Contains("noisy.fc.weight"));
  }
  SECTION("more stages than pieces") {
    CHECK_THROWS_WITH(Varuna(singleProcess(twoPieceModel(), "0;1;2;")),
                      Catch::Contains("cannot split 2 pieces into 3 pipeline stages"));
  }
  SECTION("a cut that does not receive a batch-major tensor") {
    ModelSpec spec;
    spec.pieces.push_back({"bad", [] { return std::make_shared<Transposing>(); }, 72});
    spec.pieces.push_back({"loss", [] { return std::make_shared<LossPiece>(); }, 0});
    CHECK_THROWS_WITH(Varuna(singleProcess(spec)),
                      Catch::Contains("piece 'bad' returned a tensor of shape (8, 2)") &&
                          Catch::Contains("one tensor of shape (b, ...)"));
  }
  SECTION("a global batch that the replicas cannot share") {
    auto o = singleProcess(twoPieceModel());
    o.batchSize = 3;
    o.stageToRankMap = "0,1;";
    CHECK_THROWS_WITH(Varuna(o), Catch::Contains("not divisible by the 2 data-parallel replicas"));
  }
  SECTION("step before setOptimizer, and inputs of the wrong size") {
    Varuna v(singleProcess(twoPieceModel()));
    CHECK_THROWS_WITH(v.step({{"x", torch::randn({4, 8})}}), Catch::Contains("setOptimizer"));
    v.setOptimizer(std::make_shared<torch::optim::SGD>(v.parameters(), torch::optim::SGDOptions(0.1)));
    CHECK_THROWS_WITH(v.step({{"x", torch::randn({3, 8})}}), Catch::Contains("input 'x' must be batch-major with 4"));
    auto result = v.step({{"x", torch::randn({4, 8})}});
    CHECK(std::isfinite(result.loss));
    CHECK(result.gradNorm > 0);
  }
}
