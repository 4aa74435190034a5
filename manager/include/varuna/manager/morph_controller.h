// MorphController: the manager's decisions, as a pure state machine.
//
// The daemon feeds it events (worker exits reported by agents, lost agent
// connections, preemption notices, machine-list changes, heartbeat timeouts,
// clock ticks) with the current time, and carries out the actions it returns
// (launch a plan, SIGUSR1 everyone, kill everyone, stop). Nothing here does
// I/O or reads a clock, so every scenario is a unit test with a fake clock.
// Not thread-safe: the daemon's single event-loop thread owns it.
//
// Lifecycle of a job generation:
//   running --preempt / list change--> checkpointing --all exited--> relaunch
//   running --failure--> stopping (kill all) --all exited--> backoff --> relaunch
// Events arriving during a morph only change the inputs of the next plan.
// Worker exit codes: 0 done, 75 checkpointed (a morph), 2 a configuration
// error (the job stops: a relaunch would fail the same way); anything else is
// a failure that a relaunch can fix, among them 74 (checkpoint storage failed
// or a checkpoint was damaged: the relaunch resumes from the latest complete
// checkpoint that still verifies) and 76 (the worker's generation was
// superseded in the store).
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "varuna/manager/planner.h"

namespace varuna {

using TimePoint = std::chrono::steady_clock::time_point;

namespace action {
struct Launch {  // start `plan` (agents spawn its workers), resuming from a checkpoint
  Plan plan;
  int64_t resumeStep = -1;
  int generation = 0;
};
struct Checkpoint {};  // SIGUSR1 to every worker: checkpoint the finished step and exit 75
struct KillAll {
  std::string reason;
};
struct Stop {  // the manager is done
  std::string reason;
  int exitCode = 0;
};
}  // namespace action
using Action = std::variant<action::Launch, action::Checkpoint, action::KillAll, action::Stop>;

enum class Phase { kIdle, kRunning, kCheckpointing, kStopping, kBackoff, kWaitingForMachines, kFinished, kFailed };
const char* toString(Phase phase);
// "code 74 (checkpoint storage failed)", "a signal", ...: a worker's exit for messages.
std::string describeExit(int exitCode);

struct ControllerOptions {
  int stages = 1;
  int64_t globalBatch = 0;
  int64_t chunkSize = 0;
  bool morphing = true;  // false (--no_morphing): run once, any failure stops the job
  std::chrono::milliseconds checkpointTimeout{std::chrono::seconds(120)};
  int maxFailures = 3;  // within failureWindow; one more stops the manager
  std::chrono::milliseconds failureWindow{std::chrono::minutes(10)};
  std::chrono::milliseconds restartBackoff{std::chrono::seconds(1)};  // doubles per recent failure
  int firstGeneration = 1;  // a restarted manager continues the numbering of the one before
  // Turns the machines at hand into a plan, at start and at every morph; may
  // throw ConfigError (no plan fits: wait for machines). Null: makePlan with
  // `stages` and `chunkSize`. AutoConfig plugs in here (autoConfigPlanner),
  // choosing P and the micro-batch itself; it is called on the controller's
  // thread, so it must be quick and must not block.
  std::function<Plan(const PlanRequest&)> planner;
};

class MorphController {
 public:
  MorphController(ControllerOptions options, std::vector<Machine> machines,
                  std::function<std::optional<int64_t>()> latestCheckpoint);

  std::vector<Action> start(TimePoint now);
  // exitCode: the worker's, or -1 when killed by a signal.
  std::vector<Action> workerExited(int rank, int exitCode, TimePoint now);
  // The Launch just returned could not be carried out (e.g. the generation
  // record could not be written to a full store): no worker runs; a failure
  // like any other (backoff, then relaunch; too many in the window stop).
  std::vector<Action> launchFailed(const std::string& reason, TimePoint now);
  std::vector<Action> hostLost(const std::string& host, TimePoint now);
  // takenAt: when the cloud takes the host, if the notice said. The
  // on-demand checkpoint is waited for until then at the latest (after that
  // the host's workers are gone anyway), never longer than checkpointTimeout.
  std::vector<Action> preemptNotice(const std::string& host, TimePoint now,
                                    std::optional<TimePoint> takenAt = std::nullopt);
  // The usable machines changed (list file edited, an agent came up or went).
  // A running job morphs only if the plan would change.
  std::vector<Action> machinesChanged(std::vector<Machine> machines, TimePoint now);
  std::vector<Action> workerHung(int rank, TimePoint now);
  std::vector<Action> tick(TimePoint now);
  // The operator stops the job (SIGTERM to the manager): checkpoint if running,
  // then Stop with code 0; kill at once otherwise.
  std::vector<Action> stop(const std::string& reason, TimePoint now);
  // Keeps `host` out of every later plan (slow machine flagged by the detector).
  void excludeHost(const std::string& host) { excluded_.insert(host); }

  Phase phase() const { return phase_; }
  const Plan& plan() const { return plan_; }
  int generation() const { return generation_; }
  const std::set<int>& runningRanks() const { return running_; }

 private:
  std::vector<Action> relaunch(TimePoint now);
  std::vector<Action> failure(const std::string& reason, TimePoint now);
  std::vector<Action> beginMorph(TimePoint now);
  std::vector<Action> allExited(TimePoint now);
  std::set<std::string> unavailable() const;
  PlanRequest planRequest() const;
  Plan makeNextPlan() const;

  ControllerOptions options_;
  std::vector<Machine> machines_;
  std::function<std::optional<int64_t>()> latestCheckpoint_;
  Phase phase_ = Phase::kIdle;
  Plan plan_;
  int generation_ = 0;
  std::set<int> running_;
  std::set<std::string> leaving_;   // preempted: out of the next plans
  std::set<std::string> lost_;      // agent gone: out until the machine list changes
  std::set<std::string> excluded_;  // slow: out for good
  std::deque<TimePoint> failures_;
  TimePoint deadline_{};  // checkpointing: give up; backoff: relaunch
  std::string stopReason_;  // non-empty: stop once the checkpoint is done
};

}  // namespace varuna
