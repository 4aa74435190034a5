// MorphController's salvage rounds (docs/salvage.md): a generation ended by a
// sudden loss is checkpointed from the survivors' memory when every stage
// still has a survivor holding one common step. Kept apart from the morph and
// failure rules in morph_controller.cpp; same class, same single thread.
#include <algorithm>

#include "varuna/common/errors.h"
#include "varuna/common/log.h"
#include "varuna/common/worker_exit.h"
#include "varuna/manager/morph_controller.h"

namespace varuna {
std::vector<Action> MorphController::beginSalvage(const std::string& reason, TimePoint now) {
  phase_ = Phase::kSalvaging;
  deadline_ = now + options_.salvageTimeout;
  salvageWriters_.clear();
  salvageCleanupOrdered_ = false;
  salvageCrashCounted_ = false;
  std::vector<Action> out{action::SalvageStop{reason}};
  auto decided = decideIfAllReported(now);  // reports may have come before the loss was known here
  out.insert(out.end(), decided.begin(), decided.end());
  return out;
}

std::vector<Action> MorphController::salvageReady(SalvageReport report, TimePoint now) {
  const int rank = report.rank, stage = report.stage;
  if (!options_.salvage || !running_.count(rank)) return {};
  if (phase_ != Phase::kRunning && phase_ != Phase::kCheckpointing && phase_ != Phase::kSalvaging) return {};
  if (stage < 0 || stage >= plan_.stages) {
    log::warn("ignoring rank ", rank, "'s salvage report: stage ", stage, " is not one of the plan's ", plan_.stages);
    return {};
  }
  for (const auto& p : plan_.placement) {
    if (p.rank == rank) report.host = p.host;
  }
  salvageReports_[rank] = std::move(report);
  if (phase_ == Phase::kSalvaging) return decideIfAllReported(now);
  // The first sign of the loss may be a survivor's report: it lost a peer.
  return failure(strCat("rank ", rank, " lost a peer"), now, /*counts=*/false);
}

std::vector<Action> MorphController::decideIfAllReported(TimePoint now) {
  for (int rank : running_) {
    if (!salvageReports_.count(rank) && !salvageSilent_.count(rank)) return {};
  }
  return decideSalvage(now);
}

std::vector<Action> MorphController::decideSalvage(TimePoint now) {
  std::vector<SalvageReport> reports;
  for (const auto& [rank, report] : salvageReports_) {
    if (running_.count(rank) && !salvageSilent_.count(rank)) reports.push_back(report);
  }
  const auto choice = chooseSalvage(reports, plan_.stages, leaving_);
  if (!choice) return abandonSalvage(whyNoSalvage(reports, plan_.stages), now);
  phase_ = Phase::kSalvageWriting;
  // A writer writes a stage's whole share, as much as an on-demand checkpoint.
  deadline_ = now + std::max(options_.salvageTimeout, options_.checkpointTimeout);
  salvageWriters_ = std::set<int>(choice->writers.begin(), choice->writers.end());
  return {action::SalvageWrite{choice->step, choice->writers, choice->exchange, choice->finishing}};
}

std::vector<Action> MorphController::salvageExit(int rank, int exitCode, TimePoint now) {
  // A crash (not the echo of the loss) counts towards --max_failures even when
  // a survivor's report started the salvage before the crash was known here.
  const auto exit = WorkerExit::fromCode(exitCode);
  if (phase_ == Phase::kSalvaging && exit.causedHere() && !salvageCrashCounted_) {
    salvageCrashCounted_ = true;
    if (auto givingUp = countFailure(strCat("rank ", rank, " exited with ", exit.describe()), now)) {
      return *givingUp;
    }
  }
  if (phase_ == Phase::kSalvaging) return decideIfAllReported(now);  // one survivor fewer to wait for
  if (salvageWriters_.erase(rank) && exit.kind() != ExitKind::kSalvaged) {
    return abandonSalvage(strCat("writer rank ", rank, " exited with ", exit.describe()), now);
  }
  return salvageWritesProgress(now);
}

std::vector<Action> MorphController::salvageWritesProgress(TimePoint now) {
  if (running_.empty()) return salvageComplete(now);
  if (!salvageWriters_.empty() || salvageCleanupOrdered_) return {};
  for (int rank : running_) {
    if (salvageSilent_.count(rank)) {
      salvageCleanupOrdered_ = true;
      return {action::KillAll{strCat("the salvage is written; killing hung rank ", rank, " and what is left")}};
    }
  }
  return {};  // the others were ordered out and are on their way (the deadline kills them if not)
}

std::vector<Action> MorphController::salvageComplete(TimePoint now) {
  // Every writer wrote its share (the last one completed the checkpoint) and
  // every other rank is gone: the next generation resumes from it, unless
  // the operator asked to stop meanwhile.
  if (!stopReason_.empty()) {
    phase_ = Phase::kFinished;
    return {action::Stop{stopReason_, 0}};
  }
  salvageDone_ = true;
  return relaunch();
}

std::vector<Action> MorphController::salvageDeadline(TimePoint now) {
  if (phase_ == Phase::kSalvaging) {
    // Whoever has not reported is not waited for any longer (busy outside
    // the runtime, or stuck): decide with the reports in; they are killed
    // once the writes are done.
    for (int rank : running_) {
      if (!salvageReports_.count(rank)) salvageSilent_.insert(rank);
    }
    return decideSalvage(now);
  }
  if (salvageWriters_.empty()) {
    if (salvageCleanupOrdered_) return {};  // the kill's exits are on their way
    salvageCleanupOrdered_ = true;
    return {action::KillAll{"the salvage is written; killing the ranks still running"}};
  }
  const auto limit = std::max(options_.salvageTimeout, options_.checkpointTimeout);
  return abandonSalvage(strCat("the salvage writes did not finish within ", limit.count() / 1000.0, " s"), now);
}

std::vector<Action> MorphController::salvageHostLost(const std::string& host, TimePoint now) {
  for (const auto& p : plan_.ranksOn(host)) {
    if (salvageWriters_.count(p.rank)) {
      return abandonSalvage(strCat("host ", host, " of salvage writer rank ", p.rank, " was lost"), now);
    }
  }
  if (phase_ == Phase::kSalvaging) return decideIfAllReported(now);
  return salvageWritesProgress(now);
}

std::vector<Action> MorphController::abandonSalvage(const std::string& why, TimePoint now) {
  log::warn("salvage abandoned (", why, "): falling back to the latest complete checkpoint");
  salvageReports_.clear();
  salvageWriters_.clear();
  salvageSilent_.clear();
  phase_ = Phase::kStopping;
  std::vector<Action> out{action::SalvageAbandoned{why}};
  if (running_.empty()) {
    auto next = allExited(now);
    out.insert(out.end(), next.begin(), next.end());
  } else {
    out.push_back(action::KillAll{"salvage abandoned: " + why});
  }
  return out;
}

}  // namespace varuna
