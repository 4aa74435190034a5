#include "varuna/manager/slow_machine_detector.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "varuna/common/stage_map.h"

namespace varuna {

void SlowMachineDetector::reset(const Plan& plan) {
  hostOf_.clear();
  samples_.clear();
  stageOf_.clear();
  overBefore_.clear();
  ranksWithFullWindow_ = 0;
  const auto map = StageToRankMap::parse(plan.stageToRankMap);
  for (const auto& p : plan.placement) {
    hostOf_[p.rank] = p.host;
    stageOf_[p.rank] = map.stageOf(p.rank);
  }
}

std::optional<std::vector<SlowMachine>> SlowMachineDetector::add(const proto::StepReport& report) {
  if (!hostOf_.count(report.rank) || report.computeSecondsPerMicrobatch <= 0) return std::nullopt;
  auto& values = samples_[report.rank];
  values.push_back(report.computeSecondsPerMicrobatch);
  if (static_cast<int>(values.size()) == window_) ++ranksWithFullWindow_;  // O(1) per report at 1000 ranks
  if (ranksWithFullWindow_ < hostOf_.size()) return std::nullopt;
  std::map<int, std::vector<std::pair<int, double>>> byStage;  // stage -> (rank, mean)
  for (const auto& [rank, values] : samples_) {
    const double mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
    byStage[stageOf_.at(rank)].emplace_back(rank, mean);
  }
  std::vector<SlowMachine> slow;
  std::set<int> over;
  for (const auto& [stage, ranks] : byStage) {
    if (ranks.size() < 2) continue;  // nothing to compare with
    std::vector<double> means;
    for (const auto& r : ranks) means.push_back(r.second);
    std::sort(means.begin(), means.end());
    const size_t n = means.size();
    const double median = n % 2 ? means[n / 2] : 0.5 * (means[n / 2 - 1] + means[n / 2]);
    for (const auto& [rank, mean] : ranks) {
      if (mean <= (1.0 + threshold_) * median) continue;
      over.insert(rank);
      if (overBefore_.count(rank)) slow.push_back({hostOf_.at(rank), rank, stage, mean, median});
    }
  }
  samples_.clear();
  ranksWithFullWindow_ = 0;
  overBefore_ = std::move(over);
  return slow;
}

std::string formatSlowMachines(const std::vector<SlowMachine>& slow) {
  std::string out = "# host rank stage compute_ms_per_microbatch stage_median_ms ratio\n";
  for (const auto& s : slow) {
    char line[512];
    std::snprintf(line, sizeof(line), "%s %d %d %.3f %.3f %.2f\n", s.host.c_str(), s.rank, s.stage,
                  s.meanSeconds * 1e3, s.stageMedianSeconds * 1e3, s.ratio());
    out += line;
  }
  return out;
}

}  // namespace varuna
