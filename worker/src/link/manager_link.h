// ManagerLink: the worker's connection to run_varuna. A background thread says
// hello (job token, rank, generation), sends a heartbeat whenever nothing else
// went out for an interval (carrying the last finished step, -1 before this
// process finished one, and whether the training thread is blocked on a peer
// right then: `waiting`, see blocked_on_peers.h), forwards the step reports
// and checkpoint failures queued by the runtime, and reads what the manager
// sends (every `readInterval`):
//  - Welcome: the hello was accepted; it carries the lost-manager grace;
//  - ExitNow for this worker's generation: the generation is over; the
//    process exits at once with kExitSuperseded (76) from this thread (the
//    training thread may be blocked in c10d, so no destructor runs);
//  - Pong: the manager answers (the link pings every grace / 5);
//  - SalvageStop / SalvageWrite for this generation (docs/salvage.md): the
//    first goes to the salvage handler (which interrupts the training
//    thread's waits on peers), the second to the training thread waiting in
//    awaitSalvageWrite().
// Heartbeats of a worker started by an agent go to the agent's beat socket
// (agent_beat.h), which relays them (but the first after each connect, which
// must not reach the manager before the hello); if that socket is missing or
// fails, to the manager directly. The rest (hello, reports, pings) always goes direct.
// A worker that has not heard from the manager for the grace (no connection,
// hello refused, no answer; default kDefaultLostManagerGrace, the manager's
// Welcome sets its own) takes its generation as over and exits with
// kExitSuperseded as well: a frozen, dead or partitioned-away control plane
// never leaves it training into the store. The training never waits on the
// link: sends time out (`sendTimeout`) instead of blocking on a peer that
// stopped reading. Without a manager address (a worker started by hand or by
// varuna_launch.py) the link never connects and never exits the process.
// What is queued when the link is destroyed is still sent if the connection
// is up (a worker that ends normally reports its last failure). Owned by
// Varuna; its members are used by the link thread and by the callers of the
// public functions, under `mutex_` where marked.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "varuna/common/protocol.h"
#include "varuna/worker/varuna.h"

namespace varuna {

namespace proto {
class ControlClient;
}

// The grace a worker allows before the manager's Welcome says otherwise: the
// manager's default worker heartbeat timeout (10 s) plus the agents' default
// grace (5 s), the same as run_varuna sends with its default options.
inline constexpr std::chrono::milliseconds kDefaultLostManagerGrace{15000};

// The link's clock settings. Production uses the defaults; tests shorten them.
struct ManagerLinkTimings {
  std::chrono::milliseconds lostManagerGrace = kDefaultLostManagerGrace;  // the Welcome overrides it
  std::chrono::milliseconds readInterval{100};  // the longest an ExitNow waits to be read
  std::chrono::milliseconds connectTimeout{2000};
  std::chrono::milliseconds sendTimeout{2000};
  std::chrono::milliseconds retryInterval{1000};  // between connection attempts
};

class ManagerLink {
 public:
  // `waitingOnPeers` (may be null: never waiting) is read by the link thread
  // for each heartbeat; it must outlive the link.
  ManagerLink(ManagerLinkOptions options, int rank, ManagerLinkTimings timings = {},
              const std::atomic<bool>* waitingOnPeers = nullptr);
  ~ManagerLink();
  ManagerLink(const ManagerLink&) = delete;
  ManagerLink& operator=(const ManagerLink&) = delete;

  // Called from the training thread after each step; never blocks on I/O.
  // The report's step (steps done) is what later heartbeats carry.
  void reportStep(const proto::StepReport& report);
  void setStep(int64_t step);  // the same without a report
  // A periodic checkpoint of `step` failed (ENOSPC, EIO) and training goes on.
  // Callable from any thread (the training thread or a background checkpoint
  // copy); never blocks on I/O. `error` is cut to proto::kMaxErrorTextBytes.
  void reportCheckpointFailure(int64_t step, const std::string& error);

  // Salvage. The manager's Welcome says whether it is on (> 0: how long a
  // survivor waits for its order); 0 until a Welcome said so.
  std::chrono::milliseconds salvageTimeout() const { return std::chrono::milliseconds(salvageTimeoutMs_.load()); }
  // Called on the link thread when the manager stops the generation for a
  // salvage. Set it once the worker can salvage; a salvage_stop that comes
  // before (or after it was unset) ends the process with kExitPeerLost:
  // there is nothing to salvage yet, and the manager must not wait for it.
  void setSalvageStopHandler(std::function<void(const std::string& reason)> handler);
  // Training thread, in salvage mode: sends the report at once (before any
  // step report still queued), then waits up to `timeout` for the order to
  // write (nullopt: none came). An ExitNow ends the process meanwhile.
  void reportSalvageReady(const proto::SalvageReady& ready);
  std::optional<proto::SalvageWrite> awaitSalvageWrite(std::chrono::milliseconds timeout);

 private:
  using Clock = std::chrono::steady_clock;

  void run();
  // Link thread only. Handles one frame from the manager; exits the process on
  // an ExitNow for this generation.
  void onManagerMessage(const proto::Message& message, std::optional<proto::ControlClient>& client);
  // Link thread: a SalvageStop or SalvageWrite for this generation.
  void onSalvageOrder(const proto::Message& message);
  // Link thread only: exits the process if the manager has not been heard
  // from for the grace.
  void checkGrace(Clock::time_point now);
  [[noreturn]] void exitProcess(const std::string& why, int code = kExitSuperseded);
  // Link thread: a heartbeat to the manager, through the agent when it can.
  void sendHeartbeat(proto::ControlClient& client, int64_t step, bool waiting);
  // Link thread: a step report, through the agent when it can (it relays
  // a host's reports in one frame), else directly.
  void sendStepReport(proto::ControlClient& client, const proto::StepReport& report);

  ManagerLinkOptions options_;
  int rank_;
  ManagerLinkTimings timings_;
  const std::atomic<bool>* waitingOnPeers_;  // written by the training thread (relaxed)
  // Link thread only.
  Clock::time_point lastHeard_;  // the last frame from the manager that was not a refusal (or the start)
  Clock::time_point retryAt_;
  std::string lastProblem_;      // why the manager is not heard, for the exit message
  std::string lastRefusal_;      // logged once per text
  int agentBeatFd_ = -1;         // a private copy of the agent's beat socket; -1: beat to the manager
  bool directBeatDue_ = false;   // the first heartbeat after a (re)connect goes to the manager itself

  std::mutex mutex_;  // guards the members below it (the link thread and the callers)
  std::condition_variable wake_;
  std::deque<proto::StepReport> queue_;
  std::deque<proto::CheckpointFailed> failures_;
  std::optional<proto::SalvageReady> salvageReady_;  // to send
  std::optional<proto::SalvageWrite> salvageWrite_;  // received
  std::function<void(const std::string&)> onSalvageStop_;
  std::atomic<int64_t> salvageTimeoutMs_{0};
  int64_t step_ = -1;  // the last finished step; -1 until this process finished one
  bool stop_ = false;
  std::thread thread_;  // last: starts after every member above is initialised
};

}  // namespace varuna
