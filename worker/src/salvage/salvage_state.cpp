#include "salvage/salvage_state.h"

namespace varuna {

SalvageState::SalvageState(StageModel* model, bool replicaZero, bool keepBuffers)
    : model_(model), replicaZero_(replicaZero), keepBuffers_(keepBuffers) {}

void SalvageState::stepStarted() {
  // Whenever run_varuna may ask for a salvage (its welcome may still be on
  // its way): a few small tensors.
  stepStartBuffers_ = keepBuffers_ ? model_->copyChangingBuffers() : std::vector<torch::Tensor>{};
  point_ = Point::kComputing;
}

void SalvageState::exchangeStarted(const PendingUpdate& pending) {
  pending_ = pending;
  point_ = Point::kExchanging;
}

void SalvageState::exchangeFinished(int64_t step, const StepExchange& exchange) {
  lastExchange_ = exchange;
  lastExchangeStep_ = step;
  point_ = Point::kSyncingBuffers;
}

void SalvageState::stepFinished() { point_ = Point::kBetweenSteps; }

SalvageState::Held SalvageState::held(int64_t stepsDone) {
  const bool noBuffers = model_->changingBuffers().empty();
  const auto restoreStepStart = [&] {
    if (stepStartBuffers_.size() != model_->changingBuffers().size()) return false;  // no copy: nothing whole
    model_->restoreChangingBuffers(stepStartBuffers_);
    return true;
  };
  Held held;
  switch (point_) {
    case Point::kBetweenSteps:
      held.step = stepsDone;
      break;
    case Point::kComputing:
      held.step = restoreStepStart() ? stepsDone : -1;
      break;
    case Point::kExchanging:
      // All but the exchange is done. Replica 0's buffers (or none) are the
      // step's as the forwards left them: kept aside for finishing it. Other
      // replicas would need replica 0's broadcast, which comes after.
      if (replicaZero_ || noBuffers) {
        held.finishableStep = stepsDone + 1;
        exchangingBuffers_ = model_->copyChangingBuffers();
      }
      held.step = restoreStepStart() ? stepsDone : -1;
      break;
    case Point::kSyncingBuffers:
      held.step = replicaZero_ || noBuffers ? stepsDone : -1;
      break;
  }
  // The last exchange this rank finished, whatever it holds: a rank of
  // another replica that lost a peer during replica 0's broadcast holds no
  // whole step, but the result of the exchange before it, which a rank that
  // can finish that step needs.
  if (lastExchangeStep_ >= 0 && lastExchangeStep_ >= held.step) {
    held.exchange = lastExchange_;
    held.exchangeStep = lastExchangeStep_;
  }
  return held;
}

void SalvageState::restoreExchangingBuffers() {
  // None kept (no changing buffers, or held() found no finishable step): nothing to put back.
  if (exchangingBuffers_.size() == model_->changingBuffers().size()) model_->restoreChangingBuffers(exchangingBuffers_);
}

}  // namespace varuna
