// Stage-level behaviour that needs no peers: recompute fidelity, and the early
// errors for misuse, checked through a one-process Varuna job.

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "pipeline/stage_model.h"
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

// Running statistics (persistent buffers) and a constant non-persistent buffer.
class NormedLinear : public Piece {
 public:
  NormedLinear()
      : fc_(register_module("fc", torch::nn::Linear(8, 8))), bn_(register_module("bn", torch::nn::BatchNorm1d(8))) {
    scale_ = registerNonPersistentBuffer("scale", torch::full({8}, 2.0));
  }
  torch::Tensor forward(const torch::Tensor& x, const Batch& batch) override {
    return bn_(fc_(x.defined() ? x : batch.at("x"))) * scale_;
  }
  torch::nn::Linear fc_;
  torch::nn::BatchNorm1d bn_;
  torch::Tensor scale_;
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

ModelSpec normedModel() {
  ModelSpec spec;
  spec.pieces.push_back({"normed", [] { return std::make_shared<NormedLinear>(); }, 88});
  spec.pieces.push_back({"loss", [] { return std::make_shared<LossPiece>(); }, 0});
  return spec;
}

std::map<std::string, torch::Tensor> copyBuffers(const StageModel& stage) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : stage.namedBuffers()) out[name] = t.clone();
  return out;
}

TEST_CASE("buffers: changing ones are learned, persistent ones are checkpointed", "[stage_model][buffers]") {
  StageModel stage(normedModel(), 0, 1, torch::kCPU);
  const auto initial = copyBuffers(stage);
  REQUIRE(initial.size() == 4);  // bn.running_mean, bn.running_var, bn.num_batches_tracked, scale
  Batch batch{{"x", torch::randn({4, 8})}};
  stage.learnChangingBuffers([&] {
    MicrobatchState state;
    stage.forward(state, torch::Tensor(), batch, 4, true, false);
  });
  CHECK(stage.changingBuffers() ==
        std::vector<std::string>{"normed.bn.num_batches_tracked", "normed.bn.running_mean", "normed.bn.running_var"});
  // The sample forward left no trace.
  for (const auto& [name, t] : stage.namedBuffers()) CHECK(torch::equal(t, initial.at(name)));
  std::vector<std::string> persistent;
  for (const auto& [name, t] : stage.piecePersistentBuffers(0)) persistent.push_back(name);
  CHECK(persistent ==
        std::vector<std::string>{"normed.bn.num_batches_tracked", "normed.bn.running_mean", "normed.bn.running_var"});
}

TEST_CASE("a recompute leaves buffers exactly as one forward leaves them", "[stage_model][buffers]") {
  // Two stages built alike: one keeps graphs (GPipe/1F1B), one drops them and
  // recomputes (Varuna's schedule), for micro-batches a, b: forward a, forward
  // b, then the backward of a (after its recompute) and of b.
  StageModel plain(normedModel(), 0, 1, torch::kCPU), recomputing(normedModel(), 0, 1, torch::kCPU);
  for (auto* stage : {&plain, &recomputing}) {
    stage->learnChangingBuffers([stage] {
      MicrobatchState state;
      stage->forward(state, torch::Tensor(), Batch{{"x", torch::randn({2, 8})}}, 2, true, false);
    });
  }
  const Batch a{{"x", torch::randn({2, 8})}}, b{{"x", torch::randn({2, 8}) + 3}};
  MicrobatchState pa, pb, ra, rb;
  auto outA = plain.forward(pa, torch::Tensor(), a, 2, true, false);
  auto outB = plain.forward(pb, torch::Tensor(), b, 2, true, false);
  recomputing.forward(ra, torch::Tensor(), a, 2, false, false);
  recomputing.forward(rb, torch::Tensor(), b, 2, false, false);
  const auto afterForwards = copyBuffers(recomputing);
  recomputing.recompute(ra, a, 2, false);
  // The recompute saw the buffers the forward of a saw, and put b's back.
  CHECK(torch::equal(ra.outputs.back(), outA));
  for (const auto& [name, t] : recomputing.namedBuffers()) {
    INFO(name);
    CHECK(torch::equal(t, afterForwards.at(name)));
    CHECK(torch::equal(t, plain.namedBuffers().at(name)));
  }
  CHECK(recomputing.namedBuffers().at("normed.bn.num_batches_tracked").item<int64_t>() == 2);
  // The backward works although batch norm saved the running statistics the
  // recompute rewrote (the writes bypass version counters), and gives the
  // plain stage's gradients.
  recomputing.backward(ra, torch::ones_like(outA), nullptr);
  plain.backward(pa, torch::ones_like(outA), nullptr);
  CHECK(torch::allclose(recomputing.namedParams().at("normed.fc.weight").grad(),
                        plain.namedParams().at("normed.fc.weight").grad()));
  recomputing.recompute(rb, b, 2, false);
  CHECK(torch::equal(rb.outputs.back(), outB));
  for (const auto& [name, t] : recomputing.namedBuffers()) CHECK(torch::equal(t, plain.namedBuffers().at(name)));
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
