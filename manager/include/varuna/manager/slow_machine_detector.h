// SlowMachineDetector: finds machines that hold their pipeline stage back.
// Per stage, each replica's mean compute time per micro-batch over the last
// `window` steps is compared with the stage's median; a rank more than
// `threshold` slower (0.15 = 15 %) flags its host. Pure; owned by the
// manager's event-loop thread. A verdict comes out each time every rank of the
// current plan has reported `window` new steps; a rank is named only when it
// was also over the threshold in the window before (one noisy window on a
// shared machine is not a slow machine).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "varuna/common/protocol.h"
#include "varuna/manager/planner.h"

namespace varuna {

struct SlowMachine {
  std::string host;
  int rank = 0, stage = 0;
  double meanSeconds = 0;         // this rank's mean compute time per micro-batch
  double stageMedianSeconds = 0;  // the median over the stage's replicas
  double ratio() const { return stageMedianSeconds > 0 ? meanSeconds / stageMedianSeconds : 0; }
};

class SlowMachineDetector {
 public:
  SlowMachineDetector(double threshold, int window) : threshold_(threshold), window_(window) {}
  // A new plan (generation): forget all samples.
  void reset(const Plan& plan);
  // Returns a verdict (possibly empty: nobody slow) once a window is complete.
  std::optional<std::vector<SlowMachine>> add(const proto::StepReport& report);

 private:
  // One per rank of the plan, indexed by rank: a report costs O(1) and no
  // allocation (10 000 ranks report every step).
  struct RankWindow {
    bool placed = false;
    std::string host;
    int stage = 0;
    double sum = 0;  // compute s/micro-batch over this window's reports, in their order
    int count = 0;
    bool overBefore = false;  // over the threshold in the previous window
  };
  std::vector<SlowMachine> verdict();

  double threshold_;
  int window_;
  std::vector<RankWindow> ranks_;
  size_t placedRanks_ = 0;
  size_t ranksWithFullWindow_ = 0;
};

// slow_machines.out: one line per flagged machine, written atomically.
std::string formatSlowMachines(const std::vector<SlowMachine>& slow);

}  // namespace varuna
