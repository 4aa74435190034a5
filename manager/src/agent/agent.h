// Agent: the per-host process of a job (the `varuna_agent` binary). run_varuna
// starts one on every host (directly or over SSH); it dials the manager, then
//  - spawns the host's workers on LaunchWorkers (argv + launcher arguments +
//    torchrun-style environment, in code_dir, each in its own process group,
//    output to <run_dir>/logs/g<generation>_rank<r>.log),
//  - reports every worker exit to the manager the moment it reaps it,
//  - forwards CheckpointAndExit as SIGUSR1, kills on KillWorkers, exits on
//    Shutdown or SIGTERM/SIGINT (killing its workers first),
//  - kills its workers and exits when the manager connection has been gone
//    for `grace`, or when no frame at all came from the manager for
//    `lostManager` (a silent partition: the connection stays up but nothing
//    arrives; the manager sends a heartbeat every second), so no orphan keeps
//    a device busy,
//  - starts every worker with SIGUSR1 blocked: a checkpoint request that
//    arrives before the worker's program installed its handler stays pending
//    instead of killing it (installCheckpointSignalHandler unblocks it),
//  - relays its workers' heartbeats: each worker of a launch beats over a
//    Unix datagram socket the agent hands it (agent_beat.h); every
//    `beatForwardInterval` the newest beat of each worker, and every step
//    report they sent, go to the manager in one WorkerBeats frame (the last
//    ones before a worker's WorkerExited),
//  - spawns every worker with a parent-death signal (SIGKILL): an agent that
//    dies without cleaning up (OOM-killed, SIGKILL, a crash) takes its
//    workers along. (A frozen agent cannot act: run_varuna then orders its
//    workers out over their own connections, docs/run_varuna.md.)
// Everything runs on the io_context passed in (the parent-death signal
// follows the thread that forked, so spawning must stay on that one thread),
// but capping the logs' sizes, which copies files, on a thread of its own.
#pragma once

#include <sys/types.h>

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <array>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "varuna/common/protocol.h"
#include "agent/run_dir.h"
#include "agent/scheduler_notice.h"
#include "loop/background_worker.h"
#include "loop/framed_connection.h"

namespace varuna {

struct AgentOptions {
  std::string host;        // as named in the machine list
  std::string job;
  // This host's agent credential (credentials.h), from run_varuna: its hello
  // carries it; its notifier's and its workers' credentials derive from it.
  std::string credential;
  std::string runDir;      // logs, pid file, connection.json
  std::chrono::milliseconds grace{5000};
  // No frame (heartbeat, order, ack, pong) from the manager for this long:
  // the manager is lost even though the connection is up. run_varuna passes
  // (heartbeat_timeout_s + agent_grace_s) * 1000 (--lost_manager_ms). It
  // relies on the manager's heartbeats: manager and agent come from the same
  // build (an older manager that sends none would make idle agents exit).
  std::chrono::milliseconds lostManager{15000};
  std::chrono::milliseconds heartbeatInterval{1000};
  std::chrono::milliseconds killWait{3000};  // SIGTERM -> SIGKILL
  // How often the workers' heartbeats are relayed (when any came): well
  // under the manager's heartbeat timeout (--beat_relay_ms: run_varuna
  // passes a twentieth of it). A relay is a frame from this agent too, so
  // the agent's own heartbeat is left out while relays flow.
  std::chrono::milliseconds beatForwardInterval{250};
  // A SIGTERM is the scheduler's preemption notice: the host goes this long
  // after it (scheduler_notice.h). 0: a SIGTERM stops the agent at once.
  std::chrono::milliseconds sigtermNotice{0};
};

class Agent {
 public:
  // `manager` is an already-connected stream (the hello is sent by start()).
  Agent(boost::asio::io_context& io, AgentOptions options, std::unique_ptr<ByteStream> manager,
        std::string managerAddress);
  void start();
  // Exit code for main() once the io_context ran out of work.
  int exitCode() const { return exitCode_; }

 private:
  struct Worker {
    int rank = 0;
    int generation = 0;
    std::string logPath;
  };

  void onMessage(const proto::Message& message);
  void onManagerLost(const std::string& reason);
  void launch(const proto::LaunchWorkers& launch);
  // `beatFd`: the workers' end of the launch's beat socket (-1: none).
  pid_t spawn(const std::string& program, const proto::LaunchWorkers& launch, const proto::WorkerSpec& spec,
              const std::string& logPath, int beatFd);
  // A new beat socket for a launch of `generation`; returns the workers' end
  // (the caller closes it once they are spawned), -1 if none could be made
  // (the workers then beat to the manager directly).
  int openBeatSocket(int generation);
  void readBeats();
  // One datagram from a worker: a beat (the newest per rank is kept) or a
  // step report (each is kept, in order).
  void onBeatRecord(const char* data, size_t bytes);
  // Reads what the beat socket holds now, without waiting.
  void drainBeats();
  // Sends what is pending in one WorkerBeats frame.
  void relayBeats();
  // The first relay at a random point of the interval (protocol.h,
  // firstRelayDelay), then one every interval.
  void scheduleBeatForward(std::chrono::milliseconds delay);
  void signalWorkers(int signal, bool wholeGroup);
  void killWorkers(const std::string& reason);
  void reapChildren();
  void waitSignals();
  void scheduleHeartbeat();
  void scheduleLogCap();
  static void reportLogCap(const LogCapResult& result);
  // The read deadline: fires lostManager after the last frame from the manager.
  void scheduleReadDeadline();
  void finish(int exitCode, const std::string& reason);
  void maybeExit();
  // A SIGTERM with sigtermNotice set: tell the manager, leave when it is done.
  void onSchedulerNotice();
  void leaveIfPreemptedAndIdle();

  boost::asio::io_context& io_;
  AgentOptions options_;
  std::shared_ptr<FramedConnection> manager_;
  std::string managerAddress_;
  boost::asio::signal_set signals_;
  boost::asio::steady_timer heartbeatTimer_;
  // capLogs every kLogCapInterval, on logCapper_'s thread.
  static constexpr std::chrono::seconds kLogCapInterval{10};
  boost::asio::steady_timer logCapTimer_;
  std::shared_ptr<std::atomic<bool>> stopLogCap_ = std::make_shared<std::atomic<bool>>(false);
  BackgroundWorker logCapper_;
  boost::asio::steady_timer graceTimer_;
  boost::asio::steady_timer readDeadlineTimer_;
  // When the last frame from the manager arrived (or start()): the read
  // deadline counts from it. Set per frame; the timer re-arms only when it
  // fires, so a frame costs no timer operation.
  std::chrono::steady_clock::time_point lastFrame_;
  boost::asio::steady_timer killTimer_;
  // The current launch's beat socket, the newest beat of each of its ranks
  // since the last relay, and the relay's timer.
  boost::asio::local::datagram_protocol::socket beatSocket_;
  std::array<char, 64> beatBuffer_{};
  int beatGeneration_ = -1;
  uint64_t beatEpoch_ = 0;  // one per beat socket: a read of an earlier one is dropped
  std::map<int, proto::WorkerBeat> pendingBeats_;
  static constexpr size_t kMaxPendingReports = 100000;
  // A report is at most about 200 bytes of JSON: 2 000 keep a frame far under 1 MiB.
  static constexpr size_t kReportsPerRelay = 2000;
  std::vector<proto::StepReport> pendingReports_;
  uint64_t droppedReports_ = 0;  // over kMaxPendingReports (logged once)
  boost::asio::steady_timer beatForwardTimer_;
  // The last relay's time: a heartbeat tick within one relay interval (and a
  // margin) of it sends nothing, so the manager hears from this agent at least
  // every heartbeat interval plus that, relays or not.
  std::chrono::steady_clock::time_point lastRelay_{};
  std::map<pid_t, Worker> workers_;
  SchedulerNotice schedulerNotice_;
  bool noticeAcknowledged_ = false;
  bool exiting_ = false;
  int exitCode_ = 0;
};

// The agent's run folder layout and the connection file notify_manager_preempt
// reads: {"manager", "token" (the host's notifier credential), "host", "job"}
// (mode 0600).
std::string defaultAgentRunDir(const std::string& job, const std::string& host);
void writeConnectionFile(const std::string& runDir, const std::string& managerAddress, const AgentOptions& options);

// Kills an agent of the same job left on this host by an earlier manager
// (found through <run_dir>/agent.pid), then records our pid.
void replacePreviousAgent(const std::string& runDir);

// "./train_gpt" relative to code_dir, or a name on PATH: the absolute path, or
// a ConfigError saying where it looked.
std::string resolveProgram(const std::string& program, const std::string& codeDir);

// Last `maxLines` lines of a file (for exit reports).
std::string tailOfFile(const std::string& path, int maxLines);

}  // namespace varuna
