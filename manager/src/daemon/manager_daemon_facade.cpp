// ManagerDaemon's public methods: each forwards to its Impl
// (manager_daemon_impl.h), so the daemon's parts stay private to
// varuna_manager_runtime.
#include "varuna/manager/manager_daemon.h"

#include "daemon/manager_daemon_impl.h"

namespace varuna {

ManagerDaemon::ManagerDaemon(boost::asio::io_context& io, JobConfig config, std::unique_ptr<HostLauncher> launcher,
                             DaemonOptions options)
    : impl_(std::make_unique<Impl>(io, std::move(config), std::move(launcher), options)) {}
ManagerDaemon::~ManagerDaemon() = default;

void ManagerDaemon::start() { impl_->start(); }
void ManagerDaemon::requestStop(const std::string& reason) { impl_->requestStop(reason); }
int ManagerDaemon::exitCode() const { return impl_->exitCode(); }
DaemonPhase ManagerDaemon::phase() const { return impl_->phase(); }
uint16_t ManagerDaemon::port() const { return impl_->port(); }
uint16_t ManagerDaemon::metricsPort() const { return impl_->metricsPort(); }
const JobMetrics& ManagerDaemon::metrics() const { return impl_->metrics(); }
void ManagerDaemon::setStoreScanner(StoreScanner scanner) { impl_->setStoreScanner(std::move(scanner)); }
size_t ManagerDaemon::pendingConnections() const { return impl_->pendingConnections(); }
size_t ManagerDaemon::launchThreads() const { return impl_->launchThreads(); }
uint64_t ManagerDaemon::acceptFailures() const { return impl_->acceptFailures(); }
uint64_t ManagerDaemon::tcpConnectionsAccepted() const { return impl_->tcpConnectionsAccepted(); }
uint64_t ManagerDaemon::localConnectionsAccepted() const { return impl_->localConnectionsAccepted(); }
uint64_t ManagerDaemon::handlerFailures() const { return impl_->handlerFailures(); }
bool ManagerDaemon::stateWriteFailing() const { return impl_->stateWriteFailing(); }
bool ManagerDaemon::stateWriting() const { return impl_->stateWriting(); }
size_t ManagerDaemon::backgroundJobs() const { return impl_->backgroundJobs(); }

}  // namespace varuna
