// Simulator: predicts the step time, bubble and per-stage memory of a plan
// (P stages x D replicas, micro-batch size, schedule, placement) from a
// profile, by replaying the exact task order the runtime executes
// (generateSchedule + replaySchedule) with profiled costs.
//
// What one step of the runtime does, and how each part is modelled
// (docs/profile.md, "The simulator's model"):
//  - every stage runs its task list; a task's duration is the sum of the
//    profiled medians of the stage's pieces (forward, recompute or backward)
//    at the micro-batch's size (the last micro-batch may be smaller);
//  - an activation / gradient crosses a cut in p2pSeconds(bytes crossing the
//    cut, whether the two ranks share a host); sends never block and links
//    have no contention;
//  - during a stage's last backward, pieces finish last-to-first and their
//    gradients fill buckets of `bucketBytes` (the runtime's GradBuckets); a
//    bucket's all-reduce over the D replicas starts once all its pieces are
//    final on every replica and the previous bucket's all-reduce is done;
//  - then the job-wide all-reduce of 3 doubles (a barrier), then the
//    optimizer step (optimizerSecondsPerParam x the stage's parameters).
// Pure function, no I/O; cheap enough for AutoConfig to run thousands.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "varuna/common/partition.h"
#include "varuna/common/profile.h"
#include "varuna/common/schedule.h"

namespace varuna {

struct SimulationInput {
  int stages = 1;    // P
  int replicas = 1;  // D
  int64_t microBatch = 1;   // chunk_size
  int64_t globalBatch = 1;  // per-replica batch = globalBatch / D
  ScheduleKind schedule = ScheduleKind::kVaruna;
  // Chunks per stage (interleaved, zbv); 0: the kind's default.
  int chunks = 0;
  // Partition into stages x chunks virtual stages (size P*chunks+1, see
  // Partition::firstPiece; ChunkLayout places them). Empty: balance by
  // pieceCosts(profile, microBatch, schedule), as the runtime does when the
  // plan passes those costs to the workers.
  std::vector<int> firstPiece;
  // Size P*D, rank = replica*P + stage. Empty: every rank on one host.
  std::vector<std::string> hostOfRank;
  int64_t bucketBytes = 4 << 20;  // VarunaOptions::bucketBytes
};

struct Simulation {
  double stepSeconds = 0;        // = pipelineSeconds + allreduceSeconds + optimizerSeconds
  double pipelineSeconds = 0;    // makespan of the replayed schedule (the slowest replica)
  double allreduceSeconds = 0;   // exposed, not overlapped: gradient buckets still running + the job-wide one
  double optimizerSeconds = 0;   // the slowest stage's optimizer step
  double bubbleFraction = 0;     // 1 - sum(stage busy) / (P * pipelineSeconds)
  int microbatches = 0;          // per replica: ceil(per-replica batch / micro-batch)
  Partition partition;  // into virtual stages
  ChunkLayout layout;   // which stage holds which of them
  std::vector<double> stageComputeSeconds;  // busy time per stage (forwards + recomputes + backwards)
  // Parameters + gradients + optimizer state + the peak, over the schedule, of
  // live activations and the boundary tensors the runtime holds (see .cpp).
  std::vector<int64_t> stageMemoryBytes;
  std::vector<int> stagePeakLiveMicrobatches;  // most micro-batches whose activations a stage holds at once
  std::vector<double> stageExposedAllreduceSeconds;  // per stage: data-parallel all-reduce after its last task

  int64_t maxStageMemoryBytes() const;
  // "step 1.234 s = pipeline 1.100 + all-reduce 0.100 + optimizer 0.034; bubble 12.0%; 8 micro-batches; ..."
  std::string describe() const;
};

// Per-piece costs at `microBatch` for balancing stages: profiled median
// forward + backward (+ recompute for the Varuna schedule). The plan carries
// them to the workers (ModelSpec::pieceCosts), so the runtime's partition is
// the simulated one. Throws ConfigError when the size was not profiled.
std::vector<double> pieceCosts(const profile::Profile& profile, int64_t microBatch, ScheduleKind schedule);

// Throws ConfigError naming the problem: the profile lacks the micro-batch
// size or has no pieces, P > pieces, D does not divide the global batch, the
// micro-batch exceeds the per-replica batch, a bad partition or placement,
// stages x chunks > pieces, or a micro-batch count the schedule cannot take.
// `schedule`, when given, must be generateSchedule(input.schedule, P,
// microbatches, chunks) (AutoConfig caches them).
Simulation simulate(const profile::Profile& profile, const SimulationInput& input,
                    const Schedule* schedule = nullptr);

// A cheap lower bound of simulate(profile, input).stepSeconds (no schedule is
// generated or replayed): the busiest stage's forwards and backwards back to
// back, plus the step's closing exchange and the optimizer. AutoConfig skips
// the plans whose bound is already slower than a plan it has simulated.
// Throws as simulate() does.
double stepLowerBound(const profile::Profile& profile, const SimulationInput& input);

// "1.5 GiB", "320 MiB", "12 KiB", "80 B".
std::string formatBytes(int64_t bytes);

}  // namespace varuna
