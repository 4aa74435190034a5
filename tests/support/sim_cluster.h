// SimCluster: simulated varuna_agents and their workers, speaking the control
// protocol (docs/protocol.md) to a real run_varuna: the ManagerDaemon
// in-process (SimHostLauncher starts an agent here instead of running the
// agent command), over the daemon's LocalNetwork (SimOptions::localNetwork:
// in-memory streams, no socket; the fake-clock tests) or loopback TCP; or a
// run_varuna process over loopback TCP (bench/manager_scale: a shim hands
// each host, address and agent credential over).
//
// What a simulated agent does, as varuna_agent does it:
//  - hello {role agent, host, the host's agent credential}, then Heartbeat{-1} every
//    `agentHeartbeat` unless it relayed in the last `agentBeatForward` (at most
//    500 ms) + 100 ms;
//  - LaunchWorkers: kills what still runs of an earlier launch (reported as
//    signal 9), then starts one simulated worker per rank;
//  - CheckpointAndExit: each worker exits 75 after `checkpointDelay` (none
//    does while a rank of its generation is frozen: no step finishes);
//    KillWorkers: they exit by signal 9; Shutdown: that, then the agent
//    closes; an Ack{ok: false}: the agent closes at once (its workers die);
//  - WorkerExited {host, rank, code, signal, generation} the moment one of its
//    workers exits, however it exits (a frozen agent sends its reports when
//    thawed; a gone one never);
//  - the manager's connection gone: its workers are killed after `agentGrace`.
// What a simulated worker does, as a worker's ManagerLink does:
//  - hello {role worker, host, rank, generation}; a beat {rank, step,
//    waiting} every `workerHeartbeat` (rank r's at r/N of the period), to
//    its agent, which relays the newest of each of its workers in one
//    WorkerBeats every `agentBeatForward`, as a worker started by
//    varuna_agent does (agent_beat.h); a Heartbeat to the manager instead
//    for the first beat after its hello, when `beatsThroughAgent` is off,
//    when it has no agent (a stray) or its agent is gone (a real worker's
//    fallback to direct heartbeats); none while its agent is frozen (a real
//    one's queue fills and is dropped as stale);
//  - once every rank of its generation is connected (the rendezvous), a
//    StepReport every `step` (rank r's at r/N of the period, beats re-phased
//    the same way from there, as the bench always paced them); step counts
//    from the launch's resume_step;
//  - ExitNow of its generation: exits at once with 76 (its agent reports it);
//    one of another generation is ignored; the manager's connection closed
//    without an order: exits 76 after the Welcome's lost-manager grace.
// Faults: dropAgent, freezeAgent/thawAgent (a stopped process: nothing read or
// sent, the socket kept), freezeProgress (heartbeats go on with the step
// stuck and waiting=false while every other rank of the generation waits:
// waiting=true, no steps), freezeWorker (a stopped worker process),
// exitWorker (any exit code), connectStaleWorker (a hello of any
// generation), sendPreemptNotice (role notifier + PreemptNotice), and for
// SimHostLauncher setHostReachable and failNextStarts (the agent command
// fails as an unreachable host's would; agentStartTimes says when each
// start-up was asked for).
// Every frame the manager sends to a simulated peer is recorded as an Order
// (who, type, time, the message) and every WorkerExited sent as an
// ExitReport, for tests to assert on.
// Single-threaded: every member runs on the io_context's thread (the daemon's
// own, when in-process); SimHostLauncher posts to it from launch threads.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <deque>
#include <queue>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "sim_peer.h"
#include "varuna/common/protocol.h"
#include "varuna/common/stage_map.h"
#include "varuna/manager/clock.h"

namespace varuna::sim {

using TimePoint = std::chrono::steady_clock::time_point;
using Duration = std::chrono::steady_clock::duration;

enum class PeerKind { kAgent, kWorker, kNotifier };
const char* toString(PeerKind kind);

// One frame the manager sent to a simulated peer.
struct Order {
  PeerKind to = PeerKind::kAgent;
  std::string host;
  int rank = -1;        // workers
  int generation = -1;  // workers: theirs; agents: of their latest launch (-1 before one)
  std::string type;     // proto::typeName: "launch_workers", "exit_now", ...
  TimePoint at;
  proto::Message message;
};

// A WorkerExited a simulated agent sent.
struct ExitReport {
  std::string host;
  int rank = 0;
  int exitCode = 0;  // -1: by a signal
  int signal = 0;
  int generation = 0;
  TimePoint at;
};

struct SimOptions {
  std::chrono::milliseconds tick{5};  // the one timer that paces everything below
  std::chrono::milliseconds agentHeartbeat{1000};
  std::chrono::milliseconds workerHeartbeat{500};  // 0: none
  bool beatsThroughAgent = true;                   // as varuna_agent's workers; false: each beats the manager
  bool reportsThroughAgent = false;                // step reports relayed with the beats, as varuna_agent's
  std::chrono::milliseconds agentBeatForward{250}; // an agent relays its workers' beats this often
  std::chrono::milliseconds step{200};             // a step report this often per rank; 0: none
  std::chrono::milliseconds checkpointDelay{0};    // CheckpointAndExit -> exit 75 this much later
  std::chrono::milliseconds agentGrace{5000};      // an agent that lost the manager kills its workers after this
  std::chrono::milliseconds workerStartDelay{0};   // LaunchWorkers -> the worker dials
  // At most this many workers dialling at once (0: no limit). Over TLS each
  // simulated worker's certificate and handshake take this one thread about
  // 2 ms, where real hosts make theirs in parallel: 10 000 dialling at once
  // would wait past the manager's hello deadline for this thread, not it.
  int maxDialling = 0;
  int microbatches = 8;                            // step_seconds = compute x (microbatches + stages - 1)
  // Non-empty: a checkpoint order makes every rank write its part of a
  // checkpoint of the step all ranks have finished into this store
  // (checkpoint_files.h: part, finalize with the generation's fencing) before
  // it exits 75, so relaunches resume from it; a superseded writer exits 76,
  // a failing store 74. Empty: nothing is written (a relaunch starts fresh).
  std::string globalStore;
  // Set: every peer dials this in-process network (the daemon's
  // DaemonOptions::localConnections) instead of the manager's TCP address.
  // Not owned; outlives the cluster.
  varuna::LocalNetwork* localNetwork = nullptr;
};

// Fast everything, as the daemon's sequence tests run it: beats several times
// a second, a step report every `step`, checkpoints that take
// `checkpointDelay`, agents that give up on a lost manager after a second.
inline SimOptions fastSimOptions(std::chrono::milliseconds step = std::chrono::milliseconds(100),
                                 std::chrono::milliseconds checkpointDelay = std::chrono::milliseconds(300)) {
  SimOptions options;
  options.tick = std::chrono::milliseconds(5);
  options.agentHeartbeat = std::chrono::milliseconds(200);
  options.workerHeartbeat = std::chrono::milliseconds(100);
  options.step = step;
  options.checkpointDelay = checkpointDelay;
  options.agentGrace = std::chrono::milliseconds(1000);
  return options;
}

// Hands agent start-ups from a launcher's threads to the cluster's thread
// (SimHostLauncher). `closed` once the cluster is shutting down: a start-up
// waiting for its result gives up.
struct LaunchGate {
  std::atomic<bool> closed{false};
  class SimCluster* cluster = nullptr;  // touched on the cluster's thread only
};

class SimCluster {
 public:
  struct Callbacks {
    std::function<void(const Order&)> onOrder;  // after it was recorded and acted on
    std::function<void(const std::string& host)> onAgentUp;
    // Every rank of a launch is connected (the bench's load starts here).
    std::function<void(int generation, int worldSize)> onAllWorkersConnected;
    // The manager closed a connection without an order that explains it
    // (an ExitNow, a Shutdown, a refusal), or a connect failed.
    std::function<void(const std::string& who, const std::string& reason)> onConnectionLost;
    // After each tick's sends: a driver's own paced traffic (the bench's
    // pings) goes out in the same burst, so the manager wakes once for both.
    std::function<void(TimePoint now)> onTick;
  };

  // `clock` paces every simulated peer (the daemon's own, in-process, so a
  // fake one moves both); it outlives the cluster.
  explicit SimCluster(boost::asio::io_context& io, SimOptions options = {}, varuna::Clock& clock = varuna::realClock());
  ~SimCluster();  // shutdown()
  SimCluster(const SimCluster&) = delete;
  SimCluster& operator=(const SimCluster&) = delete;

  void setCallbacks(Callbacks callbacks) { callbacks_ = std::move(callbacks); }
  const SimOptions& options() const { return options_; }

  // Starts the agent of `host`: dials `managerAddress` ("ip:port") and says
  // hello with `token`, the host's agent credential (its workers' and its
  // notifier's are derived from it). An agent of the host still running is replaced (its
  // workers die unreported, as the real agent kills an earlier one through
  // agent.pid). onResult(ok, error) once connected or failed.
  void startAgent(const std::string& host, const std::string& managerAddress, const std::string& token,
                  std::function<void(bool ok, const std::string& error)> onResult = {});
  // Closes every simulated connection and stops the tick; start-ups waiting
  // in a launcher fail. Idempotent.
  void shutdown();

  // --- faults -------------------------------------------------------------------------------
  // The agent's connection closes. withWorkers: its workers die with it
  // (unreported: an agent killed, PDEATHSIG takes them); otherwise they run on
  // until the manager orders them out (a cut agent link, a crashed agent
  // whose workers survived).
  void dropAgent(const std::string& host, bool withWorkers = false);
  // A stopped agent process (SIGSTOP): it reads nothing, sends nothing, keeps
  // its socket; its workers run on. Exits of its workers are reported when
  // it is thawed, with the orders that arrived meanwhile.
  void freezeAgent(const std::string& host);
  void thawAgent(const std::string& host);
  // `rank` of the newest generation stops finishing steps while it computes
  // (heartbeats go on: step stuck, waiting=false); every other rank of the
  // generation blocks on it (waiting=true, no steps).
  void freezeProgress(int rank);
  void thawProgress(int rank);
  // A stopped worker process: reads and sends nothing; its peers block on it.
  void freezeWorker(int rank);
  void thawWorker(int rank);
  // `rank` of the newest generation exits with `exitCode` (or by `signal`
  // when exitCode is -1); its agent reports it.
  void exitWorker(int rank, int exitCode, int signal = 0);
  // A worker that belongs to no launch of this cluster (a straggler of an
  // earlier generation or an earlier manager) dials and says hello.
  void connectStaleWorker(const std::string& host, int rank, int generation);
  // notify_manager_preempt: role notifier, one PreemptNotice (deadline 0: unknown).
  void sendPreemptNotice(const std::string& host, int64_t deadlineUnixMs = 0);
  // The agent of `host` reports `exited` as it is, whoever's rank it names
  // (a misbehaving agent). False if that agent is not up.
  bool reportAsAgentOf(const std::string& host, const proto::WorkerExited& exited);
  // For SimHostLauncher: an unreachable host's agent command fails (no agent starts).
  void setHostReachable(const std::string& host, bool reachable);
  bool hostReachable(const std::string& host) const { return !unreachable_.count(host); }
  // The next `times` start-ups of `host` fail as an unreachable host's do.
  void failNextStarts(const std::string& host, int times) { failNext_[host] = times; }
  // For SimHostLauncher: true (and one fewer left) if this start-up is to fail.
  bool takeStartFailure(const std::string& host);

  // --- what happened ------------------------------------------------------------------------
  const std::vector<Order>& orders() const { return orders_; }
  // Orders of `type` ("" any) to peers of `kind` on `host` ("" any).
  std::vector<Order> ordersTo(PeerKind kind, const std::string& host = "", const std::string& type = "") const;
  size_t count(PeerKind kind, const std::string& type, const std::string& host = "") const;
  // The LaunchWorkers `host`'s agents received, oldest first.
  std::vector<proto::LaunchWorkers> launchesTo(const std::string& host) const;
  // True if rank `rank` of `generation` received a frame of `type`.
  bool workerGot(const std::string& type, int rank, int generation) const;
  const std::vector<ExitReport>& exitReports() const { return exitReports_; }

  // --- state --------------------------------------------------------------------------------
  bool agentUp(const std::string& host) const;
  // Agent start-ups asked for (SimHostLauncher counts unreachable ones too).
  int agentStarts(const std::string& host) const;
  // When each of them was asked for (on the cluster's clock), oldest first.
  std::vector<TimePoint> agentStartTimes(const std::string& host) const;
  void countStartAttempt(const std::string& host) { startAttempts_[host].push_back(clock_.now()); }
  // The newest generation launched (-1: none) and how many were.
  int generation() const { return newestGeneration_; }
  // The credential host's agent was last started with ("" if none).
  std::string agentCredential(const std::string& host) const {
    auto it = credentials_.find(host);
    return it == credentials_.end() ? std::string() : it->second;
  }
  int launches() const { return static_cast<int>(generations_.size()); }
  int worldSize(int generation) const;
  // Workers of `generation` alive / connected (hello sent) / welcomed.
  int liveWorkers(int generation) const;
  int connectedWorkers(int generation) const;
  int welcomedWorkers(int generation) const;
  // The newest step every live rank of `generation` has finished (-2: none live).
  int64_t minStep(int generation) const;
  std::vector<int> liveRanks(int generation) const;
  // The newest step `rank` of the newest generation has finished (-2: not live).
  int64_t step(int rank) const;
  // Frames every simulated peer sent; connections lost (Callbacks::onConnectionLost).
  uint64_t framesSent() const { return framesSent_; }
  // Heartbeats: sent to the manager by workers, handed to their agents, and
  // the agents' WorkerBeats relays.
  uint64_t directHeartbeats() const { return directHeartbeats_; }
  uint64_t relayedBeats() const { return relaysBeats_; }
  uint64_t relays() const { return relays_; }
  int lostConnections() const { return lostConnections_; }
  // Sends a frame from rank `rank` of the newest generation (the bench's
  // pings); false if that worker is not connected.
  bool sendFromWorker(int rank, std::string_view frame);
  std::shared_ptr<LaunchGate> launchGate() const { return gate_; }
  boost::asio::io_context& io() { return io_; }

 private:
  struct Agent;
  struct Worker;
  struct Generation {
    int worldSize = 0;
    int connected = 0;  // ranks that have connected (once each)
    bool training = false;
    bool peerLost = false;  // a rank left otherwise than by a checkpoint: the rest block
    TimePoint epoch;  // the launch: heartbeats are phased from it
    std::optional<StageToRankMap> map;
    std::set<int> frozenRanks;
    std::optional<int64_t> checkpointStep;  // of the on-demand checkpoint under way
    bool stalled() const { return peerLost || !frozenRanks.empty(); }
  };

  void scheduleTick();
  void onTick();
  void tickAgent(Agent& agent, TimePoint now);
  // An agent's WorkerBeats, when beats are pending and its relay is due.
  void relayBeats(Agent& agent, TimePoint now);
  // The agent's next relay: the first point of its grid at or after `to`.
  void advanceRelayGrid(Agent& agent, TimePoint to);
  // Before a beat or report joins the agent's queue: when it will go out.
  void queueForRelay(Agent& agent);
  // A worker's heartbeat: through its agent, or to the manager (see above).
  void beat(Worker& worker, bool waiting);
  // Directly, or through its agent with reportsThroughAgent.
  void sendStepReport(Worker& worker, const proto::StepReport& report);
  // The agents' loop runs at the next tick at or after `at` (a beat or a grace due).
  void wakeAgentsBy(TimePoint at) { agentsWakeAt_ = std::min(agentsWakeAt_, at); }
  // (Re)queues the worker's next wake-up: the earliest of its start, beat,
  // step and exit. Called whenever one of them changes.
  void schedule(const std::shared_ptr<Worker>& worker);
  void tickWorker(const std::shared_ptr<Worker>& worker, TimePoint now);
  void onAgentMessage(const std::shared_ptr<Agent>& agent, const proto::Message& message);
  void onAgentClosed(const std::shared_ptr<Agent>& agent, const std::string& reason);
  void launch(const std::shared_ptr<Agent>& agent, const proto::LaunchWorkers& launch);
  void connectWorker(const std::shared_ptr<Worker>& worker);
  // Dials the workers waiting for a turn, up to maxDialling at once.
  void dialWaitingWorkers();
  void doneDialling(const std::shared_ptr<Worker>& worker);
  void onWorkerMessage(const std::shared_ptr<Worker>& worker, const proto::Message& message);
  void onWorkerClosed(const std::shared_ptr<Worker>& worker, const std::string& reason);
  // The worker's process ends: its connection closes, its agent reports it.
  void exitWorker(const std::shared_ptr<Worker>& worker, int exitCode, int signal, bool report = true);
  void report(Agent& agent, const proto::WorkerExited& exited);
  // The worker's part of the on-demand checkpoint (SimOptions::globalStore);
  // returns the exit code: 75, or 76 / 74 when the store refused or failed.
  int writeCheckpoint(const Worker& worker);
  void killAgentWorkers(Agent& agent, bool report);
  void closeAgent(Agent& agent);
  void record(PeerKind to, const std::string& host, int rank, int generation, const proto::Message& message);
  void lost(const std::string& who, const std::string& reason);
  bool send(SimPeer& peer, std::string_view frame);
  std::shared_ptr<Worker> find(int rank, int generation) const;
  std::shared_ptr<Agent> findAgent(const std::string& host) const;
  Generation* generationOf(int generation);
  void setManager(const std::string& managerAddress);

  boost::asio::io_context& io_;
  varuna::Clock& clock_;
  SimOptions options_;
  Callbacks callbacks_;
  std::unique_ptr<varuna::Timer> tickTimer_;
  TimePoint tickDue_{};  // the tick's cadence: a late one catches up
  boost::asio::ip::tcp::endpoint manager_;
  // Each host's agent credential (what its agent was started with): its
  // workers' and notifier's credentials derive from it (credentials.h).
  std::map<std::string, std::string> credentials_;
  std::shared_ptr<LaunchGate> gate_;
  bool shutDown_ = false;

  std::map<std::string, std::shared_ptr<Agent>> agents_;  // the newest of each host
  TimePoint agentsWakeAt_ = TimePoint::max();
  std::map<std::pair<int, int>, std::shared_ptr<Worker>> workers_;  // live, by (generation, rank)
  std::deque<std::weak_ptr<Worker>> waitingToDial_;  // maxDialling: their turn to dial
  int dialling_ = 0;
  std::vector<std::shared_ptr<Worker>> strays_;  // connectStaleWorker's, until they close
  struct Wake {
    TimePoint at;
    std::shared_ptr<Worker> worker;  // stale once worker->wakeAt != at
    bool operator>(const Wake& other) const { return at > other.at; }
  };
  std::priority_queue<Wake, std::vector<Wake>, std::greater<Wake>> wakes_;
  std::vector<std::shared_ptr<Worker>> due_;  // the tick's, reused
  std::vector<std::shared_ptr<SimPeer>> notifiers_;
  std::map<int, Generation> generations_;
  int newestGeneration_ = -1;
  std::set<std::string> unreachable_;
  std::map<std::string, std::vector<TimePoint>> startAttempts_;
  std::map<std::string, int> failNext_;
  uint64_t agentsConnected_ = 0;

  std::vector<Order> orders_;
  std::vector<ExitReport> exitReports_;
  uint64_t framesSent_ = 0;
  uint64_t directHeartbeats_ = 0, relaysBeats_ = 0, relays_ = 0;
  int lostConnections_ = 0;
};

}  // namespace varuna::sim
