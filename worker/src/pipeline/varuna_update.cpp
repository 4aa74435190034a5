// The end of a step (varuna.cpp runs the rest): once the job-wide exchange
// is done, the update is applied and the replicas' changing buffers are made
// alike. Two ways to apply it, by VarunaOptions::onNonFiniteGradients: read
// the exchange result first (skip a non-finite step), or queue the update
// first and read it after (stop on a non-finite step).
#include <chrono>
#include <cmath>

#include "varuna/common/errors.h"
#include "varuna/common/log.h"
#include "pipeline/varuna_impl.h"

namespace varuna {

// The bookkeeping of a step whose exchange result is known: from here on
// this rank holds the new step (varuna_salvage.cpp), without talking to anyone.
StepResult Varuna::Impl::recordStep(const StepExchange& exchange, const PendingUpdate& pending) {
  const double sumOfSquares = exchange.sumOfSquares / D_;  // every replica holds the reduced gradients
  StepResult result;
  result.checkpointRequested = exchange.checkpointRequested;
  ++stepsDone_;
  salvageState_->exchangeFinished(stepsDone_, exchange);
  result.microbatches = pending.microbatches;
  result.computeSecondsPerMicrobatch = pending.computeSeconds / pending.microbatches;
  result.waitSeconds = pending.waitSeconds;
  result.loss = exchange.lossSum / static_cast<double>(opt_.batchSize);
  result.lossScale = pending.scale;
  result.overflow = !std::isfinite(sumOfSquares);
  result.gradNorm = std::sqrt(sumOfSquares) / pending.scale;
  return result;
}

// The rest of a step once its exchange result is read (NonFiniteGradients::
// kSkipStep, and a salvage's finishing of a step).
StepResult Varuna::Impl::applyStep(const StepExchange& exchange, const PendingUpdate& pending) {
  StepResult result = recordStep(exchange, pending);
  if (!result.overflow) {
    double factor = 1.0 / pending.scale;
    if (pending.clip) {
      const double coefficient = *pending.clip / (result.gradNorm + 1e-6);
      if (coefficient < 1.0) factor *= coefficient;
    }
    if (factor != 1.0) buckets_.scale(factor);
    result.optimizerSeconds = runOptimizer();
  } else if (opt_.precision != Precision::kFp16) {
    log::warn("non-finite gradients in ", toString(opt_.precision), " training: step skipped");
  }
  scaler_.update(result.overflow);
  return result;
}

// NonFiniteGradients::kStopTraining (fp32, bf16: no loss scale): the update
// is queued before the exchange result is read, so on a GPU the host launches
// the optimizer's kernels while the device still runs the backward pass. The
// clipping is applyStep's arithmetic done on the device, every operation
// alike in float64 (a true division, not a multiplication by a reciprocal),
// hence the same factor bit for bit.
StepResult Varuna::Impl::queueUpdateThenRead(const torch::Tensor& summed, const PendingUpdate& pending) {
  VARUNA_CHECK(pending.scale == 1.0, "a queued update with a loss scale of ", pending.scale);
  if (pending.clip) {
    torch::NoGradGuard noGrad;
    const auto replicas = torch::full({}, static_cast<double>(D_), summed.options());
    const auto norm = summed[1].div(replicas).sqrt();
    const auto coefficient = torch::full({}, *pending.clip, summed.options()).div(norm.add(1e-6));
    buckets_.scale(torch::where(coefficient < 1.0, coefficient, torch::ones_like(coefficient)));
  }
  const double optimizerSeconds = runOptimizer();  // launched; it runs on the device meanwhile
  const StepExchange exchange = StepExchange::fromTensor(summed);
  StepResult result = recordStep(exchange, pending);
  result.optimizerSeconds = optimizerSeconds;
  if (result.overflow) {
    throw NonFiniteGradientsError(strCat(
        "non-finite gradients at step ", stepsDone_ - 1, " in ", toString(opt_.precision), " training (loss ",
        result.loss, ", squared gradient norm ", exchange.sumOfSquares,
        "); the update was already applied, so the parameters are no longer finite. Resume from the latest "
        "checkpoint (run_varuna does so on its own), lower the learning rate, or set onNonFiniteGradients to "
        "kSkipStep (train_gpt --nonfinite skip) to skip such steps instead"));
  }
  return result;
}

double Varuna::Impl::runOptimizer() {
  const auto start = std::chrono::steady_clock::now();
  if (writer_) writer_->waitUntilCaptured();  // a background checkpoint still reads the tensors
  optimizer_->step();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// DDP's rule: replica 0's buffers win. Only buffers a forward changes can
// differ (the rest are built identically), so only they travel, one flat
// tensor per dtype, once per step.
void Varuna::Impl::synchroniseReplicaBuffers() {
  const auto& names = model_->changingBuffers();
  if (D_ == 1 || names.empty()) return;
  const auto ranks = map_.ranksOfStage(stage_);
  c10d::BroadcastOptions options;
  options.rootRank = std::find(ranks.begin(), ranks.end(), map_.rankOf(stage_, 0)) - ranks.begin();
  const auto& group = comm_->group(strCat("dp", stage_), ranks);
  std::map<at::ScalarType, std::vector<torch::Tensor>> byType;
  for (const auto& name : names) {
    const auto& t = model_->namedBuffers().at(name);
    byType[t.scalar_type()].push_back(t);
  }
  torch::NoGradGuard noGrad;
  for (auto& [type, buffers] : byType) {
    std::vector<torch::Tensor> flat;
    for (const auto& b : buffers) flat.push_back(b.detach().reshape({-1}));
    std::vector<at::Tensor> tensors{torch::cat(flat)};
    comm_->waitFor(group->broadcast(tensors, options), "broadcasting replica 0's buffers");
    int64_t offset = 0;
    for (auto& b : buffers) {
      b.variable_data().copy_(tensors[0].slice(0, offset, offset + b.numel()).view_as(b));
      offset += b.numel();
    }
  }
}

}  // namespace varuna
