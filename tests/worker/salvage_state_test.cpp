// SalvageState (worker/src/salvage/salvage_state.h): what a rank holds for a salvage
// at each point of a step, as step() notifies it, on a stage with a
// BatchNorm (running statistics a forward moves before the update).
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

#include "pipeline/stage_model.h"
#include "salvage/salvage_state.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;

namespace {

class Normed : public Piece {
 public:
  Normed() : fc_(register_module("fc", torch::nn::Linear(4, 4))), bn_(register_module("bn", torch::nn::BatchNorm1d(4))) {}
  torch::Tensor forward(const torch::Tensor& x, const Batch& batch) override {
    return bn_(fc_(x.defined() ? x : batch.at("x")));
  }
  torch::nn::Linear fc_;
  torch::nn::BatchNorm1d bn_;
};

std::unique_ptr<StageModel> normedStage() {
  ModelSpec spec;
  spec.pieces.push_back({"normed", [] { return std::make_shared<Normed>(); }, 20});
  auto stage = std::make_unique<StageModel>(spec, 0, 1, torch::kCPU);
  stage->learnChangingBuffers([&] {
    MicrobatchState state;
    stage->forward(state, torch::Tensor(), Batch{{"x", torch::randn({2, 4})}}, 2, true, false);
  });
  return stage;
}

// A training forward: moves the running statistics.
void forward(StageModel& stage) {
  MicrobatchState state;
  stage.forward(state, torch::Tensor(), Batch{{"x", torch::randn({2, 4}) + 1}}, 2, true, false);
}

torch::Tensor runningMean(const StageModel& stage) { return stage.namedBuffers().at("normed.bn.running_mean").clone(); }

const StepExchange kExchange{12.5, 3.0, false};

}  // namespace

TEST_CASE("between steps a rank holds the steps it applied", "[salvage_state]") {
  auto stage = normedStage();
  SalvageState state(stage.get(), /*replicaZero=*/true, /*keepBuffers=*/true);
  const auto held = state.held(5);
  CHECK(held.step == 5);
  CHECK(held.finishableStep == -1);
  CHECK_FALSE(held.exchange.has_value());
}

TEST_CASE("during a step's compute the buffers go back to the step's start", "[salvage_state]") {
  auto stage = normedStage();
  SalvageState state(stage.get(), true, true);
  const auto atStart = runningMean(*stage);
  state.stepStarted();
  forward(*stage);
  REQUIRE_FALSE(torch::equal(runningMean(*stage), atStart));
  CHECK(state.held(5).step == 5);
  CHECK(torch::equal(runningMean(*stage), atStart));

  SECTION("without a copy of the start (no manager), nothing whole is held") {
    SalvageState unkept(stage.get(), true, /*keepBuffers=*/false);
    unkept.stepStarted();
    forward(*stage);
    CHECK(unkept.held(5).step == -1);
  }
}

TEST_CASE("during the exchange replica 0 can finish the step; others cannot", "[salvage_state]") {
  auto stage = normedStage();
  const auto atStart = runningMean(*stage);
  SECTION("replica 0") {
    SalvageState state(stage.get(), true, true);
    state.stepStarted();
    forward(*stage);
    const auto afterForwards = runningMean(*stage);
    state.exchangeStarted(PendingUpdate{1.0, 0.5, 4, 0.25});
    const auto held = state.held(5);
    CHECK(held.step == 5);
    CHECK(held.finishableStep == 6);
    CHECK(torch::equal(runningMean(*stage), atStart));
    // Finishing the step: the buffers its forwards left, and its update.
    state.restoreExchangingBuffers();
    CHECK(torch::equal(runningMean(*stage), afterForwards));
    CHECK(state.pendingUpdate().microbatches == 4);
    CHECK(state.pendingUpdate().clip == 0.5);
  }
  SECTION("another replica: it waits for replica 0's buffers after the update") {
    SalvageState state(stage.get(), false, true);
    state.stepStarted();
    forward(*stage);
    state.exchangeStarted(PendingUpdate{});
    const auto held = state.held(5);
    CHECK(held.step == 5);
    CHECK(held.finishableStep == -1);
  }
}

TEST_CASE("after the exchange a rank holds the new step, or only its exchange result", "[salvage_state]") {
  auto stage = normedStage();
  for (const bool replicaZero : {true, false}) {
    SalvageState state(stage.get(), replicaZero, true);
    state.stepStarted();
    state.exchangeStarted(PendingUpdate{});
    state.exchangeFinished(6, kExchange);
    const auto held = state.held(6);
    CHECK(held.step == (replicaZero ? 6 : -1));  // other replicas: replica 0's broadcast is missing
    REQUIRE(held.exchange.has_value());
    CHECK(held.exchangeStep == 6);
    CHECK(held.exchange->lossSum == kExchange.lossSum);
    state.stepFinished();
    CHECK(state.held(6).step == 6);
  }
}

TEST_CASE("a loaded checkpoint forgets the exchange result kept", "[salvage_state]") {
  auto stage = normedStage();
  SalvageState state(stage.get(), true, true);
  state.stepStarted();
  state.exchangeStarted(PendingUpdate{});
  state.exchangeFinished(6, kExchange);
  state.stepFinished();
  REQUIRE(state.held(6).exchange.has_value());
  state.trajectoryChanged();
  CHECK_FALSE(state.held(3).exchange.has_value());
}
