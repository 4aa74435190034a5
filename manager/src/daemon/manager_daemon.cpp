#include "daemon/manager_daemon_impl.h"

#include <unistd.h>
#include <algorithm>
#include <filesystem>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/common/machine_list.h"
#include "varuna/common/time_util.h"
#include "varuna/common/worker_exit.h"
#include "daemon/job_setup.h"
#include "daemon/launch_message.h"

namespace varuna {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using nlohmann::json;

constexpr auto kTickInterval = std::chrono::milliseconds(100);
constexpr auto kListPollInterval = std::chrono::milliseconds(500);
constexpr auto kCheckpointPollInterval = std::chrono::milliseconds(1000);
constexpr auto kHelloDeadline = std::chrono::seconds(10);
// At the stop, how long the manager waits for its last look at the store.
constexpr auto kFinalScanWait = std::chrono::seconds(10);
// A preempted host whose notice gave no deadline is not expected back before this.
constexpr auto kPreemptedWithoutDeadline = std::chrono::seconds(120);
// A notice's deadline counts up to a day ahead: a host announced as taken
// next year is out for a day, then tried like a lost one.
constexpr auto kMaxNoticeAhead = std::chrono::hours(24);
// A failed worker's last lines as its agent sent them: not megabytes of one runaway line.
constexpr size_t kMaxLoggedLogTailBytes = 4096;

// The end of `text` (of a log, the end matters), at most about maxBytes, valid UTF-8.
std::string endOfText(const std::string& text, size_t maxBytes) {
  if (text.size() <= maxBytes) return proto::boundedText(text, maxBytes);
  size_t start = text.size() - maxBytes;
  while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xc0) == 0x80) ++start;
  return "..." + proto::boundedText(std::string_view(text).substr(start), maxBytes);
}

// The address run_varuna binds its control port (and its metrics) to.
std::string bindIp(const JobConfig& config) { return config.managerIp.empty() ? "0.0.0.0" : config.managerIp; }

// A worker's unexpected exit as a failure cause.
JobMetrics::Failure exitFailure(const WorkerExit& exit) {
  switch (exit.kind()) {
    case ExitKind::kConfigError: return JobMetrics::Failure::kConfigError;
    case ExitKind::kPeerLost: return JobMetrics::Failure::kPeerLost;
    case ExitKind::kStorageError: return JobMetrics::Failure::kCheckpointStorage;
    case ExitKind::kSuperseded: return JobMetrics::Failure::kSuperseded;
    default: return JobMetrics::Failure::kWorkerCrashed;
  }
}

}  // namespace

ManagerDaemon::Impl::Impl(asio::io_context& io, JobConfig config, std::unique_ptr<HostLauncher> launcher,
                          DaemonOptions options)
    : io_(io),
      clock_(*options.clock),
      config_(std::move(config)),
      listener_(io, guard_, options.pendingLimits, clock_),
      tickTimer_(clock_.makeTimer(io)),
      launcher_(std::move(launcher)),
      machineList_(config_.machineList, config_.gpusPerNode),
      liveness_({config_.heartbeatTimeoutS, config_.startupTimeoutS, config_.hangTimeoutS}),
      metrics_(config_.batchSize) {
  if (options.localConnections) listener_.listenLocal(*options.localConnections);
  listener_.setPlaintext(config_.insecurePlaintextControl);
  tcpListening_ = !options.localConnections;
}

ManagerDaemon::Impl::~Impl() = default;

// --- start-up -------------------------------------------------------------------

void ManagerDaemon::Impl::start() {
  const TimePoint startedAt = clock_.now();
  std::error_code ec;
  fs::create_directories(config_.stateDir, ec);
  if (ec) throw ConfigError(strCat("cannot create --state_dir ", config_.stateDir, ": ", ec.message()));
  const json previous = previousState(config_);
  token_ = loadOrCreateToken(config_.stateDir);
  // Certificates over TLS; the in-process test network and plaintext keep derived credentials.
  if (tcpListening_ && !config_.insecurePlaintextControl) ca_ = loadOrCreateCa(config_.stateDir, token_, config_.job);
  events_ = std::make_unique<EventLog>((fs::path(config_.stateDir) / "events.jsonl").string());
  morph_.setEventLog(events_.get());
  auto stepLog = std::make_unique<StepLog>((fs::path(config_.stateDir) / "steps.jsonl").string(), config_.batchSize);
  if (!config_.envFile.empty()) env_ = parseEnvFile(ckpt::readFile(config_.envFile), config_.envFile);
  env_ = jobEnvironment(config_, std::move(env_));
  fs::create_directories(config_.globalStore, ec);
  if (ec) throw ConfigError(strCat("cannot create --global_store ", config_.globalStore, ": ", ec.message()));
  const auto listed = joinOnly() ? std::vector<Machine>{} : machineList_.read();
  renewJoinCredentialIfDue();
  claimGlobalStore(config_.globalStore, config_.job);
  const int first = firstGeneration(config_, previous, *events_);
  chooseRendezvousPort(config_);

  if (tcpListening_) listen();
  serveMetrics();
  advertisedAddress_ = advertisedAddress(config_, listed, listener_.port());
  AgentPool::Observer& observer = *this;  // a private base: converted here, where it is accessible
  pool_ = std::make_unique<AgentPool>(io_, guard_, *events_, std::move(launcher_),
                                      agentPoolSettings(config_, advertisedAddress_, token_, ca_, env_, kHelloDeadline), observer, clock_);
  pool_->setAgentCommand([this](const std::string& host) { return agentCommand(host); });
  pool_->setListed(listed);
  checkpoints_ = std::make_unique<CheckpointWatcher>(io_, guard_, *events_, config_.globalStore, storeScanner_, clock_);
  createController(first);
  createReporter(startedAt, std::move(stepLog));
  checkpoints_->scanNow();  // before the loop runs (nothing is waiting on it yet)

  log::info("job '", config_.job, "': manager ",
            tcpListening_ ? "listening on " + advertisedAddress_ : std::string("on an in-process network only"),
            "; state in ", config_.stateDir);
  if (joinOnly() && config_.managerIp.empty()) {
    log::warn("no --manager_ip: joining agents are told ", advertisedAddress_,
              ", which only this machine reaches; give the address the hosts reach this one by");
  }
  if (joinOnly()) {
    log::info("no machine list: hosts join with `varuna_agent --join ", advertisedAddress_, " --join_token_file ",
              (fs::path(config_.stateDir) / "join_token").string(), " --job ", config_.job,
              " --host NAME --slots N`; training starts at ", std::max(config_.minHosts, 1), " host(s)");
  } else {
    log::info("starting agents on ", listed.size(), " host(s) from ", config_.machineList);
  }
  events_->write("manager_started", {{"address", advertisedAddress_}, {"pid", ::getpid()},
                                      {"hosts", listed.size()}, {"config", toJson(config_)},
                                      {"metrics", metricsServer_ ? json(metricsServer_->url()) : json()}});
  createRouter();
  listener_.setAgentCredentials([this](const std::string& host) { return pool_->agentCredential(host); });
  if (ca_) {
    listener_.setCertificateAuthority(
        ca_, [this](const tls::PskIdentity& hostCa, const tls::PskIdentity& peer, std::string& why) {
          return pool_->acceptsHostCa(hostCa, peer, why);
        });
  }
  listener_.start(
      token_, *events_,
      [this](const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
        router_->route(connection, hello, clock_.now());
      },
      [this] { return expectedHellos(); });
  for (const auto& m : listed) pool_->startAgent(m.host);
  scheduleTick();
  writeState();
}

void ManagerDaemon::Impl::createRouter() {
  PeerRouter::Options options;
  // How long a worker may go without hearing from us before it exits on its
  // own: as long as its agent would wait (a silent agent is lost after the
  // heartbeat timeout, its workers killed after the agents' grace).
  options.lostManagerGrace = millis(config_.heartbeatTimeoutS + config_.agentGraceS);
  // With salvage on, a worker that loses a peer waits for our order (twice
  // the rounds' timeout at most) instead of exiting.
  const bool salvage = !config_.noSalvage && !config_.noMorphing;
  if (salvage) options.salvageTimeout = millis(config_.salvageTimeoutS);
  options.jobSecret = token_;  // the operator's notifier may announce any host
  PeerRouter::Sink& sink = *this;  // a private base: converted here, where it is accessible
  router_ = std::make_unique<PeerRouter>(options, sink, *events_);
}

void ManagerDaemon::Impl::listen() {
  const std::string ip = bindIp(config_);
  asio::ip::tcp::endpoint endpoint;
  try {
    endpoint = asio::ip::tcp::endpoint(asio::ip::make_address(ip), static_cast<uint16_t>(config_.port));
  } catch (const std::exception&) {
    throw ConfigError(strCat("--manager_ip '", config_.managerIp, "' is not an IP address of this machine"));
  }
  const boost::system::error_code error = listener_.listen(endpoint);
  if (error == asio::error::address_in_use) {
    // Often the previous run_varuna still exiting: worth a retry (systemd's
    // Restart=on-failure does), unlike a configuration error.
    throw Error(strCat("cannot listen on ", ip, ":", config_.port, ": ", error.message(),
                       " (another run_varuna, or the previous one still exiting? pick another --port, or retry)"),
                kExitAddressInUse);
  }
  if (error) throw ConfigError(strCat("cannot listen on ", ip, ":", config_.port, ": ", error.message()));
}

void ManagerDaemon::Impl::serveMetrics() {
  if (config_.metricsPort < 0) return;
  metricsServer_ = std::make_unique<MetricsServer>(bindIp(config_), config_.metricsPort, metrics_.registry());
  log::info("Prometheus metrics at ", metricsServer_->url());
}

void ManagerDaemon::Impl::createController(int firstGeneration) {
  ControllerOptions options;
  options.stages = config_.nstages;
  options.globalBatch = config_.batchSize;
  options.chunkSize = config_.chunkSize;
  options.morphing = !config_.noMorphing;
  options.checkpointTimeout = millis(config_.checkpointTimeoutS);
  options.salvage = !config_.noSalvage && !config_.noMorphing;
  options.salvageTimeout = millis(config_.salvageTimeoutS);
  options.maxFailures = config_.maxFailures;
  options.failureWindow = millis(config_.failureWindowS);
  options.restartBackoff = millis(config_.restartBackoffS);
  options.firstGeneration = firstGeneration;
  options.generationProgressed = [this] {
    return generationReached_ > std::max<int64_t>(generationResume_, 0);
  };
  if (!config_.profile.empty()) createPlanner(options);
  // The controller's resume step is the last checkpoint seen; a launch
  // replaces it with what its own (thorough) scan finds (finishLaunch).
  controller_ = std::make_unique<MorphController>(options, std::vector<Machine>{},
                                                  [this] { return checkpoints_->latest(); });
}

void ManagerDaemon::Impl::createPlanner(ControllerOptions& options) {
  // AutoConfig plans every launch: P and/or the micro-batch as given, the rest chosen.
  auto profile = profile::readProfile(config_.profile);
  // What the profile describes, for every worker to check against the model
  // it builds: a stale profile (model changed) must not plan silently.
  profiledPieces_.clear();
  for (const auto& piece : profile.pieces) profiledPieces_.emplace_back(piece.name, piece.paramCount);
  log::info("AutoConfig: planning with the profile ", config_.profile, " (", profile.pieces.size(), " pieces, ",
            profile.device, ", micro-batch sizes ", json(profile.microBatchSizes()).dump(), ")");
  // AutoConfig runs on its own thread (planWorker_), never on the loop: the
  // controller is told PlanPending and waits in Phase::kPlanning (or,
  // running, keeps its plan) until planReady (AsyncPlanner).
  planWorker_ = std::make_unique<BackgroundWorker>(io_, "varuna-plan");
  auto shared = std::make_shared<const profile::Profile>(std::move(profile));
  planner_ = std::make_unique<AsyncPlanner>(
      *planWorker_,
      [shared, settings = autoConfigSettings(config_)](const PlanRequest& request) {
        return autoConfigure(*shared, autoConfigRequestFor(settings, request));
      },
      guard_->wrap("AutoConfig's result", [this](const AutoConfigResult& result) {
        const std::string why = result.explain();
        log::info("AutoConfig: ", why);
        metrics_.planChosen(result.planningSeconds);
        events_->write("autoconfig", {{"chosen", result.best.shortName()},
                                      {"explain", why},
                                      {"table", result.table()},
                                      {"considered", result.ranked.size()},
                                      {"simulated", result.simulatedCount},
                                      {"planning_s", result.planningSeconds}});
      }),
      guard_->wrap("a plan's arrival", [this] {
        if (controller_ && jobRunning()) apply(controller_->planReady(clock_.now()));
      }));
  options.planner = planner_->planner();
}

std::string ManagerDaemon::Impl::agentCommand(const std::string& host) const {
  // The agent's credential and the env_file's variables travel on the
  // command's stdin (AgentPool), never in the command, which `ps` shows. The
  // variables reach the agent as well as (through LaunchWorkers) every worker.
  return strCat("exec ", shellQuote(config_.agentPath), " --daemonize --token_stdin",
                env_.empty() ? "" : " --env_stdin", " --manager ",
                shellQuote(advertisedAddress_), " --host ", shellQuote(host), " --job ", shellQuote(config_.job),
                " --code_dir ", shellQuote(config_.codeDir), " --program ", shellQuote(config_.program.front()),
                " --grace_s ", config_.agentGraceS,
                config_.agentSigtermNoticeS > 0 ? strCat(" --sigterm_notice_s ", config_.agentSigtermNoticeS) : "",
                // Not hearing from the manager this long, the agent takes it as gone: as long as the
                // manager waits for a silent agent, plus the grace.
                " --lost_manager_ms ", lostManagerAfter().count(), " --beat_relay_ms ",
                agentBeatRelayInterval(config_).count(), " --log_level ", shellQuote(config_.logLevel),
                config_.insecurePlaintextControl ? " --insecure_plaintext_control" : "");
}

std::chrono::milliseconds ManagerDaemon::Impl::lostManagerAfter() const {
  // As long as the manager waits for a silent agent (at least 3 s: its
  // heartbeats go out once a second on a 100 ms tick), plus the grace.
  return millis(std::max(config_.heartbeatTimeoutS, 3.0) + config_.agentGraceS);
}

// --- hellos and what peers send -----------------------------------------------------

size_t ManagerDaemon::Impl::backgroundJobs() const {
  return (pool_ ? pool_->launchThreads() : 0) + (checkpoints_ ? checkpoints_->pendingJobs() : 0) +
         (planWorker_ ? planWorker_->pending() : 0);
}

size_t ManagerDaemon::Impl::expectedHellos() const { return pool_->startingCount() + workers_.unconnected(); }

void ManagerDaemon::Impl::agentHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
  pool_->admit(connection, hello);
}

std::string ManagerDaemon::Impl::hostOf(int rank) const {
  const auto& placement = controller_->plan().placement;
  return rank >= 0 && static_cast<size_t>(rank) < placement.size() ? placement[static_cast<size_t>(rank)].host : "";
}

bool ManagerDaemon::Impl::workerConnected(int rank, const std::shared_ptr<FramedConnection>& connection) {
  return workers_.connect(rank, connection, clock_.now());
}

void ManagerDaemon::Impl::allWorkersConnected() {
  const auto now = clock_.now();
  morph_.connected(now);
  log::info("all ", workers_.size(), " workers of generation ", controller_->generation(), " connected (",
            secondsBetween(liveness_.launchedAt(), now), " s after launch)");
}

void ManagerDaemon::Impl::preemptNotice(const std::shared_ptr<FramedConnection>& connection,
                                        const proto::PreemptNotice& notice) {
  if (pool_->refusedAsRevoked(connection, "preemption notice")) return;  // revoked since its handshake
  if (!pool_->known(notice.host)) {
    connection->send(proto::Ack{false, strCat("host '", notice.host, "' is not in the machine list")});
    connection->closeAfterSending("unknown host");
    return;
  }
  const auto now = clock_.now();
  std::optional<TimePoint> takenAt;
  if (notice.deadlineUnixMs > 0) {
    takenAt = now + clampedUntil(notice.deadlineUnixMs, unixMillisNow(), kMaxNoticeAhead);
  }
  log::warn("preemption notice for ", notice.host,
            takenAt ? strCat(" (taken in ", secondsBetween(now, *takenAt), " s)") : std::string(" (no deadline given)"));
  events_->write("preempt_notice", {{"host", notice.host}, {"deadline_unix_ms", notice.deadlineUnixMs}});
  // Out until the deadline at least (the cloud takes it then); after it the
  // host is tried like a lost one, unless the list is written first.
  pool_->preempted(notice.host, takenAt.value_or(now + kPreemptedWithoutDeadline), now);
  updateHostMetrics(now);
  connection->send(proto::Ack{true, ""});
  connection->closeAfterSending("done");
  morph_.begin("preemption of " + notice.host, JobMetrics::MorphCause::kPreemption, now);
  apply(controller_->preemptNotice(notice.host, now, takenAt));
}

void ManagerDaemon::Impl::workerMessage(int rank, const proto::Message& message) {
  WorkerState* worker = workers_.find(rank);
  if (!worker) return;
  const auto now = clock_.now();
  worker->lastSeen = now;
  if (const auto* heartbeat = std::get_if<proto::Heartbeat>(&message)) {
    onWorkerBeat(*worker, heartbeat->step, heartbeat->waiting, now);
  } else if (const auto* report = std::get_if<proto::StepReport>(&message)) {
    onStepReport(worker, *report, now);
  } else if (const auto* failed = std::get_if<proto::CheckpointFailed>(&message)) {
    reporter_->onCheckpointFailed(rank, *failed, controller_->plan());
  } else if (const auto* ping = std::get_if<proto::Ping>(&message)) {
    if (worker->connection) worker->connection->send(proto::Pong{ping->sequence, ping->sentNs});
  } else if (const auto* ready = std::get_if<proto::SalvageReady>(&message)) {
    onSalvageReady(rank, *ready);
  }
}

void ManagerDaemon::Impl::onStepReport(WorkerState* worker, const proto::StepReport& report, TimePoint now) {
  if (worker) liveness_.noteStep(*worker, report.step, /*report=*/true, now);
  reachedStep_ = std::max(reachedStep_, report.step);
  generationReached_ = std::max(generationReached_, report.step);
  reporter_->onStepReport(report, controller_->plan(), controller_->generation());
}

void ManagerDaemon::Impl::onWorkerBeat(WorkerState& worker, int64_t step, bool waiting, TimePoint now) {
  worker.lastSeen = now;
  worker.waiting = waiting;
  liveness_.noteStep(worker, step, /*report=*/false, now);
  reachedStep_ = std::max(reachedStep_, step);
  generationReached_ = std::max(generationReached_, step);
}

void ManagerDaemon::Impl::onWorkerBeats(const std::string& host, const proto::WorkerBeats& beats) {
  if (!controller_ || beats.generation != controller_->generation()) return;  // a launch that is over
  const auto& placement = controller_->plan().placement;
  const auto now = clock_.now();
  for (const auto& beat : beats.beats) {
    // Only the current launch's ranks on that agent's host whose own
    // connection is up: a rank that is gone, written off or cut off from us
    // is judged as if it beat to us directly.
    if (beat.rank < 0 || static_cast<size_t>(beat.rank) >= placement.size()) continue;
    if (placement[static_cast<size_t>(beat.rank)].host != host) continue;
    WorkerState* worker = workers_.find(beat.rank);
    if (worker && worker->connection && worker->connection->open()) onWorkerBeat(*worker, beat.step, beat.waiting, now);
  }
  // Step reports: of the current launch's ranks on that host, each as if the
  // rank had sent it (a relayed report can come before the rank's own
  // hello: it counts all the same). An agent speaks for its own host only.
  const Plan& plan = controller_->plan();
  for (const auto& report : beats.reports) {
    if (report.rank < 0 || static_cast<size_t>(report.rank) >= placement.size()) continue;
    if (placement[static_cast<size_t>(report.rank)].host != host) continue;
    // Stage and replica name metrics series: only the plan's.
    if (report.stage < 0 || report.stage >= plan.stages || report.replica < 0 || report.replica >= plan.replicas) continue;
    WorkerState* worker = workers_.find(report.rank);
    const bool connected = worker && worker->connection && worker->connection->open();
    if (connected) worker->lastSeen = now;
    onStepReport(connected ? worker : nullptr, report, now);
  }
}

void ManagerDaemon::Impl::agentMessage(const std::string& host, const proto::Message& message) {
  if (const auto* exited = std::get_if<proto::WorkerExited>(&message)) onWorkerExited(host, *exited);
  if (const auto* beats = std::get_if<proto::WorkerBeats>(&message)) onWorkerBeats(host, *beats);
}

void ManagerDaemon::Impl::onWorkerExited(const std::string& host, const proto::WorkerExited& exited) {
  if (exited.generation != controller_->generation()) return;  // a straggler of an earlier launch
  if (const std::string placed = hostOf(exited.rank); placed != host) {  // an agent speaks for its own host only
    log::warn("ignored the agent of ", host, " reporting the exit of rank ", exited.rank, ", which runs on ",
              placed.empty() ? std::string("no host") : placed);
    return;
  }
  const WorkerExit exit{exited.exitCode, exited.signal};
  const std::string how = exit.describe();
  // A salvage's writers exit with 77 and the ranks it ordered out with 76.
  const bool salvaging = controller_->phase() == Phase::kSalvageWriting;
  const bool expected = exit.asOrdered() || (salvaging && exit.kind() == ExitKind::kSuperseded);
  if (expected) {
    log::info("rank ", exited.rank, " on ", host, " exited with ", how);
  } else {
    log::error("rank ", exited.rank, " on ", host, " exited with ", how,
               exited.logTail.empty() ? std::string() : ":\n" + endOfText(exited.logTail, kMaxLoggedLogTailBytes));
  }
  events_->write("worker_exited", {{"host", host}, {"rank", exited.rank}, {"exit_code", exited.exitCode},
                                   {"signal", exited.signal}, {"generation", exited.generation}});
  workers_.forget(exited.rank);
  if (!expected) {
    // A failure of the generation, not the echo of one being ended (a kill-all's SIGKILLs).
    const Phase phase = controller_->phase();
    if ((phase == Phase::kRunning || phase == Phase::kCheckpointing) && controller_->runningRanks().count(exited.rank)) {
      metrics_.failure(exitFailure(exit));
    }
    morph_.begin(strCat("rank ", exited.rank, " failed"), JobMetrics::MorphCause::kWorkerFailed, clock_.now());
  }
  apply(controller_->workerExited(exited.rank, exited.exitCode, clock_.now()));
}

// --- hosts (AgentPool::Observer) ---------------------------------------------------------

void ManagerDaemon::Impl::hostsChanged() {
  updateHostMetrics(clock_.now());
  switch (phase_) {
    case DaemonPhase::kStartingAgents: return maybeStartJob();
    case DaemonPhase::kRunning:
    case DaemonPhase::kStopping: return usableMachinesChanged();
    case DaemonPhase::kFinished: return;
  }
}

void ManagerDaemon::Impl::hostBack(const std::string& host) {
  if (controller_) controller_->readmitHost(host);
}

void ManagerDaemon::Impl::agentLost(const std::string& host, const std::string&) {
  // Its workers count as gone from here on; those still connected (a frozen
  // or partitioned agent, not a dead host) are told so.
  workers_.orderHostOut(host, controller_->plan(), controller_->generation(),
                        strCat("the agent of host ", host, " was lost"));
  morph_.begin("loss of host " + host, JobMetrics::MorphCause::kHostLost, clock_.now());
  updateHostMetrics(clock_.now());
  if (phase_ == DaemonPhase::kStartingAgents) {
    pool_->markFailed(host);  // its first start-up did not last until the job began
    return maybeStartJob();
  }
  // Finished, the pool is shut down and reports no loss (shutdownAll); the
  // controller has nothing more to hear.
  if (finished()) return;
  metrics_.failure(JobMetrics::Failure::kHostLost);
  apply(controller_->hostLost(host, clock_.now()));
  usableMachinesChanged();
}

void ManagerDaemon::Impl::agentConfigError(const std::string&, const std::string& reason) {
  doStop(action::Stop{reason, kExitConfigError});
}

void ManagerDaemon::Impl::usableMachinesChanged() {
  if (!jobRunning()) return;
  apply(controller_->machinesChanged(pool_->usable(), clock_.now()));
}

bool ManagerDaemon::Impl::enoughHostsToStart() const {
  const size_t usable = pool_->usable().size();
  if (config_.minHosts > 0 && usable >= static_cast<size_t>(config_.minHosts)) return true;
  if (joinOnly()) return config_.minHosts == 0 && usable > 0;
  return config_.minHosts == 0 && !pool_->anyStarting();  // every listed agent started or failed
}

void ManagerDaemon::Impl::maybeStartJob() {
  if (phase_ != DaemonPhase::kStartingAgents || !enoughHostsToStart()) return;  // still waiting for some
  phase_ = DaemonPhase::kRunning;
  const auto usable = pool_->usable();
  const size_t listed = pool_->listed().size();
  const size_t usableListed = static_cast<size_t>(
      std::count_if(usable.begin(), usable.end(), [this](const Machine& m) { return !pool_->isJoined(m.host); }));
  log::info(usable.size(), " host(s) ready (", listed, " listed, ", pool_->joinedCount(), " joined)");
  if (usableListed < listed && !pool_->anyStarting()) {
    log::error(listed - usableListed, " host(s) could not start an agent (see the errors above); they are ",
               config_.hostRetryS > 0 ? "retried with backoff and " : "", "retried when the machine list is written");
  }
  const auto now = clock_.now();
  apply(controller_->machinesChanged(usable, now));
  apply(controller_->start(now));
}

// --- the controller's actions ---------------------------------------------------------

void ManagerDaemon::Impl::apply(const std::vector<Action>& actions) {
  if (actions.empty()) return;  // the tick writes the state once a second anyway
  for (const auto& a : actions) {
    if (finished()) return;
    if (const auto* launch = std::get_if<action::Launch>(&a)) {
      doLaunch(*launch);
    } else if (std::holds_alternative<action::Checkpoint>(a)) {
      // The stop is no morph.
      morph_.begin("the machines changed", JobMetrics::MorphCause::kMachinesChanged, clock_.now(), phase_ != DaemonPhase::kStopping);
      metrics_.checkpointOrdered(clock_.now());
      log::info("ordering an on-demand checkpoint from every worker");
      events_->write("checkpoint_ordered", {{"generation", controller_->generation()}});
      pool_->send(controller_->plan().hosts, proto::CheckpointAndExit{});
    } else if (const auto* kill = std::get_if<action::KillAll>(&a)) {
      morph_.begin(kill->reason, JobMetrics::MorphCause::kOther, clock_.now(), phase_ != DaemonPhase::kStopping);
      log::warn("stopping every worker: ", kill->reason);
      events_->write("kill_all", {{"reason", kill->reason}});
      pool_->send(controller_->plan().hosts, proto::KillWorkers{kill->reason});
      orderWorkersOut(kill->reason);  // also those whose agent cannot act
    } else if (const auto* stop = std::get_if<action::Stop>(&a)) {
      doStop(*stop);
    } else if (const auto* salvageStop = std::get_if<action::SalvageStop>(&a)) {
      doSalvageStop(*salvageStop);
    } else if (const auto* write = std::get_if<action::SalvageWrite>(&a)) {
      doSalvageWrite(*write);
    } else if (const auto* abandoned = std::get_if<action::SalvageAbandoned>(&a)) {
      doSalvageAbandoned(*abandoned);
    }
  }
  writeState();
}

void ManagerDaemon::Impl::orderWorkersOut(const std::string& reason) {
  const size_t ordered = workers_.orderAllOut(controller_->generation(), reason);
  if (ordered > 0) log::info("ordered ", ordered, " worker(s) of generation ", controller_->generation(), " to exit");
}

void ManagerDaemon::Impl::doLaunch(const action::Launch& launch) {
  workers_.clear();  // the last generation's, if any: no hello of theirs counts
  preparingLaunch_ = launch.generation;
  checkpoints_->prepareLaunch(launch.generation, [this, launch](const CheckpointWatcher::LaunchPrep& prep) {
    finishLaunch(launch, prep);
  });
}

void ManagerDaemon::Impl::abandonLaunch(const action::Launch& launch) {
  // No worker of it was started; the controller counts its ranks as running
  // and ended the generation meanwhile (KillAll or Checkpoint): they are
  // gone, as if they had exited the way the controller asked them to.
  const Phase phase = controller_->phase();
  log::info("generation ", launch.generation, " was not launched: the job is ", toString(phase), " meanwhile");
  const int code = phase == Phase::kCheckpointing ? kExitCheckpointed : -1;
  const std::set<int> ranks = controller_->runningRanks();  // a copy: workerExited changes the controller's
  for (const int rank : ranks) {
    if (finished()) return;
    apply(controller_->workerExited(rank, code, clock_.now()));
  }
}

void ManagerDaemon::Impl::failLaunch(const action::Launch& launch, const std::string& why) {
  // Without the record the launch does not happen (a full or failing store):
  // it is a failure, retried after the backoff like any other. Valid UTF-8
  // (a path may not be): the reason goes into the event log's JSON.
  const std::string reason = proto::boundedText(why, 2 * proto::kMaxErrorTextBytes);
  log::error(reason, "; the launch is retried after the backoff");
  events_->write("launch_failed", {{"generation", launch.generation}, {"reason", reason}});
  metrics_.failure(JobMetrics::Failure::kLaunchFailed);
  workers_.clear();
  apply(controller_->launchFailed(reason, clock_.now()));
}

void ManagerDaemon::Impl::finishLaunch(action::Launch launch, const CheckpointWatcher::LaunchPrep& prep) {
  if (finished() || launch.generation != controller_->generation()) return;  // a later launch supersedes it
  preparingLaunch_.reset();
  if (controller_->phase() != Phase::kRunning) return abandonLaunch(launch);
  const Plan& plan = launch.plan;
  if (!prep.recordError.empty()) {
    return failLaunch(launch, strCat("cannot record generation ", launch.generation, " in ",
                                     (fs::path(config_.globalStore) / ckpt::kJobFile).string(), ": ",
                                     prep.recordError));
  }
  for (const auto& host : plan.hosts) {
    if (!pool_->connected(host)) return failLaunch(launch, strCat("the agent on ", host, " went away before the launch"));
  }
  // The freshest checkpoint (the controller's is the last periodic scan's);
  // if the store could not be read, the last one seen.
  const auto now = clock_.now();
  const auto latest = checkpoints_->read(prep.scan);
  checkpoints_->note(latest, now, prep.scan.latestAgeSeconds);
  reporter_->checkpointSeen();
  launch.resumeStep = latest.value_or(-1);
  generationResume_ = launch.resumeStep;
  generationReached_ = -1;
  const int64_t reached = reachedStep_;  // the job's highest step so far (-1: none seen by this manager)
  metrics_.launched(plan, launch.generation, launch.resumeStep, now);
  liveness_.launched(now);  // the startup timeout until its first step
  workers_.expect(plan);
  reporter_->onLaunch(plan);
  morph_.launched(now);
  log::info("generation ", launch.generation, ": ", plan.describe(),
            launch.resumeStep >= 0 ? strCat("; resuming from step ", launch.resumeStep) : std::string("; fresh start"));
  json launchFields = {{"generation", launch.generation}, {"resume_step", launch.resumeStep}, {"plan", planJson(plan)},
                       {"recovery", controller_->lastLaunchSalvaged() && launch.resumeStep == salvageStep_
                                        ? "salvage" : "checkpoint"}};
  // Steps finished before that the new generation computes again (0 after a
  // morph with notice or a salvage; the rollback otherwise).
  if (reached >= 0) launchFields["steps_lost"] = std::max<int64_t>(0, reached - std::max<int64_t>(launch.resumeStep, 0));
  events_->write("launch", launchFields);
  proto::LaunchWorkers message = launchMessage(config_, launch, env_, profiledPieces_);
  for (const auto& host : plan.hosts) {
    message.workers.clear();
    for (const auto& p : plan.ranksOn(host)) message.workers.push_back({p.rank, p.localRank});
    pool_->send(host, message);
  }
  pool_->releaseDeparted();  // hosts that left the job (preempted or removed from the list)
}

void ManagerDaemon::Impl::doStop(const action::Stop& stop) {
  if (finished()) return;
  phase_ = DaemonPhase::kFinished;
  exitCode_ = stop.exitCode;
  stopReason_ = stop.reason;
  if (stop.exitCode == 0) {
    log::info("job '", config_.job, "' done: ", stop.reason);
  } else {
    log::error("job '", config_.job, "' stopped: ", stop.reason);
  }
  // The checkpoint the workers just wrote, if any (finishShutdown waits for it).
  checkpoints_->finalScan([this] {
    // The tick no longer runs.
    reporter_->checkpointSeen();
    writeState();
  });
  reporter_->flushSteps();
  events_->write("stop", {{"reason", stop.reason}, {"exit_code", stop.exitCode}});
  orderWorkersOut("the job stopped: " + stop.reason);  // any still running (a job that finished has none)
  pool_->shutdownAll(stop.reason);
  listener_.stopAccepting();  // no new peer has anything to do with a job that stopped
  writeState();
  // Let the shutdowns go out, then leave the event loop.
  clock_.runAfter(io_, std::chrono::milliseconds(300), guard_->wrap("shutting down", [this] { finishShutdown(); }));
}

void ManagerDaemon::Impl::finishShutdown() {
  // The final store scan first (state.json and the summary name the last
  // checkpoint), for a bounded time: a stalled store must not keep the
  // manager from exiting.
  const auto now = clock_.now();
  if (!checkpoints_->finalScanDone()) {
    if (shutdownWaitSince_ == TimePoint{}) shutdownWaitSince_ = now;
    if (now - shutdownWaitSince_ < kFinalScanWait) {
      clock_.runAfter(io_, kTickInterval, guard_->wrap("shutting down", [this] { finishShutdown(); }));
      return;
    }
    log::warn("the checkpoint store did not answer within ", std::chrono::duration<double>(kFinalScanWait).count(),
              " s: the last checkpoint may be missing from state.json");
  }
  reporter_->printSummary();
  listener_.close();
  tickTimer_->cancel();
  pool_->closeAll("manager exiting");
  workers_.closeAll("manager exiting");
  io_.stop();  // pending timers and the signal set would keep the loop alive
}

void ManagerDaemon::Impl::requestStop(const std::string& reason) {
  switch (phase_) {
    case DaemonPhase::kFinished: return;
    case DaemonPhase::kStartingAgents: return doStop(action::Stop{reason, 0});  // no job to checkpoint
    case DaemonPhase::kStopping: log::warn("second stop request: killing the workers now"); break;
    case DaemonPhase::kRunning: phase_ = DaemonPhase::kStopping; break;
  }
  events_->write("stop_requested", {{"reason", reason}});
  apply(controller_->stop(reason, clock_.now()));
}

// --- periodic work ------------------------------------------------------------------------

void ManagerDaemon::Impl::scheduleTick() {
  tickTimer_->expireAfter(kTickInterval, [this] {
    if (finished()) return;
    guard_->run("the manager's tick", [this] { onTick(); });
    if (!finished()) scheduleTick();
  });
}

void ManagerDaemon::Impl::onTick() {
  const auto now = clock_.now();
  listener_.tick(now);
  router_->closeIdleNotifiers(now);
  // Agents before workers: when a host is cut off, its agent's and its
  // workers' silences end in the same tick, and the host's loss (not
  // counted towards --max_failures) must be what the controller hears first,
  // not its workers' hangs (counted).
  pool_->closeSilentAgents(now);
  if (finished()) return;
  checkSilentRanks(now);
  if (finished()) return;
  checkProgress(now);
  if (finished()) return;
  if (jobRunning()) {
    // A tick's action while checkpointing is the checkpoint's timeout.
    const bool checkpointing = controller_->phase() == Phase::kCheckpointing;
    auto actions = controller_->tick(now);
    if (checkpointing && !actions.empty()) metrics_.failure(JobMetrics::Failure::kCheckpointTimeout);
    apply(actions);
  }
  if (finished()) return;
  if (now - lastListPoll_ >= kListPollInterval) {
    lastListPoll_ = now;
    watchMachineList();
    renewJoinCredentialIfDue();
  }
  // Stopping, no host is needed again.
  pool_->tick(now, /*retry=*/phase_ == DaemonPhase::kRunning);
  if (finished()) return;
  if (now - lastCheckpointPoll_ >= kCheckpointPollInterval) {
    lastCheckpointPoll_ = now;
    checkpoints_->poll();
  }
  reporter_->tick(now);  // the checkpoint and the metrics, state.json once a second
}

void ManagerDaemon::Impl::checkSilentRanks(TimePoint now) {
  const Phase phase = controller_ ? controller_->phase() : Phase::kIdle;
  // Salvaging too: a rank that stops then is not waited for.
  if (phase != Phase::kRunning && phase != Phase::kCheckpointing && phase != Phase::kSalvaging) return;
  // Collected first: reporting one changes the running set.
  for (const auto& silent : liveness_.silentRanks(controller_->runningRanks(), workers_, now)) {
    if (!workers_.expects(silent.rank) || !controller_->runningRanks().count(silent.rank)) continue;
    const std::string host = controller_->plan().placement.at(static_cast<size_t>(silent.rank)).host;
    // A silent agent (stopped, cut off): its own timeout ends the host's part.
    if (LivenessWatchdog::silenceIsTheAgents(silent, pool_->lastHeard(host), now)) continue;
    log::error("rank ", silent.rank, " on ", host, " is hung: ", silent.why);
    events_->write("worker_hung", {{"rank", silent.rank}, {"host", host}, {"reason", silent.why}});
    // Read when it runs again (a stopped process): it must not train on.
    workers_.orderRankOut(silent.rank, controller_->generation(), strCat("rank ", silent.rank, " is hung: ", silent.why));
    metrics_.failure(JobMetrics::Failure::kWorkerHung);
    morph_.begin(strCat("rank ", silent.rank, " hung"), JobMetrics::MorphCause::kWorkerHung, now);
    apply(controller_->workerHung(silent.rank, now));
    if (finished()) return;
  }
}

void ManagerDaemon::Impl::checkProgress(TimePoint now) {
  if (!controller_ || preparingLaunch_ || controller_->phase() != Phase::kRunning) return;
  const auto hang = liveness_.findHang(controller_->runningRanks(), workers_, controller_->plan(), now);
  if (!hang) return;
  log::error(hang->reason);
  events_->write("hang", hang->event);
  // As for a silent worker: the named ones are ordered out over their own
  // connections (a stopped process reads it when it runs again), then the
  // controller kills the rest and relaunches from the latest checkpoint.
  for (const int rank : hang->ranks) workers_.orderRankOut(rank, controller_->generation(), hang->reason);
  metrics_.failure(JobMetrics::Failure::kNoProgress);
  morph_.begin(strCat("rank(s) ", hang->summary, " hung: no progress"), JobMetrics::MorphCause::kNoProgress, now);
  apply(controller_->workerHung(hang->ranks.front(), now, hang->reason));
  // A salvage goes on without every named rank (one failure counted, above).
  for (size_t i = 1; i < hang->ranks.size() && controller_->phase() == Phase::kSalvaging; ++i) {
    apply(controller_->workerHung(hang->ranks[i], now, hang->reason));
  }
}

void ManagerDaemon::Impl::watchMachineList() {
  if (joinOnly()) return;  // no list to watch
  const auto change = machineList_.poll();
  const auto now = clock_.now();
  if (!change.edited) {
    // Written again with the same text (or touched): the operator says the
    // hosts it lists are there; those out get another chance now.
    if (change.written && readmitListedHosts(now)) usableMachinesChanged();
    return;
  }
  pool_->setListed(change.machines);
  for (const auto& host : change.added) pool_->listedAdded(host);
  log::info("machine list changed: ", change.added.size(), " added ", json(change.added).dump(), ", ",
            change.removed.size(), " removed ", json(change.removed).dump());
  events_->write("machine_list_changed", {{"added", change.added}, {"removed", change.removed}});
  if (!change.removed.empty()) {
    morph_.begin("machine list shrank", JobMetrics::MorphCause::kMachinesChanged, now);
  }
  readmitListedHosts(now);  // every host it lists that was out, too
  usableMachinesChanged();
}

bool ManagerDaemon::Impl::readmitListedHosts(TimePoint now) {
  bool back = false;
  for (const auto& readmitted : pool_->readmitListed(now, &back)) {
    // Flagged slow again later, it is excluded again (a verdict equal to the
    // last one is otherwise not acted on).
    if (readmitted.value("slow", false)) reporter_->slowHostReadmitted(readmitted["host"].get<std::string>());
  }
  return back;
}

}  // namespace varuna
