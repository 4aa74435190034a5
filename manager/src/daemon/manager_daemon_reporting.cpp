// ManagerDaemon's side of reporting: it makes the JobReporter (job_reporter.h),
// which does the reporting, and hands it the narrow view of the daemon it
// reads (reportStatus) and the one decision a report can lead to (a slow
// host excluded). The rest of the daemon is in manager_daemon.cpp.
#include "varuna/common/log.h"
#include "daemon/manager_daemon_impl.h"

namespace varuna {

void ManagerDaemon::Impl::createReporter(TimePoint startedAt, std::unique_ptr<StepLog> stepLog) {
  JobReporter::Options options;
  options.job = config_.job;
  options.stateDir = config_.stateDir;
  options.globalStore = config_.globalStore;
  options.address = advertisedAddress_;
  options.metricsAddress = metricsServer_ ? nlohmann::json(metricsServer_->address()) : nlohmann::json();
  options.globalBatch = config_.batchSize;
  options.slowThreshold = config_.slowThreshold;
  options.slowWindow = config_.slowWindow;
  options.excludeSlow = config_.excludeSlow;
  options.startedAt = startedAt;
  JobReporter::Hooks hooks;
  hooks.status = [this] { return reportStatus(); };
  hooks.excludeSlowHost = [this](const std::string& host) { excludeSlowHost(host); };
  reporter_ = std::make_unique<JobReporter>(std::move(options),
                                            JobReporter::Parts{*events_, metrics_, morph_, *checkpoints_, clock_},
                                            std::move(hooks), std::move(stepLog));
}

JobReporter::DaemonStatus ManagerDaemon::Impl::reportStatus() const {
  JobReporter::DaemonStatus status;
  status.phase = finished() ? (exitCode_ == 0 ? "finished" : "failed") : toString(controller_->phase());
  status.generation = controller_->generation();
  if (controller_->phase() != Phase::kIdle) status.plan = &controller_->plan();
  status.hosts = pool_->describe(clock_.now());
  status.absences = &pool_->absences();
  status.connections = listener_.stats();
  if (router_) status.connections["refused_messages"] = router_->refusedMessages();
  status.connections["handler_failures"] = guard_->failures();
  status.stopReason = stopReason_;
  return status;
}

void ManagerDaemon::Impl::updateHostMetrics(TimePoint now) {
  if (pool_ && reporter_) reporter_->hostsChanged(pool_->describe(now), pool_->absences());
}

void ManagerDaemon::Impl::excludeSlowHost(const std::string& host) {
  controller_->excludeHost(host);
  pool_->slow(host, clock_.now());  // until the machine list is written
}

}  // namespace varuna
