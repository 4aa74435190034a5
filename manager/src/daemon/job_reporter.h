// JobReporter: run_varuna's reporting role, what the people watching a job
// see of it. Step reports become the progress line, steps.jsonl, the step
// metrics and the end of a morph (its first step); slow-machine verdicts
// become slow_machines.out, a log line and an event; checkpoint failures a
// log line, an event and state.json's record; the hosts' states become
// metrics; and the job as a whole becomes state.json (once a second and on
// every change; a failing disk is retried at every tick) and the final
// summary. It decides nothing: a slow host leaves the job (--exclude_slow)
// through the hook the daemon hands it.
//
// It sees the rest of the daemon only through a narrow, read-only view: the
// CheckpointWatcher (the newest checkpoint), a DaemonStatus the daemon builds
// when asked (its phase, the plan, the hosts, its connections), and the plan
// and generation handed in with each report. It writes to the EventLog,
// JobMetrics and MorphTracker it is given, which the daemon shares.
//
// Owned by ManagerDaemon::Impl, which makes it in start() once the parts it
// reads exist. Single-threaded: every call on the daemon's event-loop thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "varuna/common/protocol.h"
#include "varuna/manager/clock.h"
#include "varuna/manager/planner.h"
#include "varuna/manager/slow_machine_detector.h"
#include "daemon/checkpoint_watcher.h"
#include "daemon/host_absences.h"
#include "daemon/job_metrics.h"
#include "daemon/morph_tracker.h"
#include "daemon/state_file.h"
#include "daemon/step_log.h"
#include "daemon/step_progress.h"
#include "loop/event_log.h"

namespace varuna {

class JobReporter {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  // What stays the same for the manager's lifetime.
  struct Options {
    std::string job;
    std::string stateDir;             // state.json and slow_machines.out go here
    std::string globalStore;          // named in state.json
    std::string address;              // host:port the agents and workers dial
    nlohmann::json metricsAddress;    // --metrics_port's host:port; null without
    int64_t globalBatch = 0;          // samples per step, for the throughput
    double slowThreshold = 0;         // SlowMachineDetector's
    int slowWindow = 0;
    bool excludeSlow = false;         // a slow host leaves at the next morph
    TimePoint startedAt{};            // state.json's uptime, the summary's
  };

  // The daemon as state.json shows it, built by the daemon when asked. The
  // pointers are valid for the call they are handed to only.
  struct DaemonStatus {
    std::string phase;                        // "finished", "failed" or the controller's phase
    int generation = 0;
    const Plan* plan = nullptr;               // null while the controller is idle (no plan yet)
    nlohmann::json hosts;                     // AgentPool::describe
    const HostAbsences* absences = nullptr;   // never null
    nlohmann::json connections;               // the listener's counts and the handler failures
    std::string stopReason;
  };

  // The parts it reports into or reads; each outlives it.
  struct Parts {
    EventLog& events;
    JobMetrics& metrics;
    MorphTracker& morph;
    const CheckpointWatcher& checkpoints;
    Clock& clock;
  };

  struct Hooks {
    std::function<DaemonStatus()> status;
    // With Options::excludeSlow, for each host of a new verdict, as it is reported.
    std::function<void(const std::string& host)> excludeSlowHost;
  };

  // `stepLog`: steps.jsonl, opened by the daemon in start()'s order of files.
  JobReporter(Options options, Parts parts, Hooks hooks, std::unique_ptr<StepLog> stepLog);
  JobReporter(const JobReporter&) = delete;
  JobReporter& operator=(const JobReporter&) = delete;

  // A worker's step report; `plan` and `generation` are the running ones.
  void onStepReport(const proto::StepReport& report, const Plan& plan, int generation);
  // A worker's failed checkpoint: training goes on; recorded and counted.
  void onCheckpointFailed(int rank, const proto::CheckpointFailed& failure, const Plan& plan);
  // A generation was launched on `plan`: the last one's final step is
  // written, progress and slowness start over.
  void onLaunch(const Plan& plan);
  // The job stops: the last generation's final step is written.
  void flushSteps() { stepLog_->flush(); }
  // The checkpoint watcher's newest checkpoint, into the metrics.
  void checkpointSeen();
  // The hosts' states changed: their counts into the metrics.
  void hostsChanged(const nlohmann::json& hosts, const HostAbsences& absences);
  // A host flagged slow is back through the machine list: flagged again
  // later, it is reported (and excluded) again.
  void slowHostReadmitted(const std::string& host);

  // The tick: the checkpoint and the metrics' own tick, state.json when due.
  void tick(TimePoint now);
  // state.json now; on failure logged (rate-limited) and retried at every tick.
  void writeState();
  bool stateWriteFailing() const { return stateFile_.failing(); }
  bool stateWriting() const { return stateFile_.writing(); }
  // The last line run_varuna logs.
  void printSummary();

 private:
  void onSlowVerdict(const std::vector<SlowMachine>& slow);
  std::string checkpointText(TimePoint now) const;
  StateFile::Snapshot stateSnapshot();
  // 1000 ranks make a large object: built once per generation.
  std::shared_ptr<const nlohmann::json> cachedPlanJson(const DaemonStatus& status);

  Options options_;
  EventLog& events_;
  JobMetrics& metrics_;
  MorphTracker& morph_;
  const CheckpointWatcher& checkpoints_;
  Clock& clock_;
  Hooks hooks_;
  std::unique_ptr<StepLog> stepLog_;
  StepProgress progress_;
  SlowMachineDetector slowDetector_;
  StateFile stateFile_;
  std::vector<std::string> slowHosts_;    // the last verdict acted on
  int checkpointFailures_ = 0;            // CheckpointFailed reports of every generation
  nlohmann::json lastCheckpointFailure_;  // the newest one, for state.json
  std::shared_ptr<const nlohmann::json> planJson_;  // shared with state.json's writer
  int planJsonGeneration_ = -1;
};

}  // namespace varuna
