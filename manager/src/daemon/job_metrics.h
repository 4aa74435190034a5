// JobMetrics: the job as Prometheus metrics. Its one job is turning what the
// daemon sees (a step every rank reported, a launch and its plan, a morph's
// start and end, a failure and its cause, the hosts' states, checkpoints
// complete or failed, AutoConfig's choice) into metric objects in its own
// registry; MetricsServer serves that registry at /metrics. The names and
// what each means are in docs/run_varuna.md ("Metrics").
//
// Threads: every method runs on the daemon's event-loop thread, at the points
// where the daemon logs the same event. The exposer's threads (civetweb's)
// only read, through registry()->Collect(): prometheus-cpp's counters, gauges
// and histograms are atomics (a histogram has its own lock) and a family locks
// itself while a series is added or removed, so a scrape never waits on the
// loop and the loop never waits on a scrape. The bookkeeping members below
// (steps_, morph_, ...) are the loop's alone.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include "varuna/common/protocol.h"
#include "daemon/host_absences.h"
#include "varuna/manager/morph_timer.h"
#include "varuna/manager/planner.h"

namespace varuna {

// The listed hosts by state, each host counted once (the first that applies):
// excluded (left out as slow, --exclude_slow), preempted, lost (its agent
// gone, failed to start or being started again), starting (its first
// start-up), slow (in the job, flagged in slow_machines.out), up.
struct HostCounts {
  int up = 0, starting = 0, lost = 0, preempted = 0, slow = 0, excluded = 0;
  bool operator==(const HostCounts&) const = default;
};

// `hosts` is state.json's "hosts" (AgentPool::describe), `absences` the
// pool's, `slowHosts` those flagged in slow_machines.out.
HostCounts countHosts(const nlohmann::json& hosts, const HostAbsences& absences,
                      const std::vector<std::string>& slowHosts);

class JobMetrics {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  // What started a morph (the label `cause` of varuna_morphs_total): a
  // bounded set, never a host name.
  enum class MorphCause { kPreemption, kMachinesChanged, kHostLost, kWorkerFailed, kWorkerHung, kNoProgress, kOther };
  // What failed (the label `cause` of varuna_failures_total).
  enum class Failure {
    kWorkerCrashed,      // a worker died of a signal or exited with an unexpected code
    kPeerLost,           // exit 3: it lost a peer
    kConfigError,        // exit 2: the job stops
    kCheckpointStorage,  // exit 74: storage failed or a checkpoint failed verification
    kSuperseded,         // exit 76: its generation was over
    kWorkerHung,         // no heartbeat for --heartbeat_timeout_s
    kNoProgress,         // no step for --hang_timeout_s
    kHostLost,           // an agent of a host in use was lost
    kLaunchFailed,       // the generation record could not be written, an agent went away
    kCheckpointTimeout,  // an on-demand checkpoint did not finish within --checkpoint_timeout_s
  };

  // Buckets of varuna_morph_recovery_seconds and varuna_checkpoint_duration_seconds.
  static const std::vector<double>& recoveryBuckets();
  static const std::vector<double>& checkpointBuckets();

  explicit JobMetrics(int64_t globalBatch);

  // What MetricsServer serves (and what the unit tests read).
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  std::vector<prometheus::MetricFamily> collect() const { return registry_->Collect(); }

  // A generation was launched on `plan`, resuming after `resumeStep` steps
  // (-1: a fresh start). The steps the last generation made past it are
  // rolled back: their samples are counted as recomputed. An on-demand
  // checkpoint not seen by now will not be (call checkpointSeen first).
  void launched(const Plan& plan, int generation, int64_t resumeStep, TimePoint now);
  // AutoConfig chose a plan after planning this long.
  void planChosen(double planningSeconds);
  // One rank's report: its stage's compute time per micro-batch.
  void stepReport(const proto::StepReport& report);
  // A step every rank reported: `step` steps are done; the slowest rank took `stepSeconds`.
  void stepCompleted(int64_t step, double loss, double stepSeconds, TimePoint now);
  // A morph (or a relaunch after a failure) began; events during one fold
  // into it, as in MorphTimer. `finished` ends it with its phases.
  void morphStarted(MorphCause cause);
  void morphFinished(const MorphPhases& phases);
  void failure(Failure cause);
  void hosts(const HostCounts& counts);
  // The workers were ordered to checkpoint now (a morph, the stop).
  void checkpointOrdered(TimePoint now);
  // The newest complete checkpoint as the daemon knows it, when this manager
  // first saw it (zero: before it started) and when it was completed, on the
  // steady clock (now minus checkpointAgeSeconds when the store was scanned):
  // its age comes from the checkpoint itself, so a restarted manager reports
  // the true one; without it, the age counts from seenAt (none if zero).
  // Called every tick, acts when it changes (or its completion becomes known).
  void checkpointSeen(std::optional<int64_t> latest, TimePoint seenAt,
                      std::optional<TimePoint> completedAt = std::nullopt);
  void checkpointFailed();
  // Every tick: what depends on the time (checkpoint age, goodput).
  void tick(TimePoint now);

  static const char* label(MorphCause cause);
  static const char* label(Failure cause);

 private:
  prometheus::Gauge& gauge(const std::string& name, const std::string& help);
  prometheus::Counter& counter(const std::string& name, const std::string& help);
  void forgetStagesFrom(int stages);

  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  int64_t globalBatch_;

  // Metric objects: owned by registry_'s families, live as long as it.
  prometheus::Gauge *step_, *loss_, *samplesPerSecond_, *stepSeconds_;
  prometheus::Counter *trainedSamples_, *recomputedSamples_;
  prometheus::Gauge *goodput_;
  prometheus::Gauge *generation_, *stages_, *replicas_, *microBatch_, *planGlobalBatch_, *planHosts_;
  prometheus::Counter* launches_;
  prometheus::Gauge* planningSeconds_;
  prometheus::Family<prometheus::Counter>* morphs_;
  std::map<MorphCause, prometheus::Counter*> morphsByCause_;
  prometheus::Gauge* morphInProgress_;
  prometheus::Gauge* lastRecovery_;
  std::map<std::string, prometheus::Gauge*> lastPhase_;
  prometheus::Histogram* recovery_;
  std::map<Failure, prometheus::Counter*> failures_;
  std::map<std::string, prometheus::Gauge*> hosts_;
  prometheus::Gauge *checkpointStep_, *checkpointAge_;
  prometheus::Counter *checkpoints_, *checkpointFailures_;
  prometheus::Family<prometheus::Histogram>* checkpointDurations_;
  prometheus::Histogram *periodicDuration_, *onDemandDuration_;
  prometheus::Family<prometheus::Gauge>* stageCompute_;

  struct StageCompute {
    prometheus::Gauge* gauge = nullptr;
    int64_t step = -1;  // the step of the reports summed
    double sum = 0;
    int count = 0;
  };
  std::map<int, StageCompute> stageComputeByStage_;

  // The loop's bookkeeping.
  int64_t lastStep_ = -1;              // steps done, as last reported by every rank
  std::map<int64_t, TimePoint> stepDoneAt_;  // since the newest checkpoint, for its duration
  std::optional<int64_t> checkpoint_;  // newest complete checkpoint seen
  std::optional<TimePoint> checkpointAt_;  // when it was completed (or first seen): its age
  std::optional<TimePoint> checkpointOrderedAt_;  // an on-demand checkpoint is being written
  int64_t stepAtOrder_ = -1;
  std::optional<MorphCause> morph_;
  TimePoint firstLaunch_{};
  double trained_ = 0, recomputed_ = 0;  // samples
};

}  // namespace varuna
