#include "varuna/manager/morph_controller.h"

#include <algorithm>

#include "varuna/common/errors.h"
#include "varuna/common/worker_exit.h"
#include "varuna/common/log.h"

namespace varuna {

const char* toString(Phase phase) {
  switch (phase) {
    case Phase::kIdle: return "idle";
    case Phase::kRunning: return "running";
    case Phase::kCheckpointing: return "checkpointing";
    case Phase::kStopping: return "stopping";
    case Phase::kBackoff: return "backoff";
    case Phase::kWaitingForMachines: return "waiting-for-machines";
    case Phase::kPlanning: return "planning";
    case Phase::kSalvaging: return "salvaging";
    case Phase::kSalvageWriting: return "salvage-writing";
    case Phase::kFinished: return "finished";
    case Phase::kFailed: return "failed";
  }
  return "?";
}

MorphController::MorphController(ControllerOptions options, std::vector<Machine> machines,
                                 std::function<std::optional<int64_t>()> latestCheckpoint)
    : options_(options),
      machines_(std::move(machines)),
      latestCheckpoint_(std::move(latestCheckpoint)),
      generation_(options.firstGeneration - 1) {}

std::set<std::string> MorphController::unavailable() const {
  std::set<std::string> out = excluded_;
  out.insert(leaving_.begin(), leaving_.end());
  out.insert(lost_.begin(), lost_.end());
  return out;
}

PlanRequest MorphController::planRequest() const {
  PlanRequest request;
  request.machines = machines_;
  request.stages = options_.stages;
  request.globalBatch = options_.globalBatch;
  request.chunkSize = options_.chunkSize;
  request.excludedHosts = unavailable();
  return request;
}

Plan MorphController::makeNextPlan() const {
  return options_.planner ? options_.planner(planRequest()) : makePlan(planRequest());
}

std::vector<Action> MorphController::start(TimePoint now) { return relaunch(); }

std::vector<Action> MorphController::relaunch() {
  recheckPlan_ = false;  // the launch plans anew
  try {
    plan_ = makeNextPlan();
  } catch (const PlanPending&) {
    phase_ = Phase::kPlanning;  // planReady() comes back here
    return {};
  } catch (const ConfigError& e) {
    if (generation_ < options_.firstGeneration || !options_.morphing) {
      phase_ = Phase::kFailed;
      return {action::Stop{e.what(), kExitConfigError}};
    }
    phase_ = Phase::kWaitingForMachines;  // a machine-list change retries
    log::warn("waiting for machines: ", e.what());
    return {};
  }
  ++generation_;
  running_.clear();
  for (const auto& p : plan_.placement) running_.insert(p.rank);
  phase_ = Phase::kRunning;
  salvageReports_.clear();
  salvageSilent_.clear();
  lastLaunchSalvaged_ = salvageDone_;
  salvageDone_ = false;
  const auto resume = latestCheckpoint_();
  return {action::Launch{plan_, resume.value_or(-1), generation_}};
}

std::vector<Action> MorphController::beginMorph(TimePoint now) {
  if (phase_ != Phase::kRunning) return {};  // coalesced into the morph under way
  phase_ = Phase::kCheckpointing;
  deadline_ = now + options_.checkpointTimeout;
  return {action::Checkpoint{}};
}

std::optional<std::vector<Action>> MorphController::countFailure(const std::string& reason, TimePoint now) {
  failures_.push_back(now);
  while (!failures_.empty() && now - failures_.front() > options_.failureWindow) failures_.pop_front();
  if (static_cast<int>(failures_.size()) <= options_.maxFailures) return std::nullopt;
  phase_ = Phase::kFailed;
  const auto minutes = std::chrono::duration_cast<std::chrono::minutes>(options_.failureWindow).count();
  return std::vector<Action>{
      action::KillAll{reason},
      action::Stop{strCat(failures_.size(), " failures within ", minutes, " min, the last: ", reason,
                          "; giving up instead of restarting in a loop"),
                   1}};
}

std::vector<Action> MorphController::failure(const std::string& reason, TimePoint now, bool counts) {
  if (phase_ == Phase::kFinished || phase_ == Phase::kFailed) return {};
  if (!options_.morphing) {
    phase_ = Phase::kFailed;
    return {action::KillAll{reason}, action::Stop{reason + " (morphing is off: --no_morphing)", 1}};
  }
  if (counts) {
    if (auto givingUp = countFailure(reason, now)) return *givingUp;
  }
  if (options_.salvage && (phase_ == Phase::kRunning || phase_ == Phase::kCheckpointing) && !running_.empty()) {
    if (!nothingToSalvage()) return beginSalvage(reason, now);
    log::info("nothing to salvage (", reason, "): no rank got past the checkpoint this generation resumed from; ",
              "relaunching from it at once");
  }
  if (salvaging()) return {};  // the salvage under way ends the generation (or gives up and kills)
  const bool alreadyStopping = phase_ == Phase::kStopping || phase_ == Phase::kBackoff;
  phase_ = Phase::kStopping;
  if (running_.empty()) return allExited(now);
  if (alreadyStopping) return {};
  return {action::KillAll{reason}};
}

std::vector<Action> MorphController::allExited(TimePoint now) {
  if (!stopReason_.empty() && (phase_ == Phase::kCheckpointing || phase_ == Phase::kStopping)) {
    phase_ = Phase::kFinished;
    return {action::Stop{stopReason_, 0}};
  }
  if (phase_ == Phase::kCheckpointing) return relaunch();
  if (phase_ == Phase::kStopping) {
    // Exponential backoff over the recent failures.
    auto wait = options_.restartBackoff;
    for (size_t i = 1; i < failures_.size(); ++i) wait *= 2;
    phase_ = Phase::kBackoff;
    deadline_ = now + wait;
    if (wait.count() == 0) return relaunch();
  }
  return {};
}

std::vector<Action> MorphController::workerExited(int rank, int exitCode, TimePoint now) {
  if (!running_.erase(rank)) return {};  // an earlier generation's straggler
  if (salvaging()) return salvageExit(rank, exitCode, now);
  if (exitCode == kExitConfigError && phase_ != Phase::kStopping && phase_ != Phase::kBackoff) {
    // Bad arguments or model: every relaunch would fail the same way.
    phase_ = Phase::kFailed;
    const std::string reason = strCat("rank ", rank, " exited with a configuration error (code ", kExitConfigError,
                                      "); see its message");
    return {action::KillAll{reason}, action::Stop{reason, kExitConfigError}};
  }
  if (phase_ == Phase::kRunning) {
    if (exitCode == kExitCheckpointed) {
      // Someone signalled the workers directly: treat it as a morph.
      phase_ = Phase::kCheckpointing;
      deadline_ = now + options_.checkpointTimeout;
    } else if (exitCode != 0) {
      // Storage faults (74) and a superseded generation (76) land here too: a
      // relaunch from the latest complete checkpoint can succeed.
      const auto exit = WorkerExit::fromCode(exitCode);
      return failure(strCat("rank ", rank, " exited with ", exit.describe()), now, exit.causedHere());
    } else if (running_.empty()) {
      phase_ = Phase::kFinished;
      return {action::Stop{"training finished", 0}};
    } else {
      return {};
    }
  }
  if (phase_ == Phase::kCheckpointing && exitCode != kExitCheckpointed && exitCode != 0) {
    const auto exit = WorkerExit::fromCode(exitCode);
    return failure(strCat("rank ", rank, " exited with ", exit.describe(), " during the on-demand checkpoint"), now,
                   exit.causedHere());
  }
  if (running_.empty()) return allExited(now);
  return {};
}

std::vector<Action> MorphController::launchFailed(const std::string& reason, TimePoint now) {
  if (phase_ != Phase::kRunning) return {};
  running_.clear();  // nothing was started
  return failure(reason, now);
}

std::vector<Action> MorphController::hostLost(const std::string& host, TimePoint now) {
  lost_.insert(host);
  bool hadWorkers = false;  // its workers are gone with it
  for (const auto& p : plan_.ranksOn(host)) hadWorkers |= running_.erase(p.rank) > 0;
  if (salvaging()) return salvageHostLost(host, now);
  switch (phase_) {
    case Phase::kRunning:
      if (!hadWorkers) return {};  // e.g. a preempted host leaving after the morph
      return failure(strCat("host ", host, " was lost"), now, /*counts=*/false);
    case Phase::kCheckpointing:
      // A preempted host may go once its workers are done; any other loss
      // means the checkpoint cannot complete.
      if (!leaving_.count(host)) {
        return failure(strCat("host ", host, " was lost during the checkpoint"), now, /*counts=*/false);
      }
      return running_.empty() ? allExited(now) : std::vector<Action>{};
    case Phase::kStopping:
      return running_.empty() ? allExited(now) : std::vector<Action>{};
    default:
      return {};
  }
}

std::vector<Action> MorphController::preemptNotice(const std::string& host, TimePoint now,
                                                   std::optional<TimePoint> takenAt) {
  leaving_.insert(host);
  if (!options_.morphing) {
    log::warn("preemption notice for ", host, " ignored: morphing is off (--no_morphing)");
    return {};
  }
  if (plan_.ranksOn(host).empty()) return {};  // no worker there: the next plan leaves it out anyway
  if (phase_ == Phase::kCheckpointing && takenAt) {
    deadline_ = std::min(deadline_, std::max(now, *takenAt));  // a later notice may be more urgent
    return {};
  }
  auto actions = beginMorph(now);
  if (phase_ == Phase::kCheckpointing && takenAt) deadline_ = std::min(deadline_, std::max(now, *takenAt));
  return actions;
}

std::vector<Action> MorphController::machinesChanged(std::vector<Machine> machines, TimePoint now) {
  std::set<std::string> before;
  for (const auto& m : machines_) before.insert(m.host);
  for (const auto& m : machines) {
    if (!before.count(m.host)) {  // (re-)added: whatever we knew of it is stale
      leaving_.erase(m.host);
      lost_.erase(m.host);
    }
  }
  const bool changed = machines != machines_ || readmitted_;
  readmitted_ = false;
  machines_ = std::move(machines);
  if (!changed || !options_.morphing) return {};
  if (phase_ == Phase::kWaitingForMachines || phase_ == Phase::kPlanning) return relaunch();
  if (phase_ == Phase::kRunning) return morphIfPlanChanges(now);
  return beginMorph(now);
}

namespace {
bool sameShape(const Plan& a, const Plan& b) {
  return a.stages == b.stages && a.replicas == b.replicas && a.stageToRankMap == b.stageToRankMap &&
         a.chunkSize == b.chunkSize && a.schedule == b.schedule && a.pieceCosts == b.pieceCosts;
}

// Every host the plan uses is still usable with the slots it takes there.
bool stillFits(const Plan& plan, const PlanRequest& usable) {
  for (const auto& host : plan.hosts) {
    if (usable.excludedHosts.count(host)) return false;
    auto m = std::find_if(usable.machines.begin(), usable.machines.end(),
                          [&](const Machine& machine) { return machine.host == host; });
    if (m == usable.machines.end() || m->slots < static_cast<int>(plan.ranksOn(host).size())) return false;
  }
  return true;
}
}  // namespace

std::vector<Action> MorphController::morphIfPlanChanges(TimePoint now) {
  recheckPlan_ = false;
  try {
    const Plan next = makeNextPlan();
    if (sameShape(next, plan_) && (next.placement == plan_.placement || stillFits(plan_, planRequest()))) {
      return {};  // a host back (or new) that the plan would not use better: no morph for nothing
    }
  } catch (const PlanPending&) {
    recheckPlan_ = true;  // keeps running on the current plan until planReady()
    return {};
  } catch (const ConfigError&) {
    // Too few machines for any plan: morph anyway; the relaunch waits for machines.
  }
  return beginMorph(now);
}

std::vector<Action> MorphController::planReady(TimePoint now) {
  if (phase_ == Phase::kPlanning) return relaunch();
  if (phase_ == Phase::kRunning && recheckPlan_) return morphIfPlanChanges(now);
  return {};
}

void MorphController::readmitHost(const std::string& host) {
  const size_t erased = leaving_.erase(host) + lost_.erase(host) + excluded_.erase(host);
  readmitted_ |= erased > 0;
}

std::vector<Action> MorphController::workerHung(int rank, TimePoint now, const std::string& why) {
  if (!running_.count(rank)) return {};
  // A hung rank reports nothing: a salvage goes on without it (and kills it
  // once the writes are done); the salvage's own deadline bounds the rest.
  if (options_.salvage) salvageSilent_.insert(rank);
  if (salvaging()) return phase_ == Phase::kSalvaging ? decideIfAllReported(now) : std::vector<Action>{};
  return failure(why.empty() ? strCat("rank ", rank, " stopped sending heartbeats") : why, now);
}

std::vector<Action> MorphController::stop(const std::string& reason, TimePoint now) {
  if (phase_ == Phase::kFinished || phase_ == Phase::kFailed) return {};
  const bool again = !stopReason_.empty();
  stopReason_ = reason;
  // A salvage under way writes the step the survivors hold: let it finish
  // (its rounds have deadlines), then stop instead of relaunching.
  if (salvaging() && !again) return {};
  if (phase_ == Phase::kRunning && !running_.empty()) {
    phase_ = Phase::kCheckpointing;
    deadline_ = now + options_.checkpointTimeout;
    return {action::Checkpoint{}};
  }
  if (again || running_.empty() || phase_ != Phase::kCheckpointing) {
    phase_ = running_.empty() ? Phase::kFinished : Phase::kStopping;
    if (running_.empty()) return {action::KillAll{reason}, action::Stop{reason, 0}};
    return {action::KillAll{reason}};
  }
  return {};  // already checkpointing: stop when it is done
}

std::vector<Action> MorphController::tick(TimePoint now) {
  if (phase_ == Phase::kCheckpointing && now >= deadline_) {
    return failure("the on-demand checkpoint did not finish in time", now);
  }
  if (phase_ == Phase::kBackoff && now >= deadline_) return relaunch();
  if (salvaging() && now >= deadline_) return salvageDeadline(now);
  return {};
}

}  // namespace varuna
