// StepTimeline: what one rank did when in each training step (its tasks, the
// waits on its neighbours, the posting of messages, the step's all-reduces
// and its update), written as Chrome trace events to
// <VarunaOptions::traceDir>/rank<r>_trace.json, one file per rank
// (gen<g>_rank<r>_trace.json under run_varuna's generation g), for
// ui.perfetto.dev or chrome://tracing, and for scripts/pipeline_trace.py,
// which merges the ranks' files and tells the schedule's own bubble (a
// replay of the recorded tasks with free messages) from what the machine
// and the transport added.
//
// Why a file per rank, written as the steps go: a rank cannot reach its
// peers' clocks, and a job that dies must still leave its trace. Events
// carry wall-clock microseconds (ranks on one host share that clock; across
// hosts, NTP's accuracy is the trace's). The file is a JSON array left
// open, which both viewers accept: each step's events are appended and
// flushed when the step ends.
//
// Private to the worker library (varuna_step.cpp). Off, it costs a few
// clock readings and branches per task, nothing written.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "varuna/common/schedule.h"

namespace varuna {

class StepTimeline {
 public:
  using Clock = std::chrono::steady_clock;

  struct Identity {
    int rank = 0, stage = 0, replica = 0;
    int64_t generation = 0;  // run_varuna's job generation (0 without a manager)
    ChunkLayout layout;
  };

  // `dir` empty: off (every call below returns at once). Otherwise the folder
  // is created and this rank's file started, replacing one a previous run left.
  StepTimeline(const std::string& dir, Identity who);

  bool enabled() const { return file_.is_open(); }
  const std::string& path() const { return path_; }

  void beginStep(int64_t step, Clock::time_point start);
  // One task of the schedule, as it ran.
  void task(const Task& t, Clock::time_point start, Clock::time_point end);
  // Anything else of the step: category "wait" (blocked on a neighbour),
  // "messages" (posting sends and receives), "allreduce", "update".
  // `name` a literal: nothing is built while the timeline is off.
  void span(const char* category, const char* name, Clock::time_point start, Clock::time_point end);
  // Appends the step's events, then a "step <n>" span around them (written
  // last: it marks the step complete), and flushes.
  void endStep(Clock::time_point end);

  // "F", "R", "B", "BI" or "W" (the trace's and pipeline_trace.py's names).
  static const char* taskLetters(TaskType type);

 private:
  int64_t micros(Clock::time_point t) const;
  // The trace's process: the rank, apart per generation (1000 ranks each),
  // so that a morph's generations are separate tracks once merged.
  int pid() const { return static_cast<int>(who_.generation * 1000 + who_.rank); }
  void write(const std::string& event);

  Identity who_;
  std::string path_;
  std::ofstream file_;
  // Wall clock at the steady clock's reading taken with it: events are
  // timed on the steady clock and written in wall-clock microseconds.
  Clock::time_point steadyOrigin_;
  int64_t wallOriginMicros_ = 0;
  int64_t step_ = 0;
  Clock::time_point stepStart_;
  std::vector<std::string> events_;  // this step's, until endStep
};

}  // namespace varuna
