#include "varuna/common/schedule.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "schedule_ticks.h"
#include "schedule_zero_bubble.h"
#include "varuna/common/errors.h"

namespace varuna {

ScheduleKind parseScheduleKind(std::string_view name) {
  if (name == "varuna") return ScheduleKind::kVaruna;
  if (name == "1f1b" || name == "1F1B") return ScheduleKind::k1F1B;
  if (name == "gpipe" || name == "GPipe") return ScheduleKind::kGPipe;
  if (name == "zb-h1" || name == "ZB-H1" || name == "zbh1") return ScheduleKind::kZeroBubbleH1;
  throw ConfigError(strCat("unknown schedule '", name, "': use varuna, 1f1b, gpipe or zb-h1"));
}

std::string toString(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kVaruna: return "varuna";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::kZeroBubbleH1: return "zb-h1";
  }
  return "?";
}

bool splitsBackward(ScheduleKind kind) { return kind == ScheduleKind::kZeroBubbleH1; }

const std::vector<std::string>& scheduleNames() {
  static const std::vector<std::string> names{"varuna", "1f1b", "gpipe", "zb-h1"};
  return names;
}

namespace {

char taskLetter(TaskType type) {
  switch (type) {
    case TaskType::kForward: return 'f';
    case TaskType::kRecompute: return 'r';
    case TaskType::kBackward: return 'b';
    case TaskType::kBackwardInput: return 'B';
    case TaskType::kBackwardWeight: return 'W';
  }
  return '?';
}

Schedule gpipe(int stages, int m) {
  Schedule schedule(stages);
  for (auto& stage : schedule) {
    for (int i = 0; i < m; ++i) stage.push_back({TaskType::kForward, i, true});
    for (int i = 0; i < m; ++i) stage.push_back({TaskType::kBackward, i, true});
  }
  return schedule;
}

Schedule oneFOneB(int stages, int m) {
  Schedule schedule(stages);
  for (int s = 0; s < stages; ++s) {
    const int warmup = std::min(stages - s - 1, m);
    int f = 0, b = 0;
    for (; f < warmup; ++f) schedule[s].push_back({TaskType::kForward, f, true});
    while (f < m) {
      schedule[s].push_back({TaskType::kForward, f++, true});
      schedule[s].push_back({TaskType::kBackward, b++, true});
    }
    while (b < m) schedule[s].push_back({TaskType::kBackward, b++, true});
  }
  return schedule;
}

// Varuna's schedule comes from a list-scheduling simulation in integer ticks
// (forward = recompute = 100, backward = 200, a message = 1 tick). Each idle
// stage takes the highest-priority ready task: backward, then recompute, then
// forward; forwards, recomputes and backwards each run in micro-batch order.
class VarunaScheduleBuilder {
 public:
  VarunaScheduleBuilder(int stages, int m)
      : P_(stages), m_(m), fDone_(stages, std::vector<long>(m, kNever)),
        bStart_(stages, std::vector<long>(m, kNever)), bDone_(stages, std::vector<long>(m, kNever)),
        rDone_(stages, std::vector<long>(m, kNever)), next_(stages), freeAt_(stages, 0),
        order_(stages) {}

  Schedule build() {
    long remaining = static_cast<long>(P_) * m_ * 2 + static_cast<long>(P_ - 1) * m_;
    for (long now = 0; remaining > 0; now = nextEvent(now)) {
      VARUNA_CHECK(now < kTickLimit, "Varuna schedule simulation did not converge");
      startedNow_ = false;
      for (int s = 0; s < P_; ++s) {
        if (freeAt_[s] > now) continue;
        if (startNextTask(s, now)) {
          --remaining;
          startedNow_ = true;
        }
      }
    }
    return keepActivationsWhereBackwardFollows();
  }

 private:
  static constexpr long kNever = ticks::kNever;
  static constexpr long kForward = 100, kRecompute = 100, kBackward = 200, kMessage = 1;
  static constexpr long kTickLimit = 1L << 40;

  struct Cursor {
    int f = 0, r = 0, b = 0;
  };

  bool last(int s) const { return s == P_ - 1; }

  long nextEvent(long now) const { return ticks::nextEvent(freeAt_, now, startedNow_, "Varuna"); }
  static bool reached(long t, long now) { return t != kNever && t <= now; }

  bool backwardReady(int s, int i, long now) const {
    if (i >= m_) return false;
    if (last(s)) return reached(fDone_[s][i], now);
    return reached(rDone_[s][i], now) &&
           bDone_[s + 1][i] != kNever && reached(bDone_[s + 1][i] + kMessage, now);
  }
  bool recomputeReady(int s, int i, long now) const {
    if (last(s) || i >= m_) return false;
    return reached(fDone_[s][i], now) && bStart_[s + 1][i] != kNever &&
           reached(bStart_[s + 1][i] + kMessage, now);
  }
  bool forwardReady(int s, int i, long now) const {
    if (i >= m_) return false;
    if (s == 0) return true;
    return fDone_[s - 1][i] != kNever && reached(fDone_[s - 1][i] + kMessage, now);
  }

  bool startNextTask(int s, long now) {
    Cursor& c = next_[s];
    if (backwardReady(s, c.b, now)) {
      bStart_[s][c.b] = now;
      bDone_[s][c.b] = now + kBackward;
      freeAt_[s] = now + kBackward;
      order_[s].push_back({TaskType::kBackward, c.b++, true});
      return true;
    }
    if (recomputeReady(s, c.r, now)) {
      rDone_[s][c.r] = now + kRecompute;
      freeAt_[s] = now + kRecompute;
      order_[s].push_back({TaskType::kRecompute, c.r++, true});
      return true;
    }
    if (forwardReady(s, c.f, now)) {
      fDone_[s][c.f] = now + kForward;
      freeAt_[s] = now + kForward;
      order_[s].push_back({TaskType::kForward, c.f++, last(s)});
      return true;
    }
    return false;
  }

  // A forward immediately followed by its own recompute would recompute what
  // it could simply have kept: merge the two into a forward that keeps its
  // activations (this is how the last pipeline-stage-like steady state arises).
  Schedule keepActivationsWhereBackwardFollows() {
    Schedule result(P_);
    for (int s = 0; s < P_; ++s) {
      const auto& tasks = order_[s];
      for (size_t k = 0; k < tasks.size(); ++k) {
        Task t = tasks[k];
        if (t.type == TaskType::kForward && !t.keepActivations && k + 1 < tasks.size() &&
            tasks[k + 1].type == TaskType::kRecompute && tasks[k + 1].microbatch == t.microbatch) {
          t.keepActivations = true;
          ++k;  // drop the recompute
        }
        result[s].push_back(t);
      }
    }
    return result;
  }

  int P_, m_;
  std::vector<std::vector<long>> fDone_, bStart_, bDone_, rDone_;
  std::vector<Cursor> next_;
  std::vector<long> freeAt_;
  bool startedNow_ = false;
  Schedule order_;
};

}  // namespace

Schedule generateSchedule(ScheduleKind kind, int stages, int microbatches) {
  if (stages < 1) throw ConfigError(strCat("number of stages must be >= 1, got ", stages));
  if (microbatches < 1) throw ConfigError(strCat("number of micro-batches must be >= 1, got ", microbatches));
  switch (kind) {
    case ScheduleKind::kGPipe: return gpipe(stages, microbatches);
    case ScheduleKind::k1F1B: return oneFOneB(stages, microbatches);
    case ScheduleKind::kVaruna: return VarunaScheduleBuilder(stages, microbatches).build();
    case ScheduleKind::kZeroBubbleH1: return zeroBubbleH1Schedule(stages, microbatches);
  }
  VARUNA_CHECK(false, "unknown schedule kind");
  return {};
}

std::string describe(const StageSchedule& stage) {
  std::ostringstream out;
  for (size_t k = 0; k < stage.size(); ++k) {
    if (k) out << ' ';
    const Task& t = stage[k];
    out << taskLetter(t.type) << t.microbatch;
  }
  return out.str();
}

ScheduleTiming replaySchedule(const Schedule& schedule, const std::vector<TaskCosts>& stageCosts) {
  if (stageCosts.size() != schedule.size()) throw std::logic_error("one TaskCosts per stage needed");
  ReplayCosts costs;
  costs.taskSeconds = [&stageCosts](int s, const Task& t) {
    const TaskCosts& c = stageCosts[s];
    switch (t.type) {
      case TaskType::kForward: return c.forward;
      case TaskType::kRecompute: return c.recompute;
      case TaskType::kBackward: return c.backward;
      case TaskType::kBackwardInput: return c.backwardInput;
      case TaskType::kBackwardWeight: return c.backwardWeight;
    }
    return 0.0;
  };
  // One figure per boundary: stageCosts[s].transfer is the s <-> s+1 link, both ways.
  costs.transferSeconds = [&stageCosts](int from, int to, int) { return stageCosts[std::min(from, to)].transfer; };
  return replaySchedule(schedule, costs);
}

ScheduleTiming replaySchedule(const Schedule& schedule, const ReplayCosts& costs) {
  const int P = static_cast<int>(schedule.size());
  if (!costs.taskSeconds) throw std::logic_error("ReplayCosts.taskSeconds is required");
  auto transfer = [&costs](int from, int to, int i) {
    return costs.transferSeconds ? costs.transferSeconds(from, to, i) : 0.0;
  };
  constexpr double kUnknown = -1.0;
  int m = 0;
  for (const auto& stage : schedule) {
    for (const Task& t : stage) m = std::max(m, t.microbatch + 1);
  }
  // Completion times of forwards and backwards, and which forwards kept activations.
  std::vector<std::vector<double>> fEnd(P, std::vector<double>(m, kUnknown));
  std::vector<std::vector<double>> bEnd(P, std::vector<double>(m, kUnknown));
  // 0 none (or done), 1 forward w/o acts, 2 acts ready, 3 input gradient done, W pending.
  std::vector<std::vector<int>> state(P, std::vector<int>(m, 0));
  ScheduleTiming timing;
  timing.start.assign(P, {});
  timing.end.assign(P, {});
  timing.busy.assign(P, 0.0);
  std::vector<size_t> pos(P, 0);
  std::vector<double> freeAt(P, 0.0);

  auto inputArrival = [&](int s, const Task& t) -> double {
    const int i = t.microbatch;
    switch (t.type) {
      case TaskType::kForward:
        if (s == 0) return 0.0;
        return fEnd[s - 1][i] < 0 ? kUnknown : fEnd[s - 1][i] + transfer(s - 1, s, i);
      case TaskType::kRecompute:
        if (state[s][i] != 1) throw std::logic_error(strCat("stage ", s, " recomputes micro-batch ", i,
                                                             " without a prior activation-free forward"));
        return 0.0;
      case TaskType::kBackward:
      case TaskType::kBackwardInput:
        if (state[s][i] != 2) throw std::logic_error(strCat("stage ", s, " runs backward of micro-batch ", i,
                                                             " without activations"));
        if (s == P - 1) return 0.0;
        return bEnd[s + 1][i] < 0 ? kUnknown : bEnd[s + 1][i] + transfer(s + 1, s, i);
      case TaskType::kBackwardWeight:
        if (state[s][i] != 3) throw std::logic_error(strCat("stage ", s, " runs the weight gradient of micro-batch ",
                                                             i, " before its input gradient"));
        return 0.0;
    }
    return kUnknown;
  };

  size_t done = 0, total = 0;
  for (const auto& stage : schedule) total += stage.size();
  while (done < total) {
    bool progressed = false;
    for (int s = 0; s < P; ++s) {
      while (pos[s] < schedule[s].size()) {
        const Task& t = schedule[s][pos[s]];
        const double arrival = inputArrival(s, t);
        if (arrival < 0) break;  // waits for another stage
        const double cost = costs.taskSeconds(s, t);
        const double start = std::max(freeAt[s], arrival);
        const double end = start + cost;
        timing.start[s].push_back(start);
        timing.end[s].push_back(end);
        timing.busy[s] += cost;
        freeAt[s] = end;
        const int i = t.microbatch;
        if (t.type == TaskType::kForward) {
          fEnd[s][i] = end;
          state[s][i] = t.keepActivations ? 2 : 1;
        } else if (t.type == TaskType::kRecompute) {
          state[s][i] = 2;
        } else if (t.type == TaskType::kBackwardWeight) {
          state[s][i] = 0;
        } else {
          bEnd[s][i] = end;
          state[s][i] = t.type == TaskType::kBackwardInput ? 3 : 0;
        }
        ++pos[s];
        ++done;
        progressed = true;
      }
    }
    if (!progressed) throw std::logic_error("schedule deadlocks: every stage waits for another");
  }
  for (int s = 0; s < P; ++s) {
    for (int i = 0; i < m; ++i) {
      if (bEnd[s][i] < 0) throw std::logic_error(strCat("stage ", s, " never runs backward of micro-batch ", i));
      if (state[s][i] == 3) {
        throw std::logic_error(strCat("stage ", s, " never runs the weight gradient of micro-batch ", i));
      }
    }
    timing.makespan = std::max(timing.makespan, freeAt[s]);
  }
  return timing;
}

}  // namespace varuna
