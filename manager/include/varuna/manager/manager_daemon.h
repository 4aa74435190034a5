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
// threads only post results back (and are joined when their result arrives).
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
#include "varuna/manager/autoconfig.h"
#include "varuna/manager/event_log.h"
#include "varuna/manager/framed_connection.h"
#include "varuna/manager/handler_guard.h"
#include "varuna/manager/host_launcher.h"
#include "varuna/manager/job_config.h"
#include "varuna/manager/morph_controller.h"
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
  };
  struct WorkerState {
    std::shared_ptr<FramedConnection> connection;
    TimePoint lastSeen{};
    bool connected = false;
  };
  struct StepAggregate {
    int reports = 0;
    double maxStepSeconds = 0;
    double loss = 0;
  };
  struct MorphTimes {  // phases of the morph under way, for the event log
    std::string cause;
    TimePoint begin{}, launched{}, connected{};
    bool active = false;
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

  // The controller's actions.
  void apply(const std::vector<Action>& actions);
  void doLaunch(const action::Launch& launch);
  void sendToAgentsOfPlan(const proto::Message& message);
  void doStop(const action::Stop& stop);
  void finishShutdown();

  // Periodic work.
  void scheduleTick();
  void onTick();
  void checkHeartbeats(TimePoint now);
  void watchMachineList();
  void watchCheckpoints(TimePoint now);
  // The newest complete checkpoint that is not marked damaged and has the
  // sizes of its manifest; writes a `checkpoint_skipped` event (once per step)
  // for each complete-looking one passed over. If the store cannot be read,
  // logs it and returns the last one known.
  std::optional<int64_t> findLatestCheckpoint();

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
  std::map<std::string, AgentState> agents_;
  std::set<std::string> preempted_;
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
  MorphTimes morph_;
  int morphs_ = 0;
  std::vector<std::string> slowHosts_;
  nlohmann::json planJson_;
  int planJsonGeneration_ = -1;
};

}  // namespace varuna
