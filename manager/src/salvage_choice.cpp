#include "varuna/manager/salvage_choice.h"

#include <algorithm>
#include <tuple>

#include "varuna/common/errors.h"

namespace varuna {
namespace {

// Candidates per stage for one step.
using ByStage = std::map<int, std::vector<const SalvageReport*>>;

std::map<int64_t, ByStage> groupByStep(const std::vector<SalvageReport>& reports) {
  std::map<int64_t, ByStage> out;
  for (const auto& r : reports) {
    if (r.step >= 0) out[r.step][r.stage].push_back(&r);
  }
  return out;
}

// One writer per stage: hosts not leaving first, then hosts with the fewest
// writers so far (the writes run in parallel), then the lowest rank.
std::vector<int> pickWriters(const ByStage& candidates, int stages, const std::set<std::string>& leavingHosts) {
  std::map<std::string, int> load;
  std::vector<int> writers;
  for (int s = 0; s < stages; ++s) {
    auto pool = candidates.at(s);
    std::sort(pool.begin(), pool.end(), [&](const SalvageReport* a, const SalvageReport* b) {
      const auto key = [&](const SalvageReport* r) {
        return std::tuple(leavingHosts.count(r->host) > 0, load[r->host], r->rank);
      };
      return key(a) < key(b);
    });
    writers.push_back(pool.front()->rank);
    ++load[pool.front()->host];
  }
  return writers;
}

}  // namespace

std::optional<SalvageChoice> chooseSalvage(const std::vector<SalvageReport>& reports, int stages,
                                           const std::set<std::string>& leavingHosts) {
  const auto byStep = groupByStep(reports);
  for (auto it = byStep.rbegin(); it != byStep.rend(); ++it) {
    bool everyStage = true;
    for (int s = 0; s < stages && everyStage; ++s) everyStage = it->second.count(s) > 0;
    if (!everyStage) continue;
    return SalvageChoice{it->first, pickWriters(it->second, stages, leavingHosts)};
  }
  return std::nullopt;
}

std::string whyNoSalvage(const std::vector<SalvageReport>& reports, int stages) {
  std::map<int, std::set<int64_t>> heldByStage;
  for (const auto& r : reports) {
    if (r.step >= 0) heldByStage[r.stage].insert(r.step);
  }
  for (int s = 0; s < stages; ++s) {
    if (!heldByStage.count(s)) return strCat("no surviving replica of stage ", s, " holds a whole step");
  }
  std::string held;
  for (const auto& [stage, steps] : heldByStage) {
    held += strCat(held.empty() ? "" : ", ", "stage ", stage, " holds");
    for (int64_t step : steps) held += strCat(" ", step);
  }
  return strCat("no step is held by a survivor of every stage (", held, ")");
}

}  // namespace varuna
