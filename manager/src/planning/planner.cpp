#include "varuna/manager/planner.h"

#include <sstream>

#include "varuna/common/errors.h"
#include "varuna/common/stage_map.h"

namespace varuna {

std::vector<RankPlacement> Plan::ranksOn(const std::string& host) const {
  std::vector<RankPlacement> out;
  for (const auto& p : placement) {
    if (p.host == host) out.push_back(p);
  }
  return out;
}

std::string Plan::describe() const {
  std::ostringstream out;
  out << stages << " stages x " << replicas << " replicas, micro-batch " << chunkSize << ", per-replica batch "
      << perReplicaBatch << " (global " << globalBatch << "), stage_to_rank_map " << stageToRankMap << "; hosts:";
  for (const auto& host : hosts) {
    out << " " << host << " [";
    bool first = true;
    for (const auto& p : ranksOn(host)) {
      out << (first ? "" : ",") << p.rank;
      first = false;
    }
    out << "]";
  }
  if (unusedSlots > 0) out << "; " << unusedSlots << " slot(s) idle";
  if (!pieceCosts.empty()) out << "; schedule " << toString(schedule) << ", stages balanced by profiled costs";
  return out.str();
}

Plan makePlan(const PlanRequest& request) {
  if (request.stages < 1) throw ConfigError(strCat("--nstages must be >= 1, got ", request.stages));
  if (request.globalBatch < 1) throw ConfigError(strCat("--batch_size must be >= 1, got ", request.globalBatch));
  if (request.chunkSize < 1) throw ConfigError(strCat("--chunk_size must be >= 1, got ", request.chunkSize));
  int slots = 0;
  for (const auto& m : request.machines) {
    if (!request.excludedHosts.count(m.host)) slots += m.slots;
  }
  const int P = request.stages;
  if (slots < P) {
    throw ConfigError(strCat("the machines cannot hold one pipeline: ", P, " stages need ", P, " worker slots, ",
                             slots, " are available (", request.machines.size(), " machines, ",
                             request.excludedHosts.size(), " excluded); add machines or use fewer stages"));
  }
  int D = request.replicas;
  if (D < 0) throw ConfigError(strCat("number of replicas must be >= 0 (0: as many as fit), got ", D));
  if (D == 0) {
    // The most replicas that fit and split the global batch evenly.
    D = slots / P;
    while (D > 1 && request.globalBatch % D != 0) --D;
  } else if (P * D > slots) {
    throw ConfigError(strCat(P, " stages x ", D, " replicas need ", P * D, " worker slots, ", slots,
                             " are available"));
  } else if (request.globalBatch % D != 0) {
    throw ConfigError(strCat("the global batch ", request.globalBatch, " does not split evenly into ", D,
                             " replicas"));
  }
  Plan plan;
  plan.stages = P;
  plan.replicas = D;
  plan.globalBatch = request.globalBatch;
  plan.perReplicaBatch = request.globalBatch / D;
  plan.chunkSize = std::min(request.chunkSize, plan.perReplicaBatch);
  plan.stageToRankMap = StageToRankMap::clustered(P, D).toString();
  int rank = 0;
  for (const auto& m : request.machines) {
    if (request.excludedHosts.count(m.host)) continue;
    int local = 0;
    for (; local < m.slots && rank < plan.worldSize(); ++local) plan.placement.push_back({rank++, m.host, local});
    if (local > 0) plan.hosts.push_back(m.host);
  }
  plan.unusedSlots = slots - plan.worldSize();
  return plan;
}

}  // namespace varuna
