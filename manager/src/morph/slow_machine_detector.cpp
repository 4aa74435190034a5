#include "varuna/manager/slow_machine_detector.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "varuna/common/stage_map.h"

namespace varuna {

void SlowMachineDetector::reset(const Plan& plan) {
  ranks_.clear();
  placedRanks_ = 0;
  ranksWithFullWindow_ = 0;
  const auto map = StageToRankMap::parse(plan.stageToRankMap);
  for (const auto& p : plan.placement) {
    if (p.rank < 0) continue;
    if (static_cast<size_t>(p.rank) >= ranks_.size()) ranks_.resize(static_cast<size_t>(p.rank) + 1);
    RankWindow& r = ranks_[static_cast<size_t>(p.rank)];
    if (!r.placed) ++placedRanks_;
    r.placed = true;
    r.host = p.host;
    r.stage = map.stageOf(p.rank);
  }
}

std::optional<std::vector<SlowMachine>> SlowMachineDetector::add(const proto::StepReport& report) {
  if (report.rank < 0 || static_cast<size_t>(report.rank) >= ranks_.size()) return std::nullopt;
  RankWindow& r = ranks_[static_cast<size_t>(report.rank)];
  // A relayed non-finite figure arrives as NaN: it would spoil the window's
  // mean and the median's sort. Only positive, finite times count.
  const double seconds = report.computeSecondsPerMicrobatch;
  if (!r.placed || !(seconds > 0) || !std::isfinite(seconds)) return std::nullopt;
  r.sum += seconds;
  if (++r.count == window_) ++ranksWithFullWindow_;
  if (ranksWithFullWindow_ < placedRanks_) return std::nullopt;
  return verdict();
}

std::vector<SlowMachine> SlowMachineDetector::verdict() {
  std::map<int, std::vector<std::pair<int, double>>> byStage;  // stage -> (rank, mean)
  for (size_t rank = 0; rank < ranks_.size(); ++rank) {
    const RankWindow& r = ranks_[rank];
    if (r.count > 0) byStage[r.stage].emplace_back(static_cast<int>(rank), r.sum / static_cast<double>(r.count));
  }
  std::vector<SlowMachine> slow;
  std::vector<bool> over(ranks_.size(), false);
  for (const auto& [stage, ranks] : byStage) {
    if (ranks.size() < 2) continue;  // nothing to compare with
    std::vector<double> means;
    for (const auto& r : ranks) means.push_back(r.second);
    std::sort(means.begin(), means.end());
    const size_t n = means.size();
    const double median = n % 2 ? means[n / 2] : 0.5 * (means[n / 2 - 1] + means[n / 2]);
    for (const auto& [rank, mean] : ranks) {
      if (mean <= (1.0 + threshold_) * median) continue;
      over[static_cast<size_t>(rank)] = true;
      const RankWindow& r = ranks_[static_cast<size_t>(rank)];
      if (r.overBefore) slow.push_back({r.host, rank, stage, mean, median});
    }
  }
  for (size_t rank = 0; rank < ranks_.size(); ++rank) {
    RankWindow& r = ranks_[rank];
    r.sum = 0;
    r.count = 0;
    r.overBefore = over[rank];
  }
  ranksWithFullWindow_ = 0;
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
