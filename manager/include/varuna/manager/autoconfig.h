// AutoConfig: chooses the job's shape (stages P, replicas D, micro-batch size,
// schedule) for the machines at hand by simulating the plans on the model's
// profile (all but those a lower bound rules out) and taking the fastest. No
// I/O, and the result depends on the inputs only (apart from the measured
// planning time), so run_varuna can call it at launch and at every morph. It
// may take seconds on a big cluster: run_varuna runs it on a background thread
// (AsyncPlanner); autoConfigPlanner runs it on the caller's thread (tests,
// tools whose controller may wait).
//
// Enumerated (docs/profile.md, "AutoConfig"): every P from 1 to min(pieces,
// slots); every D with P*D <= slots that divides the global batch; every
// profiled micro-batch size m <= the per-replica batch; every schedule asked
// for. Placement is the planner's (clustered, host by host); the partition is
// partitionPieces() over the profiled per-piece costs at m, which the plan
// carries to the workers. A plan is feasible when every stage's predicted
// memory fits the device.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "varuna/common/machine_list.h"
#include "varuna/common/profile.h"
#include "varuna/common/schedule.h"
#include "varuna/common/simulator.h"
#include "varuna/manager/planner.h"

namespace varuna {

struct AutoConfigRequest {
  std::vector<Machine> machines;
  std::set<std::string> excludedHosts;
  int64_t globalBatch = 0;
  int64_t memoryPerDeviceBytes = 0;  // 0: unlimited
  std::vector<ScheduleChoice> schedules{ScheduleKind::kVaruna};
  std::vector<int64_t> microBatchSizes;  // empty: every size in the profile
  int fixedStages = 0;     // > 0: only this P (--nstages given)
  int64_t fixedChunk = 0;  // > 0: only this micro-batch size (--chunk_size given)
  int64_t bucketBytes = 4 << 20;  // the workers' VarunaOptions::bucketBytes
  bool simulateAll = false;  // true: no plan skipped (bench_autoconfig compares every prediction)
  int threads = 0;           // simulations at once; 0: one per core (at most 8)
};

struct Candidate {
  Plan plan;  // its `schedule` and `pieceCosts` are set: hand both to the workers
  ScheduleChoice schedule = ScheduleKind::kVaruna;
  Simulation simulation;  // empty when skipped
  double samplesPerSecond = 0;
  bool feasible = false;
  std::string infeasibleBecause;  // e.g. "stage 0 needs 13.1 GiB, devices have 12.0 GiB"
  // false: skipped, its lower bound already slower than the chosen plan (so
  // neither its step time nor its memory is known).
  bool simulated = true;
  double lowerBoundSeconds = 0;  // stepLowerBound of the plan

  // "2x4 m=4 varuna"
  std::string shortName() const;
};

struct AutoConfigResult {
  Candidate best;
  // Feasible first, fastest first; ties go to fewer workers, then fewer
  // stages, then the larger micro-batch, then the schedule listed first.
  // Skipped ones follow, by their lower bound; then the infeasible ones, the
  // smallest memory first, each with its reason.
  std::vector<Candidate> ranked;
  int slots = 0;  // usable worker slots
  int simulatedCount = 0;  // the others were skipped
  double planningSeconds = 0;  // wall time autoConfigure took

  // One paragraph: the choice, its predicted step, where the time goes, and
  // what it beat.
  std::string explain() const;
  // A ranked table of the alternatives (the first maxRows), for --dry_run.
  std::string table(int maxRows = 15) const;
};

// Throws ConfigError when no plan is feasible, saying why (no slots, P or the
// micro-batch pinned to something impossible, unprofiled sizes, memory), and
// ProfileError-class ConfigErrors for an empty profile.
AutoConfigResult autoConfigure(const profile::Profile& profile, const AutoConfigRequest& request);

// AutoConfig's request for a MorphController plan request: the request's
// machines, exclusions and global batch, `settings` for the rest; the
// request's stages / chunkSize pin P / the micro-batch when > 0.
AutoConfigRequest autoConfigRequestFor(const AutoConfigRequest& settings, const PlanRequest& request);

// A MorphController planner running AutoConfig over the request's machines,
// exclusions and global batch, with `settings` for the rest. The request's
// stages / chunkSize pin P / the micro-batch when > 0 (else AutoConfig
// chooses). `onChoice` (optional) sees every result, e.g. to log explain().
std::function<Plan(const PlanRequest&)> autoConfigPlanner(profile::Profile profile, AutoConfigRequest settings,
                                                          std::function<void(const AutoConfigResult&)> onChoice = {});

}  // namespace varuna
