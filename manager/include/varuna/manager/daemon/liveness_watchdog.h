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

#include "varuna/manager/daemon/worker_registry.h"
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

  std::vector<SilentRank> silentRanks(const std::set<int>& running, const WorkerRegistry& workers, TimePoint now) const;
  // Only for a generation whose running ranks all said hello (one that did
  // not is silentRanks' to time out).
  std::optional<Hang> findHang(const std::set<int>& running, const WorkerRegistry& workers, const Plan& plan,
                               TimePoint now) const;

 private:
  LivenessLimits limits_;
  TimePoint launchedAt_{};
  std::optional<TimePoint> progressAt_;  // the last step advance; unset before the generation's first step
};

}  // namespace varuna
