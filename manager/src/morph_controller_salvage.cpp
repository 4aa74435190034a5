// MorphController's salvage rounds (docs/salvage.md): a generation ended by a
// sudden loss is checkpointed from the survivors' memory when every stage
// still has a survivor holding one common step. Kept apart from the morph and
// failure rules in morph_controller.cpp; same class, same single thread.
#include <algorithm>

#include "varuna/common/errors.h"
#include "varuna/common/log.h"
#include "varuna/manager/morph_controller.h"

namespace varuna {

std::vector<Action> MorphController::beginSalvage(const std::string& reason, TimePoint now) {
  phase_ = Phase::kSalvaging;
  deadline_ = now + options_.salvageTimeout;
  salvageWriters_.clear();
  std::vector<Action> out{action::SalvageStop{reason}};
  auto decided = decideIfAllReported(now);  // reports may have come before the loss was known here
  out.insert(out.end(), decided.begin(), decided.end());
  return out;
}

std::vector<Action> MorphController::salvageReady(int rank, int stage, int64_t step, TimePoint now) {
  if (!options_.salvage || !running_.count(rank)) return {};
  if (phase_ != Phase::kRunning && phase_ != Phase::kCheckpointing && phase_ != Phase::kSalvaging) return {};
  std::string host;
  for (const auto& p : plan_.placement) {
    if (p.rank == rank) host = p.host;
  }
  salvageReports_[rank] = SalvageReport{rank, stage, step, host};
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
  deadline_ = now + options_.salvageTimeout;
  salvageWriters_ = std::set<int>(choice->writers.begin(), choice->writers.end());
  salvageCleanupOrdered_ = false;
  return {action::SalvageWrite{choice->step, choice->writers}};
}

std::vector<Action> MorphController::salvageExit(int rank, int exitCode, TimePoint now) {
  if (phase_ == Phase::kSalvaging) return decideIfAllReported(now);  // one survivor fewer to wait for
  if (salvageWriters_.erase(rank) && exitCode != kExitSalvaged) {
    return abandonSalvage(strCat("writer rank ", rank, " exited with ", describeExit(exitCode)), now);
  }
  return salvageWritesProgress(now);
}

std::vector<Action> MorphController::salvageWritesProgress(TimePoint now) {
  if (running_.empty()) {
    // Every writer wrote its share (the last one completed the checkpoint)
    // and every other rank is gone: the next generation resumes from it.
    salvageDone_ = true;
    return relaunch(now);
  }
  if (!salvageWriters_.empty() || salvageCleanupOrdered_) return {};
  for (int rank : running_) {
    if (salvageSilent_.count(rank)) {
      salvageCleanupOrdered_ = true;
      return {action::KillAll{strCat("the salvage is written; killing hung rank ", rank, " and what is left")}};
    }
  }
  return {};  // the others were ordered out and are on their way
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
