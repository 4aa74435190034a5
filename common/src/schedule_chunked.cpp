#include "schedule_chunked.h"

#include <algorithm>
#include <functional>
#include <queue>

#include "schedule_ticks.h"

#include "varuna/common/errors.h"

namespace varuna {
namespace {

// zb-h1 (one chunk per stage) and zbv come from a list-scheduling simulation
// in integer ticks, like Varuna's: a chunk's forward, input gradient and
// weight gradient take 100 ticks each (a whole backward 200), a message
// between ranks a few ticks (none between two chunks of one rank; which few:
// chunkedSchedule below). An idle rank takes
// the first ready task in the priority B > F > W and, within a kind, the
// chunk furthest down the model first (its output feeds another rank, or it
// is the loss that starts the backward), micro-batches in order per chunk:
//  - B first: another rank waits for its gradient;
//  - F next, while the rank holds fewer than maxInFlight chunk micro-batches
//    between their forward and the end of their backward: the activation
//    memory. Depth first (the furthest chunk first) takes a micro-batch to
//    the loss as early as the memory allows, which is what starts the
//    steady one-forward-one-backward phase;
//    Micro-batches enter the first chunk in groups of P (groupAdmitted);
//  - W last: nobody waits for it; it fills time the rank would idle, and
//    the tail's W run while the earlier stages finish their B.
// For zb-h1 the cap is P - s + 1 micro-batches: one more than 1F1B's P - s,
// which lets a stage defer a W past the next B and takes a W off the
// bubble: (P-1)(F+B) - W for equal costs (the paper's ZB-H1 reaches
// (P-1)(F+B-W) by counting a pending W's memory as less than a
// micro-batch's; we count whole micro-batches).
class ChunkedBuilder {
 public:
  ChunkedBuilder(const ChunkLayout& layout, int m, bool split, const std::function<int(int)>& maxInFlight,
                 long messageTicks)
      : layout_(layout), V_(layout.virtualStages()), m_(m), split_(split), message_(messageTicks),
        fDone_(V_, std::vector<long>(m, kNever)), bDone_(V_, std::vector<long>(m, kNever)),
        wDone_(V_, std::vector<long>(m, kNever)), next_(V_), finished_(V_, 0),
        freeAt_(layout.stages, 0), order_(layout.stages) {
    for (int s = 0; s < layout.stages; ++s) {
      cap_.push_back(maxInFlight(s));
      VARUNA_CHECK(cap_.back() >= 1, "a rank must hold at least one micro-batch");
      std::vector<int> mine;
      for (int c = 0; c < layout.chunks; ++c) mine.push_back(layout.virtualStage(s, c));
      std::sort(mine.rbegin(), mine.rend());  // furthest down the model first
      chunksFurthestFirst_.push_back(mine);
    }
  }

  Schedule build() {
    long remaining = static_cast<long>(V_) * m_ * (split_ ? 3 : 2);
    for (long now = 0; remaining > 0; now = ticks::nextEvent(freeAt_, now, startedNow_, "chunked", nextArrival(now))) {
      VARUNA_CHECK(now < kTickLimit, "chunked schedule simulation did not converge");
      startedNow_ = false;
      for (int s = 0; s < layout_.stages; ++s) {
        if (freeAt_[s] > now || !startNextTask(s, now)) continue;
        --remaining;
        startedNow_ = true;
      }
    }
    return order_;
  }

 private:
  static constexpr long kNever = ticks::kNever;
  static constexpr long kTask = 100;
  static constexpr long kTickLimit = 1L << 40;

  struct Cursor {
    int f = 0, b = 0, w = 0;
  };

  static bool reached(long t, long now) { return t != kNever && t <= now; }
  // The output of virtual stage `from` is usable on `to`'s rank.
  bool arrived(int from, int to, long t, long now) const {
    const long message = layout_.stageOf(from) == layout_.stageOf(to) ? 0 : message_;
    return t != kNever && t + message <= now;
  }
  std::vector<std::vector<long>>& lastDone() { return split_ ? wDone_ : bDone_; }

  // Chunk micro-batches rank s holds: forwards started, backwards not ended.
  int inFlight(int s, long now) {
    int held = 0;
    for (int vs : chunksFurthestFirst_[s]) {
      const auto& done = lastDone()[vs];
      while (finished_[vs] < m_ && reached(done[finished_[vs]], now)) ++finished_[vs];
      held += next_[vs].f - finished_[vs];
    }
    return held;
  }

  bool forwardReady(int s, int vs, int i, long now) const {
    if (i >= m_ || !groupAdmitted(s, vs, i)) return false;
    return vs == 0 || arrived(vs - 1, vs, fDone_[vs - 1][i], now);
  }
  // Micro-batches enter a rank's first chunk in groups of P, a group once
  // the one before has reached the rank's last chunk (Megatron's order).
  // Without it a rank fills its memory with first-chunk forwards and has no
  // room left for the later chunks that free it.
  bool groupAdmitted(int s, int vs, int i) const {
    if (layout_.chunkOf(vs) != 0) return true;
    const int lastChunk = layout_.virtualStage(s, layout_.chunks - 1);
    return next_[lastChunk].f >= (i / layout_.stages) * layout_.stages;
  }
  bool backwardReady(int vs, int i, long now) const {
    if (i >= m_ || !reached(fDone_[vs][i], now)) return false;
    return vs == V_ - 1 || arrived(vs + 1, vs, bDone_[vs + 1][i], now);
  }
  bool weightReady(int vs, int i, long now) const { return split_ && i < m_ && reached(bDone_[vs][i], now); }

  bool startNextTask(int s, long now) {
    const TaskType backward = split_ ? TaskType::kBackwardInput : TaskType::kBackward;
    for (int vs : chunksFurthestFirst_[s]) {
      if (backwardReady(vs, next_[vs].b, now)) return run(s, vs, now, backward, next_[vs].b++, bDone_);
    }
    if (inFlight(s, now) < cap_[s]) {
      for (int vs : chunksFurthestFirst_[s]) {
        if (forwardReady(s, vs, next_[vs].f, now)) return run(s, vs, now, TaskType::kForward, next_[vs].f++, fDone_);
      }
    }
    for (int vs : chunksFurthestFirst_[s]) {
      if (weightReady(vs, next_[vs].w, now)) {
        return run(s, vs, now, TaskType::kBackwardWeight, next_[vs].w++, wDone_);
      }
    }
    return false;
  }

  // The earliest tick after `now` at which a task's output reaches another
  // rank (what nextEvent cannot see from the stages' ends alone).
  long nextArrival(long now) {
    while (!arrivals_.empty() && arrivals_.top() <= now) arrivals_.pop();
    return arrivals_.empty() ? kNever : arrivals_.top();
  }

  bool run(int s, int vs, long now, TaskType type, int i, std::vector<std::vector<long>>& done) {
    const long cost = type == TaskType::kBackward ? 2 * kTask : kTask;
    done[vs][i] = now + cost;
    freeAt_[s] = now + cost;
    if (message_ > 1) arrivals_.push(now + cost + message_);
    order_[s].push_back({type, i, true, layout_.chunkOf(vs)});
    return true;
  }

  ChunkLayout layout_;
  int V_, m_;
  bool split_;
  long message_;  // ticks a message between ranks takes in the simulation
  // Every task's end plus a message (a task whose output stays on its rank,
  // or a W's, only adds an idle tick): empty with messages of one tick.
  std::priority_queue<long, std::vector<long>, std::greater<>> arrivals_;
  std::vector<std::vector<long>> fDone_, bDone_, wDone_;  // [virtual stage][micro-batch]
  std::vector<Cursor> next_;                               // per virtual stage
  std::vector<int> finished_;  // per virtual stage: micro-batches whose backward has ended
  std::vector<long> freeAt_;   // per rank
  std::vector<int> cap_;
  std::vector<std::vector<int>> chunksFurthestFirst_;  // per rank, its virtual stages
  bool startedNow_ = false;
  Schedule order_;
};

// The makespan of `schedule` replayed with a chunk's forward, input gradient
// and weight gradient each taking 1 (a whole backward 2), and `transfer` per
// message between ranks.
double equalCostMakespan(const Schedule& schedule, const ChunkLayout& layout, double transfer) {
  ReplayCosts costs;
  costs.taskSeconds = [](int, const Task& task) { return task.type == TaskType::kBackward ? 2.0 : 1.0; };
  costs.transferSeconds = [transfer](int, int, int) { return transfer; };
  return replaySchedule(schedule, costs, layout).makespan;
}

}  // namespace

// Why two candidates: the order the simulation finds depends on what it
// assumes a message costs. Assuming almost nothing (1 tick) finds the best
// order when messages are free; assuming as much as a task (100 ticks)
// finds orders that keep a rank busy with other work while its neighbour's
// answer travels. At P = 2 (zbv) the second is as good with free messages
// and loses less to slow ones: m = 8, each message 5 % of a task: 49.2
// against 49.5 tasks' time, and with this CPU's costs (B 1.33 and W 1.04
// times F, messages 4-20 % of F) a busy fraction of 0.96-0.97 against
// 0.92-0.93 in the replay. At P >= 3 it is worse with free messages. So
// both are built and the replay picks: the shorter with free messages, ties
// broken by the shorter when each message takes 5 % of a task, then by the
// first. Every rank computes the same pick.
Schedule chunkedSchedule(const ChunkLayout& layout, int microbatches, bool splitBackward,
                         const std::function<int(int)>& maxInFlight) {
  constexpr long kMessageTicks[] = {1, 100};
  constexpr double kSlowMessage = 0.05;
  Schedule best;
  std::pair<double, double> bestScore;
  for (long ticks : kMessageTicks) {
    Schedule candidate = ChunkedBuilder(layout, microbatches, splitBackward, maxInFlight, ticks).build();
    const std::pair<double, double> score{equalCostMakespan(candidate, layout, 0.0),
                                          equalCostMakespan(candidate, layout, kSlowMessage)};
    if (best.empty() || score < bestScore) {
      best = std::move(candidate);
      bestScore = score;
    }
  }
  return best;
}

}  // namespace varuna
