// StepProgress: the job's progress as the workers report it. A step counts
// once every rank of the generation reported it (its loss, its slowest
// rank's time); then the progress line is printed, at most once a second,
// with the throughput over the steps since the last line (not one noisy step).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "varuna/common/protocol.h"
#include "varuna/manager/planner.h"

namespace varuna {

class StepProgress {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  struct Step {
    int64_t step = -1;
    double loss = 0;
    double maxStepSeconds = 0;
    bool firstOfGeneration = false;  // the generation's first complete step (a morph is over)
  };

  explicit StepProgress(int64_t globalBatch) : globalBatch_(globalBatch) {}

  // A launch: reports of earlier generations no longer count.
  void newGeneration();
  // A rank's report: the step, once `worldSize` ranks reported it.
  std::optional<Step> add(const proto::StepReport& report, int worldSize);
  // The progress line for a complete step (at most once a second);
  // `checkpoint` says where the last checkpoint is.
  void print(const Step& step, const Plan& plan, const std::string& checkpoint, TimePoint now);

  int64_t lastStep() const { return lastStep_; }
  double lastLoss() const { return lastLoss_; }
  nlohmann::json toJson() const;

 private:
  struct Reports {
    int count = 0;
    double maxStepSeconds = 0;
    double loss = 0;
  };
  int64_t globalBatch_;
  std::map<int64_t, Reports> steps_;
  int64_t lastStep_ = -1;
  double lastLoss_ = 0;
  double samplesPerSecond_ = 0;
  bool firstSeen_ = false;         // the generation's first complete step
  TimePoint lastPrint_{};
  int64_t printMarkStep_ = -1;     // step of the last progress line
};

}  // namespace varuna
