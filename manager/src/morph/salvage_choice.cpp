#include "varuna/manager/salvage_choice.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>

#include "varuna/common/errors.h"
#include "varuna/common/protocol.h"

namespace varuna {
namespace {

// The survivors that can write one step, per stage; `finisher`: it must
// apply the step first, from the relayed exchange result.
struct Candidate {
  const SalvageReport* report;
  bool finisher;
};
using ByStage = std::map<int, std::vector<Candidate>>;

// Bit for bit, non-finite values (an fp16 overflow travels as null and comes
// back as +infinity) alike.
bool sameExchange(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == b[i] || (!std::isfinite(a[i]) && !std::isfinite(b[i])))) return false;
  }
  return true;
}

struct StepCandidates {
  ByStage byStage;
  std::vector<double> exchange;  // from a survivor that finished the step's exchange
};

// Every exchange result some survivor finished, by step: of any stage (the
// exchange is job-wide), and also from ranks that hold no whole step. Every
// rank that finished an exchange holds its result bit for bit; a step whose
// reports disagree has no result (nobody finishes from a doubtful one).
std::map<int64_t, std::vector<double>> exchangesByStep(const std::vector<SalvageReport>& reports) {
  std::map<int64_t, std::vector<double>> out;
  std::set<int64_t> disputed;
  for (const auto& r : reports) {
    const int64_t step = r.exchangeStep >= 0 ? r.exchangeStep : r.step;
    if (step < 0 || r.exchange.size() != proto::kExchangeValues) continue;
    const auto [it, first] = out.emplace(step, r.exchange);
    if (!first && !sameExchange(it->second, r.exchange)) disputed.insert(step);
  }
  for (int64_t step : disputed) out.erase(step);
  return out;
}

std::map<int64_t, StepCandidates> groupByStep(const std::vector<SalvageReport>& reports) {
  const auto exchanges = exchangesByStep(reports);
  std::map<int64_t, StepCandidates> out;
  for (const auto& r : reports) {
    if (r.step >= 0) out[r.step].byStage[r.stage].push_back({&r, false});
  }
  for (const auto& r : reports) {
    // Finishing needs the result of that very exchange from someone who has it.
    const auto result = exchanges.find(r.finishableStep);
    if (r.finishableStep >= 0 && result != exchanges.end()) {
      out[r.finishableStep].byStage[r.stage].push_back({&r, true});
    }
  }
  for (auto& [step, candidates] : out) {
    if (const auto result = exchanges.find(step); result != exchanges.end()) candidates.exchange = result->second;
  }
  return out;
}

// One writer per stage: hosts not leaving first, then survivors that hold the
// step over those that must finish it, then hosts with the fewest writers so
// far (the writes run in parallel), then the lowest rank.
std::vector<Candidate> pickWriters(const ByStage& candidates, int stages, const std::set<std::string>& leavingHosts) {
  std::map<std::string, int> load;
  std::vector<Candidate> writers;
  for (int s = 0; s < stages; ++s) {
    auto pool = candidates.at(s);
    std::sort(pool.begin(), pool.end(), [&](const Candidate& a, const Candidate& b) {
      const auto key = [&](const Candidate& c) {
        return std::tuple(leavingHosts.count(c.report->host) > 0, c.finisher, load[c.report->host], c.report->rank);
      };
      return key(a) < key(b);
    });
    writers.push_back(pool.front());
    ++load[pool.front().report->host];
  }
  return writers;
}

}  // namespace

std::optional<SalvageChoice> chooseSalvage(const std::vector<SalvageReport>& reports, int stages,
                                           const std::set<std::string>& leavingHosts) {
  const auto byStep = groupByStep(reports);
  for (auto it = byStep.rbegin(); it != byStep.rend(); ++it) {
    const auto& byStage = it->second.byStage;
    bool everyStage = true;
    for (int s = 0; s < stages && everyStage; ++s) everyStage = byStage.count(s) > 0;
    if (!everyStage) continue;
    SalvageChoice choice{it->first, {}, {}, {}};
    for (const auto& writer : pickWriters(byStage, stages, leavingHosts)) {
      choice.writers.push_back(writer.report->rank);
      if (writer.finisher) choice.finishing.push_back(writer.report->rank);
    }
    if (!choice.finishing.empty()) choice.exchange = it->second.exchange;
    return choice;
  }
  return std::nullopt;
}

std::string whyNoSalvage(const std::vector<SalvageReport>& reports, int stages) {
  std::map<int, std::set<int64_t>> heldByStage, finishableByStage;
  for (const auto& r : reports) {
    if (r.step >= 0) heldByStage[r.stage].insert(r.step);
    if (r.step >= 0 && r.finishableStep >= 0) finishableByStage[r.stage].insert(r.finishableStep);
  }
  for (int s = 0; s < stages; ++s) {
    if (!heldByStage.count(s)) return strCat("no surviving replica of stage ", s, " holds a whole step");
  }
  std::string held;
  for (const auto& [stage, steps] : heldByStage) {
    held += strCat(held.empty() ? "" : ", ", "stage ", stage, " holds");
    for (int64_t step : steps) held += strCat(" ", step);
    if (finishableByStage.count(stage)) {
      held += " and could finish";
      for (int64_t step : finishableByStage[stage]) held += strCat(" ", step);
      held += " given its exchange result, which no survivor holds";
    }
  }
  return strCat("no step is held by a survivor of every stage (", held, ")");
}

}  // namespace varuna
