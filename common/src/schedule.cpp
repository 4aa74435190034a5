#include "varuna/common/schedule.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "schedule_chunked.h"
#include "schedule_ticks.h"
#include "varuna/common/errors.h"

namespace varuna {

ScheduleKind parseScheduleKind(std::string_view name) {
  if (name == "varuna") return ScheduleKind::kVaruna;
  if (name == "1f1b" || name == "1F1B") return ScheduleKind::k1F1B;
  if (name == "gpipe" || name == "GPipe") return ScheduleKind::kGPipe;
  if (name == "zb-h1" || name == "ZB-H1" || name == "zbh1") return ScheduleKind::kZeroBubbleH1;
  if (name == "interleaved" || name == "interleaved-1f1b" || name == "Interleaved1F1B") {
    return ScheduleKind::kInterleaved1F1B;
  }
  if (name == "zbv" || name == "ZBV" || name == "zb-v") return ScheduleKind::kZeroBubbleV;
  throw ConfigError(strCat("unknown schedule '", name, "': use varuna, 1f1b, gpipe, zb-h1, interleaved[:v] or zbv"));
}

std::string toString(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kVaruna: return "varuna";
    case ScheduleKind::k1F1B: return "1f1b";
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::kZeroBubbleH1: return "zb-h1";
    case ScheduleKind::kInterleaved1F1B: return "interleaved";
    case ScheduleKind::kZeroBubbleV: return "zbv";
  }
  return "?";
}

bool isChunked(ScheduleKind kind) {
  return kind == ScheduleKind::kInterleaved1F1B || kind == ScheduleKind::kZeroBubbleV;
}

int defaultChunks(ScheduleKind kind) { return isChunked(kind) ? 2 : 1; }

void checkChunks(ScheduleKind kind, int chunks) {
  constexpr int kMaxInterleavedChunks = 8;
  if (kind == ScheduleKind::kInterleaved1F1B) {
    if (chunks < 2 || chunks > kMaxInterleavedChunks) {
      throw ConfigError(strCat("interleaved needs 2 to ", kMaxInterleavedChunks, " chunks per rank, got ", chunks,
                               " (interleaved with one chunk is 1f1b: use --schedule 1f1b)"));
    }
  } else if (chunks != defaultChunks(kind)) {
    throw ConfigError(strCat("schedule ", toString(kind), " runs ", defaultChunks(kind), " chunk",
                             defaultChunks(kind) > 1 ? "s" : "", " per rank, not ", chunks,
                             ": only interleaved takes a number of chunks (interleaved:v)"));
  }
}

ScheduleChoice::ScheduleChoice(ScheduleKind k) : kind(k), chunks(defaultChunks(k)) {}

ScheduleChoice parseScheduleChoice(std::string_view text) {
  const auto colon = text.find(':');
  ScheduleChoice choice;
  choice.kind = parseScheduleKind(text.substr(0, colon));
  choice.chunks = defaultChunks(choice.kind);
  if (colon != std::string_view::npos) {
    const std::string digits(text.substr(colon + 1));
    size_t used = 0;
    int chunks = 0;
    try {
      chunks = std::stoi(digits, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (digits.empty() || used != digits.size()) {
      throw ConfigError(strCat("schedule '", text, "': the number of chunks after ':' must be an integer, "
                               "e.g. interleaved:2"));
    }
    choice.chunks = chunks;
  }
  checkChunks(choice.kind, choice.chunks);
  return choice;
}

std::string toString(const ScheduleChoice& choice) {
  if (choice.chunks == defaultChunks(choice.kind)) return toString(choice.kind);
  return strCat(toString(choice.kind), ":", choice.chunks);
}

bool splitsBackward(ScheduleKind kind) {
  return kind == ScheduleKind::kZeroBubbleH1 || kind == ScheduleKind::kZeroBubbleV;
}

const std::vector<std::string>& scheduleNames() {
  static const std::vector<std::string> names{"varuna", "1f1b", "gpipe", "zb-h1", "interleaved", "zbv"};
  return names;
}

ChunkLayout ChunkLayout::of(ScheduleKind kind, int stages, int chunks) {
  return ChunkLayout{stages, chunks, kind == ScheduleKind::kZeroBubbleV};
}

int ChunkLayout::virtualStage(int stage, int chunk) const {
  VARUNA_CHECK(stage >= 0 && stage < stages && chunk >= 0 && chunk < chunks, "no chunk ", chunk, " on stage ", stage);
  if (vShape) return chunk % 2 == 0 ? chunk * stages + stage : (chunk + 1) * stages - 1 - stage;
  return chunk * stages + stage;
}

int ChunkLayout::chunkOf(int virtualStage) const { return virtualStage / stages; }

int ChunkLayout::stageOf(int virtualStage) const {
  const int within = virtualStage % stages;
  return vShape && chunkOf(virtualStage) % 2 == 1 ? stages - 1 - within : within;
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

// Megatron-LM's interleaved 1F1B (Narayanan et al., SC 2021). The k-th
// forward of a rank is of chunk (k / P) mod v and micro-batch
// (k / (P v)) P + k mod P: micro-batches go through a chunk in groups of P.
// Backwards take the same order with the chunks reversed. Rank s runs
// (P-s-1)*2 + (v-1)*P forwards first, then one forward one backward.
Schedule interleaved1F1B(int stages, int m, int chunks) {
  if (m % stages != 0) {
    throw ConfigError(strCat("interleaved needs a number of micro-batches that is a multiple of the ", stages,
                             " stages, got ", m, ": change the batch size or the micro-batch size, or use zbv"));
  }
  const int total = m * chunks;
  auto nth = [&](int k, bool forward) {
    const int inGroup = k % (stages * chunks);
    const int chunk = inGroup / stages;
    return std::pair{forward ? chunk : chunks - 1 - chunk, (k / (stages * chunks)) * stages + k % stages};
  };
  Schedule schedule(stages);
  for (int s = 0; s < stages; ++s) {
    const int warmup = std::min((stages - s - 1) * 2 + (chunks - 1) * stages, total);
    auto forward = [&](int k) {
      const auto [c, i] = nth(k, true);
      schedule[s].push_back({TaskType::kForward, i, true, c});
    };
    auto backward = [&](int k) {
      const auto [c, i] = nth(k, false);
      schedule[s].push_back({TaskType::kBackward, i, true, c});
    };
    int f = 0, b = 0;
    for (; f < warmup; ++f) forward(f);
    for (; f < total; ++f, ++b) {
      forward(f);
      backward(b);
    }
    for (; b < total; ++b) backward(b);
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

Schedule generateSchedule(ScheduleKind kind, int stages, int microbatches, int chunks) {
  if (stages < 1) throw ConfigError(strCat("number of stages must be >= 1, got ", stages));
  if (microbatches < 1) throw ConfigError(strCat("number of micro-batches must be >= 1, got ", microbatches));
  if (chunks < 1) chunks = defaultChunks(kind);
  checkChunks(kind, chunks);
  const ChunkLayout layout = ChunkLayout::of(kind, stages, chunks);
  switch (kind) {
    case ScheduleKind::kGPipe: return gpipe(stages, microbatches);
    case ScheduleKind::k1F1B: return oneFOneB(stages, microbatches);
    case ScheduleKind::kVaruna: return VarunaScheduleBuilder(stages, microbatches).build();
    case ScheduleKind::kZeroBubbleH1:
      // One chunk per stage, B > F > W, at most P - s + 1 micro-batches in flight:
      // one more than 1F1B's, which lets a W wait past the next B.
      return chunkedSchedule(layout, microbatches, /*splitBackward=*/true, [&](int s) { return stages - s + 1; });
    case ScheduleKind::kInterleaved1F1B: return interleaved1F1B(stages, microbatches, chunks);
    case ScheduleKind::kZeroBubbleV:
      // 1F1B's memory on its first rank (P whole micro-batches), on every rank.
      return chunkedSchedule(layout, microbatches, /*splitBackward=*/true, [&](int) { return 2 * stages; });
  }
  VARUNA_CHECK(false, "unknown schedule kind");
  return {};
}

std::string describe(const StageSchedule& stage) {
  const bool chunked = std::any_of(stage.begin(), stage.end(), [](const Task& t) { return t.chunk != 0; });
  std::ostringstream out;
  for (size_t k = 0; k < stage.size(); ++k) {
    if (k) out << ' ';
    const Task& t = stage[k];
    out << taskLetter(t.type) << t.microbatch;
    if (chunked) out << '.' << t.chunk;
  }
  return out.str();
}

ScheduleTiming replaySchedule(const Schedule& schedule, const std::vector<TaskCosts>& stageCosts,
                              const std::optional<ChunkLayout>& layout) {
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
  // One figure per boundary: stageCosts[s].transfer is the s <-> s+1 link,
  // both ways (under chunks, the link out of the lower virtual stage's rank).
  const ChunkLayout plain = layout.value_or(ChunkLayout{static_cast<int>(schedule.size()), 1, false});
  costs.transferSeconds = [&stageCosts, plain](int from, int to, int) {
    return stageCosts[plain.stageOf(std::min(from, to))].transfer;
  };
  return replaySchedule(schedule, costs, layout);
}

namespace {

// The replay's record of one virtual stage x micro-batch.
enum class Held { kNothing, kInputOnly, kActivations, kWeightPending };

}  // namespace

ScheduleTiming replaySchedule(const Schedule& schedule, const ReplayCosts& costs,
                              const std::optional<ChunkLayout>& givenLayout) {
  const int P = static_cast<int>(schedule.size());
  if (!costs.taskSeconds) throw std::logic_error("ReplayCosts.taskSeconds is required");
  const ChunkLayout layout = givenLayout.value_or(ChunkLayout{P, 1, false});
  if (layout.stages != P) throw std::logic_error("the chunk layout is of another number of stages");
  const int V = layout.virtualStages();
  auto transfer = [&](int fromVs, int toVs, int i) {
    const bool sameRank = layout.stageOf(fromVs) == layout.stageOf(toVs);
    return costs.transferSeconds && !sameRank ? costs.transferSeconds(fromVs, toVs, i) : 0.0;
  };
  constexpr double kUnknown = -1.0;
  int m = 0;
  for (const auto& stage : schedule) {
    for (const Task& t : stage) {
      m = std::max(m, t.microbatch + 1);
      if (t.chunk < 0 || t.chunk >= layout.chunks) {
        throw std::logic_error(strCat("a task of chunk ", t.chunk, " in a layout of ", layout.chunks, " chunks"));
      }
    }
  }
  // Completion times of forwards and backwards per virtual stage, and what each holds.
  std::vector<std::vector<double>> fEnd(V, std::vector<double>(m, kUnknown));
  std::vector<std::vector<double>> bEnd(V, std::vector<double>(m, kUnknown));
  std::vector<std::vector<Held>> held(V, std::vector<Held>(m, Held::kNothing));
  ScheduleTiming timing;
  timing.start.assign(P, {});
  timing.end.assign(P, {});
  timing.busy.assign(P, 0.0);
  std::vector<size_t> pos(P, 0);
  std::vector<double> freeAt(P, 0.0);

  auto inputArrival = [&](int vs, const Task& t) -> double {
    const int i = t.microbatch;
    const Held h = held[vs][i];
    const std::string where = strCat("stage ", layout.stageOf(vs), layout.chunks > 1 ? strCat(" chunk ", t.chunk) : "");
    switch (t.type) {
      case TaskType::kForward:
        if (vs == 0) return 0.0;
        return fEnd[vs - 1][i] < 0 ? kUnknown : fEnd[vs - 1][i] + transfer(vs - 1, vs, i);
      case TaskType::kRecompute:
        if (h != Held::kInputOnly) {
          throw std::logic_error(strCat(where, " recomputes micro-batch ", i, " without a prior activation-free forward"));
        }
        return 0.0;
      case TaskType::kBackward:
      case TaskType::kBackwardInput:
        if (h != Held::kActivations) {
          throw std::logic_error(strCat(where, " runs backward of micro-batch ", i, " without activations"));
        }
        if (vs == V - 1) return 0.0;
        return bEnd[vs + 1][i] < 0 ? kUnknown : bEnd[vs + 1][i] + transfer(vs + 1, vs, i);
      case TaskType::kBackwardWeight:
        if (h != Held::kWeightPending) {
          throw std::logic_error(strCat(where, " runs the weight gradient of micro-batch ", i,
                                        " before its input gradient"));
        }
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
        const int vs = layout.virtualStage(s, t.chunk);
        const double arrival = inputArrival(vs, t);
        if (arrival < 0) break;  // waits for another stage
        const double cost = costs.taskSeconds(s, t);
        const double start = std::max(freeAt[s], arrival);
        const double end = start + cost;
        timing.start[s].push_back(start);
        timing.end[s].push_back(end);
        timing.busy[s] += cost;
        freeAt[s] = end;
        const int i = t.microbatch;
        switch (t.type) {
          case TaskType::kForward:
            fEnd[vs][i] = end;
            held[vs][i] = t.keepActivations ? Held::kActivations : Held::kInputOnly;
            break;
          case TaskType::kRecompute: held[vs][i] = Held::kActivations; break;
          case TaskType::kBackwardWeight: held[vs][i] = Held::kNothing; break;
          case TaskType::kBackward:
          case TaskType::kBackwardInput:
            bEnd[vs][i] = end;
            held[vs][i] = t.type == TaskType::kBackwardInput ? Held::kWeightPending : Held::kNothing;
            break;
        }
        ++pos[s];
        ++done;
        progressed = true;
      }
    }
    if (!progressed) throw std::logic_error("schedule deadlocks: every stage waits for another");
  }
  for (int vs = 0; vs < V; ++vs) {
    const std::string where =
        strCat("stage ", layout.stageOf(vs), layout.chunks > 1 ? strCat(" chunk ", layout.chunkOf(vs)) : "");
    for (int i = 0; i < m; ++i) {
      if (bEnd[vs][i] < 0) throw std::logic_error(strCat(where, " never runs backward of micro-batch ", i));
      if (held[vs][i] == Held::kWeightPending) {
        throw std::logic_error(strCat(where, " never runs the weight gradient of micro-batch ", i));
      }
    }
  }
  for (int s = 0; s < P; ++s) timing.makespan = std::max(timing.makespan, freeAt[s]);
  return timing;
}

}  // namespace varuna
