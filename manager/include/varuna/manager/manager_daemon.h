// ManagerDaemon: run_varuna's event loop. Owns the MorphController and carries
// out its actions; everything else is I/O around it:
//  - a TCP listener for agents, workers and notify_manager_preempt (control
//    protocol, job token checked on the first frame),
//  - agent start-up on every host through a HostLauncher (threads, results
//    posted back), agent and worker heartbeats, step reports (progress line,
//    slow-machine detector),
//  - the watched machine list, state.json, events.jsonl and slow_machines.out
//    in the state folder.
// Single-threaded: every member runs on the io_context's thread; the launcher
// threads only post results back (and are joined when their result arrives),
// and so does the BackgroundWorker that looks at the checkpoint store and
// the one that runs AutoConfig (with a profile): the loop never waits on the
// store's filesystem or on planning (docs/architecture.md, "Threads").
// The loop never blocks on a peer and never dies of a handler: every handler
// it gives to Asio and every connection callback runs under one HandlerGuard
// (a failure is logged, rate-limited, and handled: a timer re-arms, a state
// write is retried at the next tick); connections without a hello are capped
// and get a deadline (PendingConnections); a failing accept (EMFILE) backs
// off. docs/run_varuna.md ("Connections and limits") has the numbers.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "varuna/common/profile.h"
#include "varuna/manager/async_planner.h"
#include "varuna/manager/autoconfig.h"
#include "varuna/manager/background_worker.h"
#include "varuna/manager/checkpoint_scan.h"
#include "varuna/manager/event_log.h"
#include "varuna/manager/framed_connection.h"
#include "varuna/manager/handler_guard.h"
#include "varuna/manager/host_launcher.h"
#include "varuna/manager/job_config.h"
#include "varuna/manager/morph_controller.h"
#include "varuna/manager/morph_timer.h"
#include "varuna/manager/pending_connections.h"
#include "varuna/manager/rate_limiter.h"
#include "varuna/manager/slow_machine_detector.h"

namespace varuna {

// AutoConfig's request for this job (machines filled in by the caller).
AutoConfigRequest autoConfigSettings(const JobConfig& config);
// --dry_run: the plan run_varuna would launch on the machine list now (with
// AutoConfig's ranked table when a profile is given). Throws ConfigError.
std::string dryRunReport(const JobConfig& config);

class ManagerDaemon {
 public:
  ManagerDaemon(boost::asio::io_context& io, JobConfig config, std::unique_ptr<HostLauncher> launcher,
                PendingLimits pendingLimits = {});
  ~ManagerDaemon();

  // Binds the control port, starts the agents; the job starts when they are up.
  // Throws ConfigError for a bad setup (machine list, state folder, port).
  void start();
  // SIGTERM/SIGINT: checkpoint and stop (a second request kills at once).
  void requestStop(const std::string& reason);
  int exitCode() const { return exitCode_; }
  uint16_t port() const { return port_; }

  // The seam to the checkpoint store's scan (default scanCheckpointStore),
  // e.g. a slow one in tests. Before start(); called on a background thread.
  void setStoreScanner(StoreScanner scanner) { storeScanner_ = std::move(scanner); }

  // Introspection (tests, state.json).
  size_t pendingConnections() const { return pending_.size(); }
  size_t launchThreads() const { return launchThreads_.size(); }
  uint64_t acceptFailures() const { return acceptFailures_; }
  uint64_t handlerFailures() const { return guard_->failures(); }
  bool stateWriteFailing() const { return stateWriteFailing_; }

  // Accept errors that mean "out of descriptors or memory" back off from
  // this, doubling, to kAcceptBackoffMax.
  static constexpr std::chrono::milliseconds kAcceptBackoffMin{50};
  static constexpr std::chrono::milliseconds kAcceptBackoffMax{1000};

 private:
  enum class AgentStatus { kStarting, kUp, kFailed, kGone };
  struct AgentState {
    AgentStatus status = AgentStatus::kStarting;
    std::shared_ptr<FramedConnection> connection;
    TimePoint lastSeen{};
    bool released = false;  // sent Shutdown: its loss is expected
    // Kept across start-ups (startAgent): which start-up is under way, and
    // whether its launch thread is still running (one at a time per host).
    uint64_t attempt = 0;
    bool launching = false;
  };
  // A listed host out of the job, and when it may come back
  // (docs/run_varuna.md, "When lost, preempted and slow hosts come back").
  struct HostAbsence {
    std::string why;  // the first reason: "lost", "agent_failed", "preempted", "slow", "released"
    TimePoint since{};
    std::optional<TimePoint> retryAt;      // its agent's next start-up (none: when the list is written)
    std::chrono::milliseconds backoff{0};  // the wait after the next failed start-up or loss
    std::optional<TimePoint> preemptedUntil;  // the notice's deadline: not back before it
    bool slow = false;                        // --exclude_slow: back only when the list is written
    int attempts = 0;                         // start-ups since it went
  };
  struct WorkerState {
    std::shared_ptr<FramedConnection> connection;
    TimePoint lastSeen{};
    bool connected = false;
    int64_t step = -1;     // the last finished step it reported (heartbeat or step report)
    bool waiting = false;  // its last heartbeat: blocked on a peer, not computing
  };
  // What a launch needs from the store, fetched off the loop.
  struct LaunchPrep {
    std::string recordError;  // the generation record could not be written
    StoreScan scan;
  };
  struct StepAggregate {
    int reports = 0;
    double maxStepSeconds = 0;
    double loss = 0;
  };

  // Connections.
  void doAccept();
  void onAccept(const boost::system::error_code& ec, boost::asio::ip::tcp::socket socket);
  // A failed accept: at once again for an error of that one connection,
  // after a backoff for a lack of descriptors or memory.
  void onAcceptFailed(const boost::system::error_code& ec);
  // Agents being started and launched workers that have not said hello:
  // peers a burst of connections may legitimately come from.
  size_t expectedHellos() const;
  // Rate-limited summary of connections closed before their hello.
  void reportDroppedConnections(TimePoint now);
  void onFirstMessage(const std::shared_ptr<FramedConnection>& connection, const proto::Message& message);
  void onAgentHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello);
  void onWorkerHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello);
  void onNotifierHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello);
  void onAgentMessage(const std::string& host, const proto::Message& message);
  void onWorkerMessage(int rank, const proto::Message& message);
  void onAgentLost(const std::string& host, const std::string& reason);
  // Ending a generation reaches its workers over their own connections too
  // (ExitNow), whatever their agents' state (frozen, dead, cut off): every
  // connected worker of workers_ is ordered out and leaves workers_.
  void orderWorkersToExit(const std::string& reason);
  // One connection: ExitNow, then nothing it sends counts; it is kept (in
  // exitOrdered_) until the worker's exit closes it.
  void orderWorkerToExit(const std::shared_ptr<FramedConnection>& connection, int generation, const std::string& reason);

  // Agents.
  void startAgent(const std::string& host);
  // Joins a launch thread whose result has arrived (it is returning).
  void reapLaunchThread(uint64_t id);
  std::string agentCommand(const std::string& host) const;
  void onAgentCommandDone(const std::string& host, const HostCommandResult& result);
  void agentFailed(const std::string& host, const std::string& message);
  void maybeStartJob();
  std::vector<Machine> usableMachines() const;
  void usableMachinesChanged();

  // Hosts that come back. markAbsent records why a host is out (the first
  // reason stays) and, for a loss or a failed start-up, when its agent is
  // started again (the backoff doubles per failure).
  HostAbsence& markAbsent(const std::string& host, const std::string& why, TimePoint now);
  void scheduleRetry(const std::string& host, TimePoint now);
  // The tick: starts the agents of absent hosts whose retry is due; readmits
  // preempted hosts whose agent still answers after the notice's deadline.
  void retryAbsentHosts(TimePoint now);
  // True when nothing keeps `host` out but its agent (not slow, past the notice).
  bool mayComeBack(const HostAbsence& absence, TimePoint now) const;
  // The host is usable again: the host_back event, the controller forgets
  // its exclusion. The caller calls usableMachinesChanged.
  void hostBack(const std::string& host, const std::string& how);
  // The machine list was written (any write): every host it lists that is
  // out is given another chance at once. True if one is back already.
  bool readmitListedHosts(TimePoint now);
  bool isListed(const std::string& host) const;
  // Heartbeat{-1, 0} to every connected agent once a second: an agent that
  // hears nothing from the manager for heartbeat_timeout_s + agent_grace_s
  // takes it as gone (--lost_manager_ms).
  void sendAgentHeartbeats(TimePoint now);

  // The controller's actions.
  void apply(const std::vector<Action>& actions);
  // A launch in two halves: doLaunch writes the generation record and scans
  // the store (for the checkpoint to resume from) on storeWorker_;
  // finishLaunch sends the workers out when that is back. If the controller
  // moved on meanwhile (a failure, a notice, a stop), abandonLaunch tells it
  // that no worker of the launch ever ran.
  void doLaunch(const action::Launch& launch);
  void finishLaunch(action::Launch launch, const LaunchPrep& prep);
  void abandonLaunch(const action::Launch& launch);
  void sendToAgentsOfPlan(const proto::Message& message);
  void doStop(const action::Stop& stop);
  void finishShutdown();

  // Periodic work.
  void scheduleTick();
  void onTick();
  void checkHeartbeats(TimePoint now);
  // The liveness rule (docs/run_varuna.md, "Liveness"): no rank of the
  // running generation finished a step for hang_timeout_s (before its first
  // step: startup_timeout_s since the launch): the generation is hung. The
  // ranks named are those computing while a peer waits (all, if none or all wait).
  void checkProgress(TimePoint now);
  // A worker's step (heartbeat or step report): progress when it advanced.
  void noteWorkerStep(WorkerState& worker, int64_t step, TimePoint now);
  void watchMachineList();
  // Once a second: a store scan on storeWorker_ (at most one in flight),
  // its result to onStoreScanned. `final`: the last one, at the stop (queued
  // even if one is in flight: that one may predate the final checkpoint).
  void watchCheckpoints(bool final = false);
  void onStoreScanned(const StoreScan& scan, bool final);
  // A scan's newest checkpoint: checkpoint_complete when it is new.
  void noteLatestCheckpoint(std::optional<int64_t> latest, TimePoint now);
  // The newest complete checkpoint that is not marked damaged and has the
  // sizes of its manifest, from a scan; writes a `checkpoint_skipped` event
  // (once per step) for each complete-looking one passed over. If the store
  // could not be read, logs it and returns the last one known.
  std::optional<int64_t> readStoreScan(const StoreScan& scan);
  StoreScanRequest storeScanRequest(bool thorough) const;

  // Reporting.
  void onStepReport(const proto::StepReport& report);
  void onCheckpointFailed(int rank, const proto::CheckpointFailed& failure);
  void onSlowVerdict(const std::vector<SlowMachine>& slow);
  // state.json now; on failure logged (rate-limited) and retried at every tick.
  void writeState();
  void writeStateFile();  // throws
  const nlohmann::json& cachedPlanJson();
  void printSummary();

  boost::asio::io_context& io_;
  JobConfig config_;
  std::unique_ptr<HostLauncher> launcher_;
  // Every handler and connection callback runs under it (shared with the
  // connections, which may outlive a handler).
  std::shared_ptr<HandlerGuard> guard_ = std::make_shared<HandlerGuard>();
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer tickTimer_;
  boost::asio::steady_timer acceptRetryTimer_;
  std::chrono::milliseconds acceptBackoff_{0};  // 0: the last accept worked
  uint64_t acceptFailures_ = 0;
  RateLimiter acceptFailureLog_{std::chrono::seconds(10), 1};
  uint16_t port_ = 0;
  std::string advertisedAddress_;  // host:port agents and workers dial
  std::string token_;
  std::string profiledPieces_;  // --profile's pieces as JSON [[name, parameters], ...], for the workers
  std::vector<std::pair<std::string, std::string>> env_;  // env_file
  std::unique_ptr<EventLog> events_;
  std::unique_ptr<MorphController> controller_;
  SlowMachineDetector slowDetector_;
  // Agent start-ups under way, by id; each is joined when its result is posted back.
  std::map<uint64_t, std::thread> launchThreads_;
  uint64_t nextLaunchThread_ = 0;

  std::vector<Machine> listed_;  // the machine list as last read
  std::string listedText_;
  std::string listedIdentity_;  // its inode, size and mtime then: a write of the same text shows there
  std::map<std::string, AgentState> agents_;
  std::set<std::string> preempted_;
  std::map<std::string, HostAbsence> absent_;  // listed hosts out of the job, by host
  // When each host came back and its backoff then: one lost again within
  // host_retry_max_s (flapping) continues that backoff instead of starting over.
  std::map<std::string, std::pair<TimePoint, std::chrono::milliseconds>> returned_;
  TimePoint lastAgentHeartbeat_{};
  PendingConnections pending_;  // before their hello: capped, with a deadline
  uint64_t closedBeforeHello_ = 0;  // by the peer, or for a bad or oversized first frame
  struct DropCounts {
    uint64_t closed = 0, expired = 0, evicted = 0;
    bool operator==(const DropCounts&) const = default;
  };
  DropCounts dropsLogged_, dropsRecorded_;  // totals when last logged / written to the event log
  TimePoint dropsLoggedAt_{}, dropsRecordedAt_{};
  std::map<int, WorkerState> workers_;                   // current generation
  std::set<std::shared_ptr<FramedConnection>> exitOrdered_;  // workers sent ExitNow, until they close
  TimePoint launchedAt_{};
  bool jobStarted_ = false;
  bool stopping_ = false;
  bool finished_ = false;
  int exitCode_ = 0;
  std::string stopReason_;

  std::map<int64_t, StepAggregate> steps_;
  int64_t lastStep_ = -1;
  double lastLoss_ = 0, lastSamplesPerSecond_ = 0;
  int64_t firstStepOfGeneration_ = -1;
  TimePoint lastProgressPrint_{};
  int64_t progressMarkStep_ = -1;  // step of the last progress line
  std::optional<int64_t> lastCheckpoint_;
  std::set<int64_t> skippedCheckpoints_;   // reported as checkpoint_skipped
  int checkpointFailures_ = 0;             // CheckpointFailed reports of every generation
  nlohmann::json lastCheckpointFailure_;   // the newest one, for state.json
  std::string storeReadError_;             // the last error reading the store (logged once per text)
  TimePoint lastCheckpointSeen_{};
  TimePoint lastCheckpointPoll_{};
  TimePoint lastListPoll_{};
  TimePoint lastStateWrite_{};
  bool stateWriteFailing_ = false;  // retried at every tick until it works
  RateLimiter stateWriteLog_{std::chrono::seconds(30), 1};
  TimePoint startedAt_{};
  MorphTimer morph_;  // the morph under way, for the morph_complete event
  int morphs_ = 0;
  std::vector<std::string> slowHosts_;
  nlohmann::json planJson_;
  int planJsonGeneration_ = -1;

  // Liveness (checkProgress).
  std::optional<TimePoint> progressAt_;  // the running generation's last step advance; unset before its first step
  bool launchPreparing_ = false;         // doLaunch's store work is under way: no worker runs yet

  // Off the loop. Declared last: destroyed first, so no result of theirs
  // reaches a half-destroyed daemon (their destructors drop what is queued
  // and wait for the job running).
  StoreScanner storeScanner_ = scanCheckpointStore;
  bool scanInFlight_ = false;     // a periodic scan is queued or running
  bool finalScanDone_ = true;     // false from the stop until its final scan is back
  TimePoint shutdownWaitSince_{};  // finishShutdown waits for the final scan from then (bounded)
  std::unique_ptr<AsyncPlanner> planner_;            // with a profile: AutoConfig off the loop
  std::unique_ptr<BackgroundWorker> planWorker_;     // AutoConfig's runs (planner_)
  std::unique_ptr<BackgroundWorker> storeWorker_;    // store scans and generation records
};

}  // namespace varuna
