// StepLog: the job's progress over time in <state_dir>/steps.jsonl, for
// after-the-fact views (scripts/varuna_report.py's timeline): one line per
// complete step, at most one per interval (a second at first), plus every
// generation's first step and its last one (written when the next launch or
// the stop comes), so that a rollback's steps are exact. Each line is an
// EventLog line with event "step": {"time", "unix_ms", "event": "step",
// "generation", "step", "loss", "step_s", "samples_per_s"}; samples/s is the
// throughput since the line before within the generation (the first line of
// a generation: its step's).
//
// Bounded: when the file grows past maxBytes it is thinned in place (see
// thin() for why thinning rather than rotation), so a job of any length keeps
// its whole history at an even, coarser resolution in at most about maxBytes.
//
// Like the event log it never throws. Runs on the daemon's event-loop thread;
// a thinning reads and rewrites the file there (a local file of at most
// maxBytes, once each time it fills up again).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "loop/event_log.h"

namespace varuna {

class StepLog {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  static constexpr std::chrono::milliseconds kInterval{1000};
  // About 25,000 lines: at 150 bytes a line a second, 7 hours before the
  // first thinning; a picture is far narrower than that in pixels.
  static constexpr uint64_t kMaxBytes = 4 << 20;
  // A thinning that failed (full disk) is tried again this much later, not at every line.
  static constexpr std::chrono::minutes kThinRetry{10};

  // Appends to `path` (a restarted manager keeps the job's history); throws
  // Error if it cannot be opened, as EventLog does.
  StepLog(const std::string& path, int64_t globalBatch, uint64_t maxBytes = kMaxBytes);

  // A step every rank of `generation` reported (`step` steps done) at `now`
  // (`unixMs` on the wall clock: a line written later keeps the step's time).
  void add(int generation, int64_t step, double loss, double stepSeconds, TimePoint now, int64_t unixMs);
  // The generation ends (a launch, the stop): its last step, if not written yet.
  void flush();

  const std::string& path() const { return path_; }
  // The least time between two lines of a generation: kInterval, doubled by each thinning.
  std::chrono::milliseconds interval() const { return interval_; }

 private:
  struct Line {
    int generation = 0;
    int64_t step = 0;
    double loss = 0, stepSeconds = 0;
    TimePoint at{};
    int64_t unixMs = 0;
  };
  void write(const Line& line);
  void thinIfFull(TimePoint now) noexcept;
  void thin();

  std::string path_;
  std::optional<EventLog> log_;  // reopened after a thinning replaced the file; empty if that failed
  int64_t globalBatch_;
  uint64_t maxBytes_;
  std::chrono::milliseconds interval_ = kInterval;
  TimePoint thinRetryAt_{};      // after a failed thinning
  std::optional<Line> written_;  // the last line written
  std::optional<Line> pending_;  // a step not written (within the interval)
};

}  // namespace varuna
