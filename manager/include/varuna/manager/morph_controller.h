// MorphController: the manager's decisions, as a pure state machine.
//
// The daemon feeds it events (worker exits reported by agents, lost agent
// connections, preemption notices, machine-list changes, heartbeat timeouts,
// clock ticks) with the current time, and carries out the actions it returns
// (launch a plan, SIGUSR1 everyone, kill everyone, stop). It reads no clock
// and touches no socket or file (it only logs its decisions), so every
// scenario is a unit test with a fake clock.
// Not thread-safe: the daemon's single event-loop thread owns it.
//
// Lifecycle of a job generation:
//   running --preempt / list change--> checkpointing --all exited--> relaunch
//   running --failure--> stopping (kill all) --all exited--> backoff --> relaunch
//   running --failure, salvage on--> salvaging (survivors report their step)
//     --a step every stage holds--> salvage-writing (one survivor per stage
//     writes it) --all exited--> relaunch; no such step, a writer failing or
//     the salvage timeout: stopping (kill all), as without salvage
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
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "varuna/manager/planner.h"
#include "varuna/manager/salvage_choice.h"

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
// Salvage (docs/salvage.md): every worker still running stops, interrupting
// any wait on a peer, and reports the step it holds (salvageReady).
struct SalvageStop {
  std::string reason;
};
// `writers[s]` writes stage s's share of step `step`; every other rank of
// the generation is ordered out. The writers in `finishing` first apply the
// step from its relayed `exchange` result (salvage_choice.h).
struct SalvageWrite {
  int64_t step = 0;
  std::vector<int> writers;
  std::vector<double> exchange;
  std::vector<int> finishing;
};
// Salvage gave up (no common step, a writer failed, the timeout): the job
// falls back to the latest complete checkpoint (a KillAll follows if ranks run).
struct SalvageAbandoned {
  std::string reason;
};
struct Stop {  // the manager is done
  std::string reason;
  int exitCode = 0;
};
}  // namespace action
using Action = std::variant<action::Launch, action::Checkpoint, action::KillAll, action::Stop, action::SalvageStop,
                            action::SalvageWrite, action::SalvageAbandoned>;

// kPlanning: waiting for an asynchronous planner's plan (see PlanPending).
enum class Phase {
  kIdle, kRunning, kCheckpointing, kStopping, kBackoff, kWaitingForMachines, kPlanning, kSalvaging,
  kSalvageWriting, kFinished, kFailed
};
const char* toString(Phase phase);

// Thrown by an asynchronous planner (run_varuna's AsyncPlanner, which runs
// AutoConfig off the event loop): the plan for this request is being
// computed. The controller waits for it (Phase::kPlanning, or keeps running
// when it was only asking whether a machine change alters the plan) and its
// owner calls planReady() when the planner has the answer; the planner then
// returns it (or throws its ConfigError) for the same request.
struct PlanPending : std::exception {
  const char* what() const noexcept override { return "the plan is being computed"; }
};

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
  // A generation that ends on a sudden loss is salvaged from the survivors'
  // memory when it can be (docs/salvage.md); each of its two rounds (the
  // reports, the writes) must finish within salvageTimeout.
  bool salvage = false;
  std::chrono::milliseconds salvageTimeout{std::chrono::seconds(30)};
  // Whether some rank of the running generation has finished a step past
  // the checkpoint it resumed from. A loss before that leaves nothing to
  // salvage: the job relaunches from that checkpoint at once instead of
  // waiting for reports from ranks still starting up. Empty: not known
  // (every loss starts a salvage).
  std::function<bool()> generationProgressed;
  // Turns the machines at hand into a plan, at start and at every morph; may
  // throw ConfigError (no plan fits: wait for machines). Null: makePlan with
  // `stages` and `chunkSize`. AutoConfig plugs in here (autoConfigPlanner),
  // choosing P and the micro-batch itself; it is called on the controller's
  // thread, so it must be quick and must not block: a slow planner computes
  // elsewhere and throws PlanPending until it has the plan.
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
  // `why`: what showed it (default: its heartbeats stopped), for the KillAll's reason.
  std::vector<Action> workerHung(int rank, TimePoint now, const std::string& why = {});
  // A worker of the generation in salvage mode reports the step it holds
  // (-1: none), and what it could finish; the controller fills in its host.
  std::vector<Action> salvageReady(SalvageReport report, TimePoint now);
  std::vector<Action> salvageReady(int rank, int stage, int64_t step, TimePoint now) {
    return salvageReady(SalvageReport{rank, stage, step, {}, -1, {}}, now);
  }
  // The asynchronous planner has a plan (or an error) for a request it threw
  // PlanPending for: a launch waiting for it goes ahead, a machine change
  // that was waiting for it morphs if the plan changes.
  std::vector<Action> planReady(TimePoint now);
  std::vector<Action> tick(TimePoint now);
  // The operator stops the job (SIGTERM to the manager): checkpoint if running,
  // then Stop with code 0; kill at once otherwise.
  std::vector<Action> stop(const std::string& reason, TimePoint now);
  // Keeps `host` out of every later plan (slow machine flagged by the detector).
  void excludeHost(const std::string& host) { excluded_.insert(host); }
  // `host` may be planned on again (it was lost, preempted or excluded as
  // slow, and is back): forgets all three. The next machinesChanged then
  // plans even if the machines are the same (the host may never have left
  // them), and morphs only if the plan improves.
  void readmitHost(const std::string& host);

  Phase phase() const { return phase_; }
  const Plan& plan() const { return plan_; }
  int generation() const { return generation_; }
  const std::set<int>& runningRanks() const { return running_; }
  // The launch being returned follows a salvage (its checkpoint is the salvaged step).
  bool lastLaunchSalvaged() const { return lastLaunchSalvaged_; }

 private:
  std::vector<Action> relaunch();
  // Kill-all, backoff, relaunch. `counts`: whether it counts towards
  // --max_failures. A job is given up only for failures that would repeat
  // (a rank crashing or hanging); consequences of the environment (a host
  // lost, a rank that lost a peer or was superseded) do not count: machines
  // that come and go must never stop an unattended job.
  std::vector<Action> failure(const std::string& reason, TimePoint now, bool counts = true);
  // Counts a failure of the job's own; the actions that give up if it makes
  // too many in the window.
  std::optional<std::vector<Action>> countFailure(const std::string& reason, TimePoint now);
  std::vector<Action> beginMorph(TimePoint now);
  std::vector<Action> allExited(TimePoint now);
  // Running, the machines changed: morph if the plan would change.
  std::vector<Action> morphIfPlanChanges(TimePoint now);
  // Salvage (morph_controller_salvage.cpp).
  std::vector<Action> beginSalvage(const std::string& reason, TimePoint now);
  std::vector<Action> salvageExit(int rank, int exitCode, TimePoint now);
  std::vector<Action> salvageHostLost(const std::string& host, TimePoint now);
  std::vector<Action> decideIfAllReported(TimePoint now);
  // Salvage-writing: relaunch once every rank is gone; once the writers are
  // done, hung ranks that will not go by themselves are killed.
  std::vector<Action> salvageWritesProgress(TimePoint now);
  // A round's deadline: reports missing -> decide with those in; writes
  // done but ranks left -> kill them; writes missing -> abandon.
  std::vector<Action> salvageDeadline(TimePoint now);
  // After the writes: stop if a stop was asked for meanwhile, else relaunch.
  std::vector<Action> salvageComplete(TimePoint now);
  std::vector<Action> decideSalvage(TimePoint now);
  std::vector<Action> abandonSalvage(const std::string& why, TimePoint now);
  bool salvaging() const { return phase_ == Phase::kSalvaging || phase_ == Phase::kSalvageWriting; }
  // No rank of the generation got past the checkpoint it resumed from.
  bool nothingToSalvage() const { return options_.generationProgressed && !options_.generationProgressed(); }
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
  std::set<std::string> lost_;      // agent gone: out until it is back in the machines or readmitted
  std::set<std::string> excluded_;  // slow: out until readmitted
  bool readmitted_ = false;         // a host was readmitted: the next machinesChanged plans again
  std::deque<TimePoint> failures_;
  TimePoint deadline_{};  // checkpointing: give up; backoff: relaunch
  std::string stopReason_;  // non-empty: stop once the checkpoint is done
  bool recheckPlan_ = false;  // running: a machine change waits for the planner (planReady)
  std::map<int, SalvageReport> salvageReports_;  // salvaging: by rank
  std::set<int> salvageWriters_;                 // salvage-writing: writers not done yet
  std::set<int> salvageSilent_;                  // hung ranks: not waited for, killed after the writes
  bool salvageCleanupOrdered_ = false;           // the KillAll of what is left after the writes went out
  bool salvageCrashCounted_ = false;             // a crash seen during the salvage counted as a failure
  bool salvageDone_ = false;        // the salvaged checkpoint is complete: the next launch resumes from it
  bool lastLaunchSalvaged_ = false;
};

}  // namespace varuna
