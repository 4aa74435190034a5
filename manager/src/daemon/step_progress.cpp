#include "daemon/step_progress.h"

#include <algorithm>
#include <cstdio>

#include "varuna/common/log.h"

namespace varuna {

void StepProgress::newGeneration() {
  steps_.clear();
  firstSeen_ = false;
}

std::optional<StepProgress::Step> StepProgress::add(const proto::StepReport& report, int worldSize) {
  // A report of a step already complete (a rank's report that went
  // directly and overtook its relayed ones) completes nothing.
  if (firstSeen_ && report.step <= lastStep_) return std::nullopt;
  Reports& reports = steps_[report.step];
  ++reports.count;
  reports.maxStepSeconds = std::max(reports.maxStepSeconds, report.stepSeconds);
  reports.loss = report.loss;
  if (reports.count < worldSize) return std::nullopt;
  Step done{report.step, reports.loss, reports.maxStepSeconds, false};
  steps_.erase(steps_.begin(), steps_.upper_bound(report.step));
  lastStep_ = done.step;
  lastLoss_ = done.loss;
  samplesPerSecond_ = done.maxStepSeconds > 0 ? static_cast<double>(globalBatch_) / done.maxStepSeconds : 0;
  if (!firstSeen_) {
    firstSeen_ = true;
    done.firstOfGeneration = true;
    printMarkStep_ = -1;  // throughput restarts with the new plan
  }
  return done;
}

void StepProgress::print(const Step& step, const Plan& plan, const std::string& checkpoint, TimePoint now) {
  if (now - lastPrint_ < std::chrono::seconds(1)) return;
  // Throughput over the steps since the last line, not one noisy step.
  if (printMarkStep_ >= 0 && step.step > printMarkStep_ && lastPrint_ != TimePoint{}) {
    samplesPerSecond_ = static_cast<double>((step.step - printMarkStep_) * globalBatch_) /
                        std::chrono::duration<double>(now - lastPrint_).count();
  }
  printMarkStep_ = step.step;
  lastPrint_ = now;
  char figures[128];
  std::snprintf(figures, sizeof(figures), "loss %.4f | %.1f samples/s | step %.3f s", step.loss, samplesPerSecond_,
                step.maxStepSeconds);
  log::info("step ", step.step, " | ", figures, " | ", plan.stages, "x", plan.replicas, " on ", plan.hosts.size(),
            " host(s) | ", checkpoint);
}

nlohmann::json StepProgress::toJson() const {
  return {{"step", lastStep_}, {"loss", lastLoss_}, {"samples_per_s", samplesPerSecond_}};
}

}  // namespace varuna
