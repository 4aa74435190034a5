// StepLog: the job's progress over time in <state_dir>/steps.jsonl, for
// after-the-fact views (scripts/varuna_report.py's timeline): one line per
// complete step, at most one a second, plus every generation's first step and
// its last one (written when the next launch or the stop comes), so that a
// rollback's steps are exact. Each line is an EventLog line with event "step":
// {"time", "unix_ms", "event": "step", "generation", "step", "loss",
// "step_s", "samples_per_s"}; samples/s is the throughput since the line
// before within the generation (the first line of a generation: its step's).
// Like the event log it never throws. Runs on the daemon's event-loop thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "varuna/manager/event_log.h"

namespace varuna {

class StepLog {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  static constexpr std::chrono::seconds kInterval{1};

  StepLog(const std::string& path, int64_t globalBatch) : log_(path), globalBatch_(globalBatch) {}

  // A step every rank of `generation` reported (`step` steps done) at `now`
  // (`unixMs` on the wall clock: a line written later keeps the step's time).
  void add(int generation, int64_t step, double loss, double stepSeconds, TimePoint now, int64_t unixMs);
  // The generation ends (a launch, the stop): its last step, if not written yet.
  void flush();

  const std::string& path() const { return log_.path(); }

 private:
  struct Line {
    int generation = 0;
    int64_t step = 0;
    double loss = 0, stepSeconds = 0;
    TimePoint at{};
    int64_t unixMs = 0;
  };
  void write(const Line& line);

  EventLog log_;
  int64_t globalBatch_;
  std::optional<Line> written_;  // the last line written
  std::optional<Line> pending_;  // a step not written (within the second)
};

}  // namespace varuna
