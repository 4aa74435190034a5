#include "daemon/job_metrics.h"

#include <algorithm>
#include <filesystem>
#include <limits>

#include <nlohmann/json.hpp>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/time_util.h"

namespace varuna {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// Steps whose completion time is kept for the duration of their checkpoint
// (those past the newest checkpoint; a job that never checkpoints keeps the last ones).
constexpr size_t kMaxStepTimes = 10000;

const JobMetrics::MorphCause kMorphCauses[] = {
    JobMetrics::MorphCause::kPreemption,   JobMetrics::MorphCause::kMachinesChanged,
    JobMetrics::MorphCause::kHostLost,     JobMetrics::MorphCause::kWorkerFailed,
    JobMetrics::MorphCause::kWorkerHung,   JobMetrics::MorphCause::kNoProgress,
    JobMetrics::MorphCause::kOther};
const JobMetrics::Failure kFailures[] = {
    JobMetrics::Failure::kWorkerCrashed,     JobMetrics::Failure::kPeerLost,
    JobMetrics::Failure::kConfigError,       JobMetrics::Failure::kCheckpointStorage,
    JobMetrics::Failure::kSuperseded,        JobMetrics::Failure::kWorkerHung,
    JobMetrics::Failure::kNoProgress,        JobMetrics::Failure::kHostLost,
    JobMetrics::Failure::kLaunchFailed,      JobMetrics::Failure::kCheckpointTimeout};
const char* const kHostStates[] = {"up", "starting", "lost", "preempted", "slow", "excluded"};
const char* const kMorphPhases[] = {"checkpoint_and_teardown", "launch_and_connect", "rendezvous_load_first_step"};

}  // namespace

HostCounts countHosts(const nlohmann::json& hosts, const HostAbsences& absences,
                      const std::vector<std::string>& slowHosts) {
  HostCounts counts;
  for (const auto& [host, info] : hosts.items()) {
    if (const HostAbsence* absence = absences.find(host)) {
      if (absence->slow) {
        ++counts.excluded;
      } else if (absence->preemptedUntil || absence->why == "preempted") {
        ++counts.preempted;
      } else {
        ++counts.lost;
      }
      continue;
    }
    const std::string agent = info.is_object() ? info.value("agent", std::string()) : std::string();
    if (agent == "up") {
      if (std::find(slowHosts.begin(), slowHosts.end(), host) != slowHosts.end()) {
        ++counts.slow;
      } else {
        ++counts.up;
      }
    } else if (agent == "starting") {
      ++counts.starting;
    } else {
      ++counts.lost;  // failed or gone without a record of why: out, as a lost host is
    }
  }
  return counts;
}

const std::vector<double>& JobMetrics::recoveryBuckets() {
  static const std::vector<double> buckets = {1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800};
  return buckets;
}

const std::vector<double>& JobMetrics::checkpointBuckets() {
  static const std::vector<double> buckets = {0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600};
  return buckets;
}

const char* JobMetrics::label(MorphCause cause) {
  switch (cause) {
    case MorphCause::kPreemption: return "preemption";
    case MorphCause::kMachinesChanged: return "machines_changed";
    case MorphCause::kHostLost: return "host_lost";
    case MorphCause::kWorkerFailed: return "worker_failed";
    case MorphCause::kWorkerHung: return "worker_hung";
    case MorphCause::kNoProgress: return "no_progress";
    case MorphCause::kOther: return "other";
  }
  return "other";
}

const char* JobMetrics::label(Failure cause) {
  switch (cause) {
    case Failure::kWorkerCrashed: return "worker_crashed";
    case Failure::kPeerLost: return "peer_lost";
    case Failure::kConfigError: return "config_error";
    case Failure::kCheckpointStorage: return "checkpoint_storage";
    case Failure::kSuperseded: return "superseded";
    case Failure::kWorkerHung: return "worker_hung";
    case Failure::kNoProgress: return "no_progress";
    case Failure::kHostLost: return "host_lost";
    case Failure::kLaunchFailed: return "launch_failed";
    case Failure::kCheckpointTimeout: return "checkpoint_timeout";
  }
  return "worker_crashed";
}

prometheus::Gauge& JobMetrics::gauge(const std::string& name, const std::string& help) {
  return BuildGauge().Name(name).Help(help).Register(*registry_).Add({});
}

prometheus::Counter& JobMetrics::counter(const std::string& name, const std::string& help) {
  return BuildCounter().Name(name).Help(help).Register(*registry_).Add({});
}

JobMetrics::JobMetrics(int64_t globalBatch) : globalBatch_(globalBatch) {
  // Progress.
  step_ = &gauge("varuna_step", "Steps done, as last reported by every rank of the running generation.");
  step_->Set(-1);
  loss_ = &gauge("varuna_loss", "Loss of the last step every rank reported.");
  loss_->Set(kNaN);
  samplesPerSecond_ =
      &gauge("varuna_samples_per_second", "Global batch over the last step's time (its slowest rank's).");
  stepSeconds_ = &gauge("varuna_step_seconds", "Time of the last step on its slowest rank.");
  trainedSamples_ = &counter("varuna_trained_samples_total", "Samples of every step trained, kept or not.");
  recomputedSamples_ = &counter("varuna_recomputed_samples_total",
                                "Samples of steps rolled back by a relaunch from an older checkpoint: trained again.");
  goodput_ = &gauge("varuna_goodput_samples_per_second",
                    "Samples of kept steps (trained minus recomputed) per second since the first launch.");
  // Plan.
  generation_ = &gauge("varuna_generation", "The running (last launched) generation.");
  stages_ = &gauge("varuna_plan_stages", "Pipeline stages P of the current plan.");
  replicas_ = &gauge("varuna_plan_replicas", "Data-parallel replicas D of the current plan.");
  microBatch_ = &gauge("varuna_plan_micro_batch_size", "Micro-batch size (chunk_size) of the current plan.");
  planGlobalBatch_ = &gauge("varuna_plan_global_batch_size", "Global batch of the current plan.");
  planHosts_ = &gauge("varuna_plan_hosts", "Hosts the current plan uses.");
  launches_ = &counter("varuna_launches_total", "Generations launched.");
  planningSeconds_ = &gauge("varuna_autoconfig_planning_seconds", "How long AutoConfig took to choose the last plan.");
  planningSeconds_->Set(kNaN);  // no AutoConfig (no --profile), or not yet
  // Morphs and failures.
  morphs_ = &BuildCounter()
                 .Name("varuna_morphs_total")
                 .Help("Morphs and relaunches completed (their first step done), by what started them.")
                 .Register(*registry_);
  for (const auto cause : kMorphCauses) morphsByCause_[cause] = &morphs_->Add({{"cause", label(cause)}});
  morphInProgress_ = &gauge("varuna_morph_in_progress", "1 from a morph's cause to its first step, else 0.");
  lastRecovery_ = &gauge("varuna_last_morph_recovery_seconds",
                         "The last morph's recovery: its cause to the first step of the generation it launched.");
  lastRecovery_->Set(kNaN);
  auto& phases = BuildGauge()
                     .Name("varuna_last_morph_phase_seconds")
                     .Help("The last morph's phases (docs/run_varuna.md: morph_complete).")
                     .Register(*registry_);
  for (const char* phase : kMorphPhases) {
    lastPhase_[phase] = &phases.Add({{"phase", phase}});
    lastPhase_[phase]->Set(kNaN);
  }
  recovery_ = &BuildHistogram()
                   .Name("varuna_morph_recovery_seconds")
                   .Help("Recovery time of every morph: its cause to the first step after it.")
                   .Register(*registry_)
                   .Add({}, recoveryBuckets());
  auto& failures = BuildCounter()
                       .Name("varuna_failures_total")
                       .Help("Failures the manager handled, by cause.")
                       .Register(*registry_);
  for (const auto cause : kFailures) failures_[cause] = &failures.Add({{"cause", label(cause)}});
  // Hosts.
  auto& hosts = BuildGauge().Name("varuna_hosts").Help("Listed hosts by state.").Register(*registry_);
  for (const char* state : kHostStates) hosts_[state] = &hosts.Add({{"state", state}});
  // Checkpoints.
  checkpointStep_ = &gauge("varuna_last_checkpoint_step", "Step of the newest complete checkpoint (-1: none).");
  checkpointStep_->Set(-1);
  checkpointAge_ = &gauge("varuna_last_checkpoint_age_seconds",
                          "Since the newest complete checkpoint was completed (its COMPLETE marker's time in the "
                          "store; NaN: none).");
  checkpointAge_->Set(kNaN);
  checkpoints_ = &counter("varuna_checkpoints_total", "Complete checkpoints seen in the store.");
  checkpointFailures_ = &counter("varuna_checkpoint_failures_total", "Checkpoints the workers reported failed.");
  checkpointDurations_ = &BuildHistogram()
                              .Name("varuna_checkpoint_duration_seconds")
                              .Help("A checkpoint's step done (periodic) or its order (on_demand) to the "
                                    "checkpoint seen complete in the store (checked every second).")
                              .Register(*registry_);
  periodicDuration_ = &checkpointDurations_->Add({{"kind", "periodic"}}, checkpointBuckets());
  onDemandDuration_ = &checkpointDurations_->Add({{"kind", "on_demand"}}, checkpointBuckets());
  // Stages.
  stageCompute_ = &BuildGauge()
                       .Name("varuna_stage_compute_seconds_per_microbatch")
                       .Help("Mean compute time per micro-batch of a stage's replicas in the last step.")
                       .Register(*registry_);
}

void JobMetrics::launched(const Plan& plan, int generation, int64_t resumeStep, TimePoint now) {
  if (firstLaunch_ == TimePoint{}) firstLaunch_ = now;
  launches_->Increment();
  checkpointOrderedAt_.reset();
  const int64_t resume = std::max<int64_t>(resumeStep, 0);
  if (lastStep_ > resume) {
    const double lost = static_cast<double>((lastStep_ - resume) * globalBatch_);
    recomputedSamples_->Increment(lost);
    recomputed_ += lost;
  }
  if (lastStep_ >= 0 || resume > 0) {
    lastStep_ = resume;
    step_->Set(static_cast<double>(resume));
  }
  generation_->Set(generation);
  stages_->Set(plan.stages);
  replicas_->Set(plan.replicas);
  microBatch_->Set(static_cast<double>(plan.chunkSize));
  planGlobalBatch_->Set(static_cast<double>(plan.globalBatch));
  planHosts_->Set(static_cast<double>(plan.hosts.size()));
  forgetStagesFrom(plan.stages);
  for (auto& [stage, compute] : stageComputeByStage_) compute = StageCompute{compute.gauge};
}

void JobMetrics::forgetStagesFrom(int stages) {
  for (auto it = stageComputeByStage_.lower_bound(stages); it != stageComputeByStage_.end();) {
    stageCompute_->Remove(it->second.gauge);
    it = stageComputeByStage_.erase(it);
  }
}

void JobMetrics::planChosen(double planningSeconds) { planningSeconds_->Set(planningSeconds); }

void JobMetrics::stepReport(const proto::StepReport& report) {
  auto it = stageComputeByStage_.find(report.stage);
  if (it == stageComputeByStage_.end()) {
    auto& gauge = stageCompute_->Add({{"stage", std::to_string(report.stage)}});
    it = stageComputeByStage_.emplace(report.stage, StageCompute{&gauge}).first;
  }
  StageCompute& compute = it->second;
  if (report.step < compute.step) return;  // a late report of an earlier step
  if (report.step > compute.step) compute = StageCompute{compute.gauge, report.step};
  compute.sum += report.computeSecondsPerMicrobatch;
  ++compute.count;
  compute.gauge->Set(compute.sum / compute.count);
}

void JobMetrics::stepCompleted(int64_t step, double loss, double stepSeconds, TimePoint now) {
  step_->Set(static_cast<double>(step));
  loss_->Set(loss);
  stepSeconds_->Set(stepSeconds);
  samplesPerSecond_->Set(stepSeconds > 0 ? static_cast<double>(globalBatch_) / stepSeconds : 0);
  // Each report is one step: the first of a generation follows its resume step.
  trainedSamples_->Increment(static_cast<double>(globalBatch_));
  trained_ += static_cast<double>(globalBatch_);
  lastStep_ = step;
  stepDoneAt_[step] = now;
  while (stepDoneAt_.size() > kMaxStepTimes) stepDoneAt_.erase(stepDoneAt_.begin());
}

void JobMetrics::morphStarted(MorphCause cause) {
  if (morph_) return;  // folds into the morph under way
  morph_ = cause;
  morphInProgress_->Set(1);
}

void JobMetrics::morphFinished(const MorphPhases& phases) {
  morphsByCause_.at(morph_.value_or(MorphCause::kOther))->Increment();
  morph_.reset();
  morphInProgress_->Set(0);
  lastRecovery_->Set(phases.totalS);
  recovery_->Observe(phases.totalS);
  lastPhase_.at("checkpoint_and_teardown")->Set(phases.checkpointAndTeardownS);
  lastPhase_.at("launch_and_connect")->Set(phases.launchAndConnectS);
  lastPhase_.at("rendezvous_load_first_step")->Set(phases.rendezvousLoadFirstStepS);
}

void JobMetrics::failure(Failure cause) { failures_.at(cause)->Increment(); }

void JobMetrics::hosts(const HostCounts& counts) {
  hosts_.at("up")->Set(counts.up);
  hosts_.at("starting")->Set(counts.starting);
  hosts_.at("lost")->Set(counts.lost);
  hosts_.at("preempted")->Set(counts.preempted);
  hosts_.at("slow")->Set(counts.slow);
  hosts_.at("excluded")->Set(counts.excluded);
}

void JobMetrics::checkpointOrdered(TimePoint now) {
  if (checkpointOrderedAt_) return;  // the workers are writing the one ordered first
  checkpointOrderedAt_ = now;
  stepAtOrder_ = lastStep_;
}

void JobMetrics::checkpointSeen(std::optional<int64_t> latest, TimePoint seenAt, std::optional<TimePoint> completedAt) {
  if (!latest) return;
  if (latest == checkpoint_) {
    if (completedAt) checkpointAt_ = completedAt;  // its completion known later than itself
    return;
  }
  const int64_t step = *latest;
  const bool before = checkpoint_ && step < *checkpoint_;  // a damaged newer one fell back to it
  checkpoint_ = step;
  checkpointAt_ = completedAt;
  if (!checkpointAt_ && seenAt != TimePoint{}) checkpointAt_ = seenAt;
  checkpointStep_->Set(static_cast<double>(step));
  // One that was there before the first launch was not written by this job's
  // run under this manager: nothing to count or time.
  if (firstLaunch_ == TimePoint{} || before) return;
  checkpoints_->Increment();
  // The workers write the step they finish after the order (a program may
  // write the one it had finished): not older than the last step reported then.
  if (checkpointOrderedAt_ && step >= stepAtOrder_) {
    onDemandDuration_->Observe(std::max(0.0, secondsBetween(*checkpointOrderedAt_, seenAt)));
    checkpointOrderedAt_.reset();
  } else if (const auto it = stepDoneAt_.find(step); it != stepDoneAt_.end()) {
    periodicDuration_->Observe(std::max(0.0, secondsBetween(it->second, seenAt)));
  }
  stepDoneAt_.erase(stepDoneAt_.begin(), stepDoneAt_.upper_bound(step));
}

void JobMetrics::checkpointFailed() { checkpointFailures_->Increment(); }

void JobMetrics::tick(TimePoint now) {
  checkpointAge_->Set(checkpoint_ && checkpointAt_ ? std::max(0.0, secondsBetween(*checkpointAt_, now)) : kNaN);
  if (firstLaunch_ != TimePoint{} && now > firstLaunch_) {
    goodput_->Set((trained_ - recomputed_) / secondsBetween(firstLaunch_, now));
  }
}

}  // namespace varuna
