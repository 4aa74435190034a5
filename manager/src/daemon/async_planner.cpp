#include "daemon/async_planner.h"

#include "varuna/common/errors.h"

namespace varuna {

AsyncPlanner::AsyncPlanner(BackgroundWorker& worker, Compute compute,
                           std::function<void(const AutoConfigResult&)> onChoice, std::function<void()> onReady)
    : worker_(worker), compute_(std::move(compute)), onChoice_(std::move(onChoice)), onReady_(std::move(onReady)) {}

Plan AsyncPlanner::plan(const PlanRequest& request) {
  if (last_ && last_->request == request) {
    if (last_->plan) return *last_->plan;
    throw ConfigError(last_->error);
  }
  if (requested_ != request) {  // not queued yet (a request queued earlier is answered first)
    requested_ = request;
    ++computing_;
    struct Computed {
      Outcome outcome;
      std::optional<AutoConfigResult> result;
    };
    worker_.run(
        [compute = compute_, request]() {  // the worker's thread: copies only
          Computed computed{{request, std::nullopt, {}}, std::nullopt};
          try {
            computed.result = compute(request);
            computed.outcome.plan = computed.result->best.plan;
          } catch (const ConfigError& e) {  // no plan fits these machines
            computed.outcome.error = e.what();
          } catch (const std::exception& e) {
            // Not a verdict on the machines but a failure of AutoConfig itself
            // (out of memory, a bad profile value): the job treats it alike
            // (no plan now; the next machine change asks again), but the
            // reason says which it was.
            computed.outcome.error = strCat("AutoConfig failed: ", e.what());
          }
          return computed;
        },
        [this](Computed computed) { onComputed(std::move(computed.outcome), computed.result); });
  }
  throw PlanPending();
}

void AsyncPlanner::onComputed(Outcome outcome, const std::optional<AutoConfigResult>& result) {
  --computing_;
  if (requested_ == outcome.request) requested_.reset();
  last_ = std::move(outcome);
  if (result && onChoice_) onChoice_(*result);
  if (onReady_) onReady_();
}

}  // namespace varuna
