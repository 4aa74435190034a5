// ManagerDaemon's reporting: step reports (progress line, morph timing,
// metrics, the step log), checkpoint failures, slow-machine verdicts, the
// state file and the final summary. The rest of the daemon is in
// manager_daemon.cpp.
#include <unistd.h>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "daemon/launch_message.h"
#include "daemon/manager_daemon_impl.h"
#include "varuna/common/time_util.h"

namespace varuna {
namespace {

using nlohmann::json;

}  // namespace

// --- reporting ------------------------------------------------------------------------------

void ManagerDaemon::Impl::onStepReport(const proto::StepReport& report) {
  if (auto verdict = slowDetector_.add(report)) onSlowVerdict(*verdict);
  metrics_.stepReport(report);
  const Plan& plan = controller_->plan();
  const auto step = progress_.add(report, plan.worldSize());
  if (!step) return;
  const auto now = clock_.now();
  metrics_.stepCompleted(step->step, step->loss, step->maxStepSeconds, now);
  stepLog_->add(controller_->generation(), step->step, step->loss, step->maxStepSeconds, now, unixMillisNow());
  if (step->firstOfGeneration) morph_.firstStep(controller_->generation(), plan, step->step, now);
  progress_.print(*step, plan, checkpointText(now), now);
}

std::string ManagerDaemon::Impl::checkpointText(TimePoint now) const {
  const auto latest = checkpoints_->latest();
  if (!latest) return "no checkpoint yet";
  const TimePoint seen = checkpoints_->latestSeenAt();
  return strCat("last checkpoint step ", *latest,
                seen != TimePoint{} ? strCat(" (", static_cast<int>(secondsBetween(seen, now)), " s ago)") : std::string());
}

void ManagerDaemon::Impl::onCheckpointFailed(int rank, const proto::CheckpointFailed& failure) {
  const auto& placement = controller_->plan().placement;
  const std::string host = rank >= 0 && rank < static_cast<int>(placement.size()) ? placement[rank].host : "?";
  const std::string error = proto::boundedText(failure.error);
  ++checkpointFailures_;
  log::warn("rank ", rank, " on ", host, ": the checkpoint of step ", failure.step, " failed (", error,
            "); training goes on, the next checkpoint tries again");
  lastCheckpointFailure_ = {{"host", host}, {"rank", rank}, {"step", failure.step}, {"error", error}};
  metrics_.checkpointFailed();
  events_->write("checkpoint_failed", lastCheckpointFailure_);
}

void ManagerDaemon::Impl::onSlowVerdict(const std::vector<SlowMachine>& slow) {
  std::vector<std::string> hosts;
  for (const auto& s : slow) hosts.push_back(s.host);
  if (hosts == slowHosts_) return;
  try {
    ckpt::writeFileAtomic(config_.stateDir, "slow_machines.out", formatSlowMachines(slow));
    slowHosts_ = hosts;
  } catch (const std::exception& e) {  // a full disk: the next verdict (a window later) tries again
    log::error("cannot write ", config_.stateDir, "/slow_machines.out: ", proto::boundedText(e.what()));
    return;
  }
  json list = json::array();
  for (const auto& s : slow) {
    log::warn("slow machine: ", s.host, " (rank ", s.rank, ", stage ", s.stage, ") takes ", s.ratio(),
              "x the stage median per micro-batch", config_.excludeSlow ? "; it leaves at the next morph" : "");
    list.push_back({{"host", s.host}, {"rank", s.rank}, {"stage", s.stage}, {"ratio", s.ratio()}});
    if (config_.excludeSlow) {
      controller_->excludeHost(s.host);
      pool_->slow(s.host, clock_.now());  // until the machine list is written
    }
  }
  events_->write("slow_machines", {{"machines", list}});
  updateHostMetrics(clock_.now());
}

void ManagerDaemon::Impl::updateHostMetrics(TimePoint now) {
  if (pool_) metrics_.hosts(countHosts(pool_->describe(now), pool_->absences(), slowHosts_));
}

const json& ManagerDaemon::Impl::cachedPlanJson() {
  // 1000 ranks make a large object: build it once per generation.
  if (planJsonGeneration_ != controller_->generation()) {
    planJson_ = controller_->phase() == Phase::kIdle ? json() : planJson(controller_->plan());
    planJsonGeneration_ = controller_->generation();
  }
  return planJson_;
}

void ManagerDaemon::Impl::writeState() {
  if (!controller_ || !events_) return;
  stateFile_.write([this] { return stateJson(); }, clock_.now());
}

json ManagerDaemon::Impl::stateJson() {
  const auto now = clock_.now();
  const auto latest = checkpoints_->latest();
  json connections = listener_.stats();
  connections["handler_failures"] = guard_->failures();
  json hosts = pool_->describe(now);
  metrics_.hosts(countHosts(hosts, pool_->absences(), slowHosts_));  // once a second at least
  return {{"job", config_.job},
          {"pid", ::getpid()},
          {"address", advertisedAddress_},
          {"phase", finished() ? (exitCode_ == 0 ? "finished" : "failed") : toString(controller_->phase())},
          {"generation", controller_->generation()},
          {"plan", cachedPlanJson()},
          {"hosts", std::move(hosts)},
          {"last_checkpoint_step", latest ? json(*latest) : json()},
          {"checkpoint_failures", checkpointFailures_},
          {"last_checkpoint_failure", lastCheckpointFailure_},
          {"skipped_checkpoints", checkpoints_->skipped()},
          {"progress", progress_.toJson()},
          {"morphs", morph_.completed()},
          {"slow_machines", slowHosts_},
          {"uptime_s", secondsBetween(startedAt_, now)},
          {"updated", isoTimeNow()},
          {"stop_reason", stopReason_},
          {"connections", connections},
          {"global_store", config_.globalStore},
          {"metrics_address", metricsServer_ ? json(metricsServer_->address()) : json()},
          {"events", events_->path()},
          {"steps", stepLog_->path()}};
}

void ManagerDaemon::Impl::printSummary() {
  const auto latest = checkpoints_->latest();
  log::info("summary: job '", config_.job, "', last step ", progress_.lastStep(), ", loss ", progress_.lastLoss(), ", ",
            morph_.completed(), " morph(s), last checkpoint ", latest ? std::to_string(*latest) : "none", ", ran ",
            static_cast<int>(secondsBetween(startedAt_, clock_.now())), " s; events in ", events_->path());
}

}  // namespace varuna
