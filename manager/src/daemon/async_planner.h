// AsyncPlanner: AutoConfig as the MorphController's planner without running
// it on run_varuna's event loop. AutoConfig simulates every candidate plan,
// which takes seconds for a big cluster; on the loop that would stall every
// heartbeat, notice and step report meanwhile.
//
// The controller asks synchronously (its planner is a plain function). The
// first time a request is seen, the planner queues AutoConfig for it on a
// BackgroundWorker and throws PlanPending: the controller waits
// (Phase::kPlanning) or, for a running job, keeps the current plan. When the
// result is back on the loop, `onChoice` sees it (the daemon logs it) and
// `onReady` is called (the daemon calls MorphController::planReady), which
// asks again with the same request and now gets the plan, or the ConfigError
// ("no plan fits"). The last result is kept, so the comparison made at a
// machine change and the relaunch after the checkpoint share one computation.
// A request that changes while one is computed is queued behind it.
//
// Owned by the ManagerDaemon; everything here runs on the loop thread except
// `compute`, which runs on the worker's thread with copies of its inputs.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "varuna/manager/autoconfig.h"
#include "loop/background_worker.h"
#include "varuna/manager/morph_controller.h"

namespace varuna {

class AsyncPlanner {
 public:
  // Runs on the worker thread; may throw ConfigError (no plan fits).
  using Compute = std::function<AutoConfigResult(const PlanRequest&)>;

  // `worker` must outlive this planner's use (the daemon declares it after
  // the planner, so it is destroyed, and its results dropped, first).
  AsyncPlanner(BackgroundWorker& worker, Compute compute, std::function<void(const AutoConfigResult&)> onChoice,
               std::function<void()> onReady);

  // The controller's planner: the plan computed for `request`, or its
  // ConfigError; PlanPending while it is being computed.
  Plan plan(const PlanRequest& request);
  // plan() as a ControllerOptions::planner (it keeps a pointer to this).
  std::function<Plan(const PlanRequest&)> planner() {
    return [this](const PlanRequest& request) { return plan(request); };
  }

  // Computations queued or running.
  int computing() const { return computing_; }

 private:
  struct Outcome {
    PlanRequest request;
    std::optional<Plan> plan;
    std::string error;  // the ConfigError's text when there is no plan
  };
  void onComputed(Outcome outcome, const std::optional<AutoConfigResult>& result);

  BackgroundWorker& worker_;
  Compute compute_;
  std::function<void(const AutoConfigResult&)> onChoice_;
  std::function<void()> onReady_;
  std::optional<Outcome> last_;             // the newest result
  std::optional<PlanRequest> requested_;    // the newest request queued
  int computing_ = 0;
};

}  // namespace varuna
