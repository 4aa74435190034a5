// LivenessWatchdog: decides when ranks of the running generation are hung
// (docs/run_varuna.md, "Liveness"). Two rules:
//  - silence: a connected rank sent nothing for heartbeat_timeout_s, or a
//    launched rank never connected within startup_timeout_s;
//  - no progress: no rank finished a step for hang_timeout_s (before the
//    generation's first step: the larger of the startup and hang timeouts,
//    from the launch). The ranks named are those computing while a peer
//    waits (all of them, if none or all wait).
// It only decides; the daemon orders the named ranks out and tells the
// controller. No I/O.
#pragma once

#include <chrono>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon/worker_registry.h"
#include "varuna/manager/planner.h"

namespace varuna {

struct LivenessLimits {
  double heartbeatTimeoutS = 10;
  double startupTimeoutS = 300;
  double hangTimeoutS = 600;  // 0: the no-progress rule is off
};

class LivenessWatchdog {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  struct SilentRank {
    int rank;
    std::string why;
    std::optional<TimePoint> lastHeard;  // unset: it never connected
  };
  struct Hang {
    std::vector<int> ranks;  // the ranks named
    std::string reason;      // one line, for the log and the workers' ExitNow
    std::string summary;     // "rank(s) 1 on h, 2 on h", for the morph's cause
    nlohmann::json event;    // the `hang` event's fields
  };

  explicit LivenessWatchdog(LivenessLimits limits) : limits_(limits) {}

  // A generation was launched: the startup timeout runs until its first step.
  void launched(TimePoint now);
  TimePoint launchedAt() const { return launchedAt_; }
  // A worker's step from a heartbeat (`report` false) or a step report: the
  // generation's first step report starts the hang clock; a step that
  // advances afterwards is progress.
  void noteStep(WorkerState& worker, int64_t step, bool report, TimePoint now);

  // Walks the ranks only when one may be silent: a walk that finds every
  // running rank connected remembers the oldest last-heard time, and until
  // that is heartbeat_timeout_s old no rank can be (a rank's last-heard time
  // only moves forward). On a big job that is one walk per timeout instead
  // of one per tick (10 000 ranks: 1.2 ms of the loop every 100 ms).
  std::vector<SilentRank> silentRanks(const std::set<int>& running, const WorkerRegistry& workers, TimePoint now);
  // Whether a silent rank's silence is its agent's: a worker's beats come
  // through its agent, so while the agent, still connected, sent nothing
  // since about the rank's last beat (or nothing for a while) the agent is
  // stopped or cut off, and the agent's own timeout ends the host's part (a
  // host loss, not a hung worker). A live agent is heard on (its heartbeat),
  // so a rank that is really hung is written off at most one agent heartbeat
  // later. Comparing the two arrival times, not each with a window, keeps
  // the answer the same when the manager itself is slow to look.
  static bool silenceIsTheAgents(const SilentRank& silent, std::optional<TimePoint> agentLastHeard, TimePoint now);
  // Only for a generation whose running ranks all said hello (one that did
  // not is silentRanks' to time out).
  std::optional<Hang> findHang(const std::set<int>& running, const WorkerRegistry& workers, const Plan& plan,
                               TimePoint now) const;

 private:
  LivenessLimits limits_;
  // Set by a walk that found every running rank connected: each was heard
  // at or after this. Reset by a launch.
  std::optional<TimePoint> allHeardSince_;
  TimePoint launchedAt_{};
  std::optional<TimePoint> progressAt_;  // the last step advance; unset before the generation's first step
};

}  // namespace varuna
