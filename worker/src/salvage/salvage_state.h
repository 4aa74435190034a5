// SalvageState: what this rank holds for a salvage (docs/salvage.md),
// kept up to date by step() through four notices, and read by salvage()
// when a peer is lost. step() knows nothing of the salvage rules; this class
// knows nothing of how a step runs.
//
// Owned by Varuna::Impl; used on the training thread only (step() and
// salvage() both run there).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "pipeline/stage_model.h"
#include "pipeline/step_exchange.h"

namespace varuna {

// What a step still has to do once its job-wide exchange is done: in
// step(), or in a salvage from the exchange result another rank relays.
struct PendingUpdate {
  double scale = 1.0;
  std::optional<double> clip;
  int microbatches = 0;
  double computeSeconds = 0.0;
  double waitSeconds = 0.0;  // blocked on neighbour stages (StepResult::waitSeconds)
};

class SalvageState {
 public:
  // What the rank holds if a peer is lost now.
  struct Held {
    int64_t step = -1;            // whole in memory (-1: none)
    int64_t finishableStep = -1;  // can be applied given its exchange result (-1: no)
    // The newest exchange result this rank finished, and its step: usually
    // `step`; for a rank that applied a step but missed its buffer broadcast
    // (its `step` is -1), the step it applied, whose result a finisher needs.
    std::optional<StepExchange> exchange;
    int64_t exchangeStep = -1;
  };

  // `model`'s changing buffers (BatchNorm's running statistics) are what a
  // step moves before its update; `replicaZero`: this rank's buffers are the
  // ones the replicas take after a step. `keepBuffers`: a salvage may be
  // asked for (under run_varuna), so the step's start is copied.
  SalvageState(StageModel* model, bool replicaZero, bool keepBuffers);

  // The notices, in a step's order.
  void stepStarted();                                          // before the first forward
  void exchangeStarted(const PendingUpdate& pending);         // all of the step but its exchange is done
  void exchangeFinished(int64_t step, const StepExchange& exchange);  // the step is applied (or skipped)
  void stepFinished();                                         // the replicas' buffers are alike
  // A checkpoint was loaded: the exchange result kept was of another
  // trajectory's step.
  void trajectoryChanged() { lastExchangeStep_ = -1; }

  // What the rank holds, `stepsDone` being the steps it has applied. Puts
  // the changing buffers back to that step's values (and keeps those the
  // exchanging step's forwards left, for restoreExchangingBuffers()).
  Held held(int64_t stepsDone);
  // Before finishing the step that was exchanging: its buffers as its
  // forwards left them, and the update it still has to apply.
  void restoreExchangingBuffers();
  const PendingUpdate& pendingUpdate() const { return pending_; }

 private:
  // Where step() is. kExchanging: everything of the step is done but its
  // job-wide exchange.
  enum class Point { kBetweenSteps, kComputing, kExchanging, kSyncingBuffers };

  StageModel* model_;
  bool replicaZero_;
  bool keepBuffers_;
  Point point_ = Point::kBetweenSteps;
  std::vector<torch::Tensor> stepStartBuffers_;   // as the step in progress found them
  std::vector<torch::Tensor> exchangingBuffers_;  // as the forwards left them
  PendingUpdate pending_;                         // of the step in kExchanging
  StepExchange lastExchange_;                     // the exchange result of step lastExchangeStep_
  int64_t lastExchangeStep_ = -1;
};

}  // namespace varuna
