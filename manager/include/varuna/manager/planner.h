// Planner: turns the machines at hand into a job layout. Pure function.
//
// The number of stages P and the micro-batch size are given (by the user, or
// by AutoConfig, which calls this for every candidate); the planner uses as
// many data-parallel replicas D as the slots allow (or the D asked for) while
// keeping the global batch constant across morphs (D must divide it). Ranks
// are assigned host by host, slot by slot, in "clustered" order (replica r =
// ranks r*P .. r*P+P-1), so neighbouring stages of a replica share a machine
// whenever slots allow.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "varuna/common/machine_list.h"
#include "varuna/common/schedule.h"

namespace varuna {

struct PlanRequest {
  std::vector<Machine> machines;
  int stages = 1;
  int64_t globalBatch = 0;
  int64_t chunkSize = 0;
  std::set<std::string> excludedHosts;  // preempted or flagged slow
  int replicas = 0;  // 0: as many as fit and divide the global batch; else exactly this many
  bool operator==(const PlanRequest&) const = default;
};

struct RankPlacement {
  int rank = 0;
  std::string host;
  int localRank = 0;
  bool operator==(const RankPlacement&) const = default;
};

struct Plan {
  int stages = 1;
  int replicas = 1;
  int64_t globalBatch = 0;
  int64_t perReplicaBatch = 0;
  int64_t chunkSize = 0;
  std::string stageToRankMap;
  std::vector<RankPlacement> placement;  // by rank
  std::vector<std::string> hosts;        // hosts with at least one worker, in order
  int unusedSlots = 0;
  // Set by AutoConfig: the schedule it simulated, and the per-piece costs the
  // workers must balance stages by (ModelSpec::pieceCosts) so that their
  // partition is the simulated one. Empty costs: the runtime's default
  // (parameter counts, or the model's own costs).
  ScheduleChoice schedule = ScheduleKind::kVaruna;  // and its chunks
  std::vector<double> pieceCosts;

  int worldSize() const { return stages * replicas; }
  std::vector<RankPlacement> ranksOn(const std::string& host) const;
  // "2 stages x 2 replicas, micro-batch 4, per-replica batch 8 (global 16); hosts: a [0,1] b [2,3]"
  std::string describe() const;
};

// Throws ConfigError when the machines cannot hold one pipeline (or the
// replicas asked for), or the global batch does not split into them.
Plan makePlan(const PlanRequest& request);

}  // namespace varuna
