// ManagerDaemon::Impl: run_varuna's event loop, behind the public
// ManagerDaemon (varuna/manager/manager_daemon.h), which only forwards to it.
// It owns the pure MorphController and carries out its actions (launch,
// checkpoint, kill, stop); everything else is a part with one job, each
// beside it in manager/src/daemon/:
//  - ControlListener: the TCP listener, connections before their hello
//    (capped, with a deadline), the token check, accept backoff;
//  - PeerRouter: where a connection goes after its hello (by role), stale
//    workers ordered out, a worker's Welcome; it calls the daemon as its Sink;
//  - AgentPool: the host agents (start-ups on launch threads, heartbeats both
//    ways, losses) and HostAbsences, when hosts that are out come back;
//  - WorkerRegistry: the running generation's workers and their exit orders;
//  - LivenessWatchdog: silent and hung ranks;
//  - CheckpointWatcher: the checkpoint store, looked at off the loop;
//  - JobReporter: the reporting role: step reports (the progress line,
//    steps.jsonl, the step metrics), slow-machine verdicts, checkpoint
//    failures, host metrics, state.json and the final summary; it reads the
//    daemon through a DaemonStatus that reportStatus() builds, nothing more;
//  - MachineListWatcher: edits and rewrites of the machine list;
//  - JobMetrics and MetricsServer: the job as Prometheus metrics, served on
//    civetweb's threads (--metrics_port); the loop only sets them.
// The daemon wires them: a hello the router hands it goes to the pool or the
// registry, a lost host's workers are ordered out, a verdict becomes a
// controller call, the controller's actions go out through the pool and the
// registry, and what the people watching the job see goes through the
// reporter. Its own role is what each of those means for the job, and
// carrying out the controller's actions.
//
// Single-threaded: every member runs on the io_context's thread; launch
// threads, the store's thread and AutoConfig's thread only post results back
// (docs/architecture.md, "Threads"). No handler can end the loop: each runs
// under one HandlerGuard (a failure is logged, rate-limited, and handled).
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "varuna/manager/autoconfig.h"
#include "varuna/manager/checkpoint_scan.h"
#include "varuna/manager/clock.h"
#include "varuna/manager/host_launcher.h"
#include "varuna/manager/job_config.h"
#include "varuna/manager/manager_daemon.h"
#include "varuna/manager/morph_controller.h"

// The runtime's own parts (manager/src/).
#include "daemon/agent_pool.h"
#include "daemon/async_planner.h"
#include "daemon/checkpoint_watcher.h"
#include "daemon/control_listener.h"
#include "daemon/job_metrics.h"
#include "daemon/job_reporter.h"
#include "daemon/liveness_watchdog.h"
#include "daemon/machine_list_watcher.h"
#include "daemon/metrics_server.h"
#include "daemon/morph_tracker.h"
#include "daemon/peer_router.h"
#include "daemon/worker_registry.h"
#include "loop/background_worker.h"
#include "loop/event_log.h"
#include "loop/handler_guard.h"
#include "loop/pending_connections.h"

namespace varuna {

class ManagerDaemon::Impl : private AgentPool::Observer, private PeerRouter::Sink {
 public:
  Impl(boost::asio::io_context& io, JobConfig config, std::unique_ptr<HostLauncher> launcher,
       DaemonOptions options = {});
  ~Impl() override;

  // Binds the control port, starts the agents; the job starts when they are up.
  // Throws ConfigError for a bad setup (machine list, state folder, port).
  void start();
  // SIGTERM/SIGINT: checkpoint and stop (a second request kills at once).
  void requestStop(const std::string& reason);
  int exitCode() const { return exitCode_; }
  DaemonPhase phase() const { return phase_; }
  uint16_t port() const { return listener_.port(); }
  // --metrics_port's, once started (0: no metrics).
  uint16_t metricsPort() const { return metricsServer_ ? metricsServer_->port() : 0; }
  const JobMetrics& metrics() const { return metrics_; }

  // The seam to the checkpoint store's scan (default scanCheckpointStore),
  // e.g. a slow one in tests. Before start(); called on a background thread.
  void setStoreScanner(StoreScanner scanner) { storeScanner_ = std::move(scanner); }

  // Introspection (tests, state.json).
  size_t pendingConnections() const { return listener_.pendingConnections(); }
  size_t launchThreads() const { return pool_ ? pool_->launchThreads() : 0; }
  uint64_t acceptFailures() const { return listener_.acceptFailures(); }
  uint64_t tcpConnectionsAccepted() const { return listener_.tcpAccepted(); }
  uint64_t localConnectionsAccepted() const { return listener_.localAccepted(); }
  uint64_t handlerFailures() const { return guard_->failures(); }
  bool stateWriteFailing() const { return reporter_ && reporter_->stateWriteFailing(); }
  bool stateWriting() const { return reporter_ && reporter_->stateWriting(); }
  // Work on other threads whose result the loop has not had yet: agent
  // start-ups and store or planning jobs (a test on a fake clock holds its
  // time still while there is any, as the real clock would barely move).
  size_t backgroundJobs() const;

 private:
  // Start-up (start()).
  void listen();
  // --metrics_port: /metrics on the control port's address (ConfigError if it cannot).
  void serveMetrics();
  void createController(int firstGeneration);
  void createPlanner(ControllerOptions& options);
  void createRouter();
  // Once the parts it reads exist; `stepLog` was opened earlier in start().
  void createReporter(TimePoint startedAt, std::unique_ptr<StepLog> stepLog);
  std::string agentCommand(const std::string& host) const;
  // How long an agent that hears nothing from the manager waits before it
  // takes the manager as gone (its --lost_manager_ms).
  std::chrono::milliseconds lostManagerAfter() const;

  // PeerRouter::Sink: hellos and frames, routed by role (the listener checked the token).
  void agentHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) override;
  void joinHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) override;
  int runningGeneration() const override { return controller_->generation(); }
  bool expectsWorker(int rank) const override { return workers_.expects(rank); }
  std::string hostOf(int rank) const override;
  bool workerConnected(int rank, const std::shared_ptr<FramedConnection>& connection) override;
  void allWorkersConnected() override;
  void workerMessage(int rank, const proto::Message& message) override;
  void preemptNotice(const std::shared_ptr<FramedConnection>& connection, const proto::PreemptNotice& notice) override;
  // A worker's heartbeat, from its own connection or relayed by its agent.
  void onWorkerBeat(WorkerState& worker, int64_t step, bool waiting, TimePoint now);
  // A step report, sent by the rank (`worker`) or relayed by its agent
  // (`worker` null when the rank's own hello has not come yet).
  void onStepReport(WorkerState* worker, const proto::StepReport& report, TimePoint now);
  void onWorkerBeats(const std::string& host, const proto::WorkerBeats& beats);
  void onWorkerExited(const std::string& host, const proto::WorkerExited& exited);
  // Salvage (manager_daemon_salvage.cpp).
  void onSalvageReady(int rank, const proto::SalvageReady& ready);
  void doSalvageStop(const action::SalvageStop& stop);
  void doSalvageWrite(const action::SalvageWrite& write);
  void doSalvageAbandoned(const action::SalvageAbandoned& abandoned);
  // Peers the manager waits for (the listener's cap makes room for them).
  size_t expectedHellos() const;

  // AgentPool::Observer.
  void hostsChanged() override;
  void hostBack(const std::string& host) override;
  void agentLost(const std::string& host, const std::string& reason) override;
  void preemptedHostLeft(const std::string& host) override;
  void agentConfigError(const std::string& host, const std::string& reason) override;
  void agentMessage(const std::string& host, const proto::Message& message) override;

  // The job: started once the first start-up of every listed agent is over,
  // or (--min_hosts, joins) once enough hosts are usable.
  void maybeStartJob();
  bool enoughHostsToStart() const;
  // <state_dir>/join_token: written at start, renewed at half its life.
  void renewJoinCredentialIfDue();
  bool joinOnly() const { return config_.machineSource == "join"; }
  // The controller runs the job (kRunning or kStopping).
  bool jobRunning() const { return phase_ == DaemonPhase::kRunning || phase_ == DaemonPhase::kStopping; }
  bool finished() const { return phase_ == DaemonPhase::kFinished; }
  void usableMachinesChanged();

  // The controller's actions.
  void apply(const std::vector<Action>& actions);
  // A launch in two halves: the store work (generation record, thorough
  // scan) off the loop, then finishLaunch sends the workers out. If the
  // controller moved on meanwhile (a failure, a notice, a stop),
  // abandonLaunch tells it that no worker of the launch ever ran.
  void doLaunch(const action::Launch& launch);
  void finishLaunch(action::Launch launch, const CheckpointWatcher::LaunchPrep& prep);
  void abandonLaunch(const action::Launch& launch);
  void failLaunch(const action::Launch& launch, const std::string& why);
  // Ends the generation over the workers' own connections too (whatever
  // their agents' state).
  void orderWorkersOut(const std::string& reason);
  void doStop(const action::Stop& stop);
  void finishShutdown();

  // Periodic work.
  void scheduleTick();
  void onTick();
  // Liveness (docs/run_varuna.md, "Liveness"): silent ranks, then a
  // generation that makes no progress.
  void checkSilentRanks(TimePoint now);
  void checkProgress(TimePoint now);
  void watchMachineList();
  // The machine list was written: every host it lists that is out gets
  // another chance now. True if one is back already.
  bool readmitListedHosts(TimePoint now);

  // Reporting, through the reporter (none before start() made it).
  JobReporter::DaemonStatus reportStatus() const;
  void updateHostMetrics(TimePoint now);
  // --exclude_slow: the reporter's verdict named `host`.
  void excludeSlowHost(const std::string& host);
  // state.json now; on failure logged (rate-limited) and retried at every tick.
  void writeState() {
    if (reporter_) reporter_->writeState();
  }

  boost::asio::io_context& io_;
  Clock& clock_;
  JobConfig config_;
  // Every handler and connection callback runs under it (shared with the
  // connections, which may outlive a handler).
  std::shared_ptr<HandlerGuard> guard_ = std::make_shared<HandlerGuard>();
  ControlListener listener_;
  std::unique_ptr<PeerRouter> router_;  // made in start()
  bool tcpListening_ = true;  // false with DaemonOptions::localConnections: no control port
  std::unique_ptr<Timer> tickTimer_;
  std::unique_ptr<HostLauncher> launcher_;  // until start() hands it to the pool
  std::string advertisedAddress_;           // host:port agents and workers dial
  std::string token_;
  std::shared_ptr<const tls::CertificateCredential> ca_;  // the job's CA over TLS (certificate_credential.h)
  std::vector<std::pair<std::string, int64_t>> profiledPieces_;  // --profile's pieces (name, parameters), for the workers
  std::vector<std::pair<std::string, std::string>> env_;  // env_file
  std::unique_ptr<EventLog> events_;
  std::unique_ptr<MorphController> controller_;
  MachineListWatcher machineList_;
  WorkerRegistry workers_;  // the running generation's
  LivenessWatchdog liveness_;
  JobMetrics metrics_;  // set at the points where events are logged
  MorphTracker morph_{metrics_};  // the morph under way: its timing, metrics and event
  // Made in start(). Reads checkpoints_ (declared below, destroyed first)
  // only from handlers, never in its destructor.
  std::unique_ptr<JobReporter> reporter_;
  // The highest step any rank said it finished (heartbeats, reports), over
  // the generations this manager ran: what a relaunch loses is measured from it.
  int64_t reachedStep_ = -1;
  int64_t salvageStep_ = -1;  // the step the last salvage ordered written
  // The running generation: the step it resumed from (-1: fresh) and the
  // highest step any of its ranks said it finished (-1: none): a loss
  // before it got past its checkpoint leaves nothing to salvage.
  int64_t generationResume_ = -1;
  int64_t generationReached_ = -1;

  int64_t joinCredentialWrittenUnixS_ = 0;
  TimePoint lastListPoll_{};
  TimePoint lastCheckpointPoll_{};
  TimePoint shutdownWaitSince_{};  // finishShutdown waits for the final scan from then (bounded)
  DaemonPhase phase_ = DaemonPhase::kStartingAgents;
  // The generation whose launch's store work is under way (no worker of it
  // runs yet); none once finishLaunch has it.
  std::optional<int> preparingLaunch_;
  int exitCode_ = 0;
  std::string stopReason_;
  StoreScanner storeScanner_ = scanCheckpointStore;

  // With threads of their own, declared last: destroyed first, so no result
  // of theirs reaches a half-destroyed daemon (their destructors drop what is
  // queued and wait for the job running, or join the launch threads).
  std::unique_ptr<AgentPool> pool_;
  std::unique_ptr<CheckpointWatcher> checkpoints_;
  std::unique_ptr<AsyncPlanner> planner_;         // with a profile: AutoConfig off the loop
  std::unique_ptr<BackgroundWorker> planWorker_;  // AutoConfig's runs (planner_)
  // civetweb's threads read metrics_: stopped (joined) before it goes.
  std::unique_ptr<MetricsServer> metricsServer_;
};

}  // namespace varuna
