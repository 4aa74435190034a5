// MorphTracker: one morph (or relaunch after a failure) from its cause to the
// first step of the generation it launched, for everyone who reports it: its
// phases (MorphTimer), the metrics (JobMetrics' morph in progress, its cause,
// the recovery time), the `morph_complete` event and the "morph done in"
// line. Causes during a morph fold into it. Runs on the daemon's event-loop
// thread; the time is passed in.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "daemon/job_metrics.h"
#include "loop/event_log.h"
#include "varuna/manager/morph_timer.h"
#include "varuna/manager/planner.h"

namespace varuna {

class MorphTracker {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  explicit MorphTracker(JobMetrics& metrics) : metrics_(metrics) {}
  // Where morph_complete goes (the daemon opens its event log at start()).
  void setEventLog(EventLog* events) { events_ = events; }

  // A morph begins for `cause` (none under way). `counted` false: timed but
  // not a morph in the metrics (the job's own stop relaunches nothing).
  void begin(const std::string& cause, JobMetrics::MorphCause kind, TimePoint now, bool counted = true);
  // The generation that ends it was launched / is all connected.
  void launched(TimePoint now) { timer_.launched(now); }
  void connected(TimePoint now) { timer_.connected(now); }
  // The first step of `generation`: the morph under way, if any, is done.
  void firstStep(int generation, const Plan& plan, int64_t step, TimePoint now);

  bool active() const { return timer_.active(); }
  int completed() const { return completed_; }

 private:
  JobMetrics& metrics_;
  EventLog* events_ = nullptr;
  MorphTimer timer_;
  int completed_ = 0;
};

}  // namespace varuna
