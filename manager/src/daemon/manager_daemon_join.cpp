// run_varuna's side of hosts that join by themselves (agent_pool.h, join.h):
// their hellos and the join credential file.
#include <filesystem>

#include "daemon/job_setup.h"
#include "daemon/manager_daemon_impl.h"
#include "varuna/common/log.h"
#include "varuna/common/time_util.h"

namespace varuna {

namespace fs = std::filesystem;

void ManagerDaemon::Impl::joinHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
  pool_->join(connection, hello);
}

void ManagerDaemon::Impl::preemptedHostLeft(const std::string& host) {
  workers_.orderHostOut(host, controller_->plan(), controller_->generation(),
                        strCat("host ", host, " left after its preemption notice"));
  updateHostMetrics(clock_.now());
  if (phase_ == DaemonPhase::kStartingAgents) return maybeStartJob();
  if (finished()) return;
  // Not a failure: the controller expects the host to go (a notice named it).
  apply(controller_->hostLost(host, clock_.now()));
  usableMachinesChanged();
}

void ManagerDaemon::Impl::renewJoinCredentialIfDue() {
  const int64_t now = unixSecondsNow();
  const auto ttl = static_cast<int64_t>(config_.joinTtlH * 3600);
  if (joinCredentialWrittenUnixS_ != 0 && now - joinCredentialWrittenUnixS_ < std::max<int64_t>(ttl / 2, 1)) return;
  writeJoinCredential(config_.stateDir, token_, now + ttl);
  if (joinCredentialWrittenUnixS_ != 0) {
    log::info("renewed the join credential in ", (fs::path(config_.stateDir) / "join_token").string(),
              " (the earlier one stays valid until it expires)");
  }
  joinCredentialWrittenUnixS_ = now;
}

}  // namespace varuna
