#include <catch2/catch.hpp>

#include <map>
#include <tuple>

#include "varuna/common/errors.h"
#include "varuna/common/schedule.h"

using namespace varuna;

namespace {

int countType(const StageSchedule& s, TaskType type) {
  int n = 0;
  for (const Task& t : s) n += t.type == type;
  return n;
}

std::vector<TaskCosts> uniformCosts(int P, TaskCosts c = {}) { return std::vector<TaskCosts>(P, c); }

}  // namespace

TEST_CASE("Varuna schedule matches the reference example (2 stages, 3 micro-batches)", "[schedule]") {
  auto schedule = generateSchedule(ScheduleKind::kVaruna, 2, 3);
  REQUIRE(schedule.size() == 2);
  CHECK(describe(schedule[0]) == "f0 f1 f2 r0 b0 r1 b1 r2 b2");
  CHECK(describe(schedule[1]) == "f0 b0 f1 b1 f2 b2");
  // Stage 0 recomputes every micro-batch, so none of its forwards keep activations.
  for (const Task& t : schedule[0]) {
    if (t.type == TaskType::kForward) CHECK_FALSE(t.keepActivations);
  }
  for (const Task& t : schedule[1]) {
    if (t.type == TaskType::kForward) CHECK(t.keepActivations);
  }
}

TEST_CASE("every schedule runs each micro-batch once per stage and never deadlocks", "[schedule]") {
  for (auto kind : {ScheduleKind::kVaruna, ScheduleKind::k1F1B, ScheduleKind::kGPipe}) {
    for (int P : {1, 2, 3, 4, 7}) {
      for (int m : {1, 2, 3, 4, 8, 13}) {
        INFO(toString(kind) << " P=" << P << " m=" << m);
        auto schedule = generateSchedule(kind, P, m);
        REQUIRE(static_cast<int>(schedule.size()) == P);
        for (int s = 0; s < P; ++s) {
          CHECK(countType(schedule[s], TaskType::kForward) == m);
          CHECK(countType(schedule[s], TaskType::kBackward) == m);
          // Forwards and backwards each run in micro-batch order.
          int nextF = 0, nextB = 0;
          for (const Task& t : schedule[s]) {
            if (t.type == TaskType::kForward) CHECK(t.microbatch == nextF++);
            if (t.type == TaskType::kBackward) CHECK(t.microbatch == nextB++);
          }
          if (kind != ScheduleKind::kVaruna || s == P - 1) {
            CHECK(countType(schedule[s], TaskType::kRecompute) == 0);
          }
        }
        // replaySchedule checks every dependency (recompute after an
        // activation-free forward, backward only with activations) and deadlock.
        CHECK_NOTHROW(replaySchedule(schedule, uniformCosts(P)));
      }
    }
  }
}

TEST_CASE("Varuna recomputes exactly the forwards that dropped their activations", "[schedule]") {
  for (int P : {2, 3, 5}) {
    for (int m : {1, 4, 9}) {
      auto schedule = generateSchedule(ScheduleKind::kVaruna, P, m);
      for (int s = 0; s < P; ++s) {
        int dropped = 0;
        for (const Task& t : schedule[s]) dropped += t.type == TaskType::kForward && !t.keepActivations;
        CHECK(countType(schedule[s], TaskType::kRecompute) == dropped);
      }
    }
  }
}

TEST_CASE("1F1B warm-up depth and steady state", "[schedule]") {
  auto schedule = generateSchedule(ScheduleKind::k1F1B, 4, 6);
  CHECK(describe(schedule[0]) == "f0 f1 f2 f3 b0 f4 b1 f5 b2 b3 b4 b5");
  CHECK(describe(schedule[3]) == "f0 b0 f1 b1 f2 b2 f3 b3 f4 b4 f5 b5");
  CHECK(describe(generateSchedule(ScheduleKind::kGPipe, 2, 3)[1]) == "f0 f1 f2 b0 b1 b2");
}

TEST_CASE("replayed GPipe and 1F1B have the textbook bubble", "[schedule]") {
  for (auto kind : {ScheduleKind::k1F1B, ScheduleKind::kGPipe}) {
    for (int P : {2, 4}) {
      for (int m : {4, 8}) {
        auto timing = replaySchedule(generateSchedule(kind, P, m), uniformCosts(P));
        // (m + P - 1) slots of forward+backward: bubble fraction (P-1)/(m+P-1).
        CHECK(timing.makespan == Approx((m + P - 1) * 3.0));
        const double bubble = 1.0 - timing.busy[0] / timing.makespan;
        CHECK(bubble == Approx(double(P - 1) / (m + P - 1)));
      }
    }
  }
}

TEST_CASE("Varuna's recompute costs time only on non-last stages", "[schedule]") {
  auto schedule = generateSchedule(ScheduleKind::kVaruna, 2, 4);
  auto timing = replaySchedule(schedule, uniformCosts(2));
  const int recomputes = countType(schedule[0], TaskType::kRecompute);
  CHECK(recomputes > 0);
  CHECK(timing.busy[0] == Approx(4 * 3.0 + recomputes * 1.0));
  CHECK(timing.busy[1] == Approx(4 * 3.0));
}

TEST_CASE("bad schedule inputs are refused", "[schedule]") {
  CHECK_THROWS_AS(generateSchedule(ScheduleKind::kGPipe, 0, 3), ConfigError);
  CHECK_THROWS_AS(generateSchedule(ScheduleKind::kVaruna, 2, 0), ConfigError);
  CHECK_THROWS_AS(parseScheduleKind("pipedream"), ConfigError);
  CHECK(parseScheduleKind("1f1b") == ScheduleKind::k1F1B);
  // A hand-made order with a backward before its forward is caught by the replay.
  Schedule broken = {{{TaskType::kBackward, 0, true}, {TaskType::kForward, 0, true}}};
  CHECK_THROWS_AS(replaySchedule(broken, uniformCosts(1)), std::logic_error);
}

TEST_CASE("replay with per-task costs and per-message transfers", "[schedule]") {
  // The per-stage form is the general one with constant costs.
  for (auto kind : {ScheduleKind::kVaruna, ScheduleKind::k1F1B, ScheduleKind::kGPipe}) {
    auto schedule = generateSchedule(kind, 3, 5);
    const TaskCosts c{1.0, 0.5, 2.0, 0.25};
    ReplayCosts general;
    general.taskSeconds = [&](int, const Task& t) {
      return t.type == TaskType::kForward ? c.forward : t.type == TaskType::kRecompute ? c.recompute : c.backward;
    };
    general.transferSeconds = [&](int, int, int) { return c.transfer; };
    const auto a = replaySchedule(schedule, uniformCosts(3, c));
    const auto b = replaySchedule(schedule, general);
    CHECK(a.makespan == b.makespan);
    CHECK(a.end == b.end);
  }
  // GPipe, 2 stages, 2 micro-batches; the second micro-batch is half as costly
  // and only the gradient of micro-batch 1 takes time to cross (3 s).
  ReplayCosts costs;
  costs.taskSeconds = [](int, const Task& t) {
    const double scale = t.microbatch == 1 ? 0.5 : 1.0;
    return (t.type == TaskType::kBackward ? 2.0 : 1.0) * scale;
  };
  costs.transferSeconds = [](int from, int to, int i) { return from > to && i == 1 ? 3.0 : 0.0; };
  const auto timing = replaySchedule(generateSchedule(ScheduleKind::kGPipe, 2, 2), costs);
  // Stage 1: f0 1-2, f1 2-2.5, b0 2.5-4.5, b1 4.5-5.5; stage 0: b0 4.5-6.5, b1 waits for 5.5 + 3.
  CHECK(timing.end[1] == std::vector<double>{2.0, 2.5, 4.5, 5.5});
  CHECK(timing.end[0] == std::vector<double>{1.0, 1.5, 6.5, 9.5});
  CHECK(timing.makespan == 9.5);
  CHECK_THROWS_AS(replaySchedule(generateSchedule(ScheduleKind::kGPipe, 1, 1), ReplayCosts{}), std::logic_error);
}

TEST_CASE("zb-h1: golden orders, B before W, every dependency met", "[schedule]") {
  auto two = generateSchedule(ScheduleKind::kZeroBubbleH1, 2, 4);
  CHECK(describe(two[0]) == "f0 f1 f2 B0 W0 B1 f3 W1 B2 W2 B3 W3");
  CHECK(describe(two[1]) == "f0 B0 f1 B1 W0 f2 B2 W1 f3 B3 W2 W3");
  auto three = generateSchedule(ScheduleKind::kZeroBubbleH1, 3, 4);
  CHECK(describe(three[0]) == "f0 f1 f2 f3 B0 W0 B1 W1 B2 W2 B3 W3");
  CHECK(describe(three[1]) == "f0 f1 f2 B0 W0 B1 f3 W1 B2 W2 B3 W3");
  CHECK(describe(three[2]) == "f0 B0 f1 B1 W0 f2 B2 W1 f3 B3 W2 W3");
  for (int P : {1, 2, 3, 4, 7}) {
    for (int m : {1, 2, 3, 4, 8, 13}) {
      INFO("P=" << P << " m=" << m);
      auto schedule = generateSchedule(ScheduleKind::kZeroBubbleH1, P, m);
      for (int s = 0; s < P; ++s) {
        CHECK(countType(schedule[s], TaskType::kForward) == m);
        CHECK(countType(schedule[s], TaskType::kBackwardInput) == m);
        CHECK(countType(schedule[s], TaskType::kBackwardWeight) == m);
        CHECK(countType(schedule[s], TaskType::kBackward) == 0);
        // In flight (forward done, W not yet): at most P - s + 1.
        int inFlight = 0, peak = 0;
        for (const Task& t : schedule[s]) {
          inFlight += t.type == TaskType::kForward ? 1 : t.type == TaskType::kBackwardWeight ? -1 : 0;
          peak = std::max(peak, inFlight);
        }
        CHECK(peak <= P - s + 1);
      }
      CHECK_NOTHROW(replaySchedule(schedule, uniformCosts(P)));
    }
  }
}

TEST_CASE("zb-h1's replayed bubble is the analytic (P-1)(F+B) - W, below 1F1B's", "[schedule]") {
  // Equal costs F = B = W = 1, free transfers: 1F1B takes (m + P - 1)(F + B + W).
  TaskCosts c{.forward = 1, .recompute = 1, .backward = 2, .backwardInput = 1, .backwardWeight = 1};
  for (int P : {2, 3, 4}) {
    for (int m : {P, 8, 16}) {
      INFO("P=" << P << " m=" << m);
      const auto zb = replaySchedule(generateSchedule(ScheduleKind::kZeroBubbleH1, P, m), uniformCosts(P, c));
      const auto ofob = replaySchedule(generateSchedule(ScheduleKind::k1F1B, P, m), uniformCosts(P, c));
      CHECK(zb.makespan == Approx(3.0 * m + (P - 1) * 2.0 - 1.0));
      CHECK(ofob.makespan == Approx(3.0 * (m + P - 1)));
    }
  }
  // P = 2, m = 8: busy 24 of 25 (0.96) against 1F1B's 24 of 27 (0.889).
  const auto zb = replaySchedule(generateSchedule(ScheduleKind::kZeroBubbleH1, 2, 8), uniformCosts(2, c));
  CHECK(zb.busy[0] / zb.makespan == Approx(0.96));
}

TEST_CASE("the replay refuses a W before its B and a B never followed by its W", "[schedule]") {
  const Schedule early{{{TaskType::kForward, 0}, {TaskType::kBackwardWeight, 0}, {TaskType::kBackwardInput, 0}}};
  CHECK_THROWS_WITH(replaySchedule(early, uniformCosts(1)), Catch::Contains("before its input gradient"));
  const Schedule missing{{{TaskType::kForward, 0}, {TaskType::kBackwardInput, 0}}};
  CHECK_THROWS_WITH(replaySchedule(missing, uniformCosts(1)), Catch::Contains("never runs the weight gradient"));
}

namespace {

// Each chunk costs 1/v of its rank's stage: F = B = W = 1 per stage.
std::vector<TaskCosts> chunkCosts(int P, int v) {
  const double f = 1.0 / v;
  return std::vector<TaskCosts>(
      P, TaskCosts{.forward = f, .recompute = f, .backward = 2 * f, .backwardInput = f, .backwardWeight = f});
}

// Per rank, every (chunk, micro-batch) runs its forward and its backward (or
// B and W) exactly once.
void checkEveryChunkRunsOnce(const Schedule& schedule, int v, int m, bool split) {
  for (const auto& stage : schedule) {
    std::map<std::tuple<TaskType, int, int>, int> seen;
    for (const Task& t : stage) ++seen[{t.type, t.chunk, t.microbatch}];
    for (int c = 0; c < v; ++c) {
      for (int i = 0; i < m; ++i) {
        CHECK(seen[{TaskType::kForward, c, i}] == 1);
        if (split) {
          CHECK(seen[{TaskType::kBackwardInput, c, i}] == 1);
          CHECK(seen[{TaskType::kBackwardWeight, c, i}] == 1);
        } else {
          CHECK(seen[{TaskType::kBackward, c, i}] == 1);
        }
      }
    }
    CHECK(static_cast<int>(stage.size()) == v * m * (split ? 3 : 2));
  }
}

}  // namespace

TEST_CASE("chunk layouts: interleaved loops round the ranks, zbv goes down and back", "[schedule]") {
  const auto loop = ChunkLayout::of(ScheduleKind::kInterleaved1F1B, 3, 2);
  CHECK(loop.virtualStage(0, 0) == 0);
  CHECK(loop.virtualStage(2, 0) == 2);
  CHECK(loop.virtualStage(0, 1) == 3);
  CHECK(loop.virtualStage(2, 1) == 5);
  const auto vee = ChunkLayout::of(ScheduleKind::kZeroBubbleV, 3, 2);
  CHECK(vee.virtualStage(0, 1) == 5);  // the first and the last on rank 0
  CHECK(vee.virtualStage(2, 1) == 3);  // the turn stays on the last rank
  for (const auto& layout : {loop, vee}) {
    for (int vs = 0; vs < layout.virtualStages(); ++vs) {
      CHECK(layout.virtualStage(layout.stageOf(vs), layout.chunkOf(vs)) == vs);
    }
  }
}

TEST_CASE("schedule choices: names with a number of chunks, refused when they do not fit", "[schedule]") {
  CHECK(parseScheduleChoice("interleaved") == ScheduleChoice{ScheduleKind::kInterleaved1F1B, 2});
  CHECK(parseScheduleChoice("interleaved:3") == ScheduleChoice{ScheduleKind::kInterleaved1F1B, 3});
  CHECK(parseScheduleChoice("zbv") == ScheduleChoice{ScheduleKind::kZeroBubbleV, 2});
  CHECK(parseScheduleChoice("1f1b") == ScheduleChoice{ScheduleKind::k1F1B, 1});
  CHECK(toString(ScheduleChoice{ScheduleKind::kInterleaved1F1B, 4}) == "interleaved:4");
  CHECK(toString(ScheduleChoice{ScheduleKind::kInterleaved1F1B, 2}) == "interleaved");
  CHECK_THROWS_WITH(parseScheduleChoice("interleaved:1"), Catch::Contains("use --schedule 1f1b"));
  CHECK_THROWS_WITH(parseScheduleChoice("interleaved:x"), Catch::Contains("must be an integer"));
  CHECK_THROWS_WITH(parseScheduleChoice("zbv:3"), Catch::Contains("only interleaved takes"));
  CHECK_THROWS_WITH(parseScheduleChoice("1f1b:2"), Catch::Contains("only interleaved takes"));
  CHECK_THROWS_WITH(generateSchedule(ScheduleKind::kInterleaved1F1B, 2, 3), Catch::Contains("multiple of the 2"));
}

TEST_CASE("interleaved 1F1B: golden order, every dependency met, bubble (P-1)(F+B)/v", "[schedule]") {
  const auto two = generateSchedule(ScheduleKind::kInterleaved1F1B, 2, 4, 2);
  CHECK(describe(two[0]) == "f0.0 f1.0 f0.1 f1.1 f2.0 b0.1 f3.0 b1.1 f2.1 b0.0 f3.1 b1.0 b2.1 b3.1 b2.0 b3.0");
  CHECK(describe(two[1]) == "f0.0 f1.0 f0.1 b0.1 f1.1 b1.1 f2.0 b0.0 f3.0 b1.0 f2.1 b2.1 f3.1 b3.1 b2.0 b3.0");
  for (int v : {2, 3, 4}) {
    for (int P : {1, 2, 3, 4, 8}) {
      for (int groups : {1, 2, 4}) {
        const int m = P * groups;
        INFO("v=" << v << " P=" << P << " m=" << m);
        const auto layout = ChunkLayout::of(ScheduleKind::kInterleaved1F1B, P, v);
        const auto schedule = generateSchedule(ScheduleKind::kInterleaved1F1B, P, m, v);
        checkEveryChunkRunsOnce(schedule, v, m, /*split=*/false);
        const auto timing = replaySchedule(schedule, chunkCosts(P, v), layout);
        CHECK(timing.makespan == Approx(3.0 * m + 3.0 * (P - 1) / v));  // 1F1B: 3m + 3(P-1)
      }
    }
  }
}

TEST_CASE("zbv: B before W, every dependency met, 1F1B's memory, a bubble below 1F1B's", "[schedule]") {
  const auto two = generateSchedule(ScheduleKind::kZeroBubbleV, 2, 4);
  CHECK(describe(two[0]) ==
        "f0.0 f1.0 f0.1 B0.1 f1.1 B1.1 W0.1 f2.0 B0.0 W1.1 B1.0 f3.0 W0.0 W1.0 f2.1 B2.1 W2.1 f3.1 B3.1 B2.0 W3.1 "
        "W2.0 B3.0 W3.0");
  CHECK(describe(two[1]) ==
        "f0.0 f0.1 f1.0 f1.1 B0.1 B0.0 B1.1 B1.0 W0.1 f2.0 W1.1 f2.1 W0.0 f3.0 W1.0 f3.1 B2.1 B2.0 W2.1 W2.0 B3.1 "
        "B3.0 W3.1 W3.0");
  for (int P : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 5, 8, 13, 16}) {
      INFO("P=" << P << " m=" << m);
      const auto layout = ChunkLayout::of(ScheduleKind::kZeroBubbleV, P, 2);
      const auto schedule = generateSchedule(ScheduleKind::kZeroBubbleV, P, m);
      checkEveryChunkRunsOnce(schedule, 2, m, /*split=*/true);
      for (const auto& stage : schedule) {  // chunk micro-batches held: at most 1F1B's 2P half-stages
        int held = 0, peak = 0;
        for (const Task& t : stage) {
          held += t.type == TaskType::kForward ? 1 : t.type == TaskType::kBackwardWeight ? -1 : 0;
          peak = std::max(peak, held);
        }
        CHECK(peak <= 2 * P);
      }
      const auto timing = replaySchedule(schedule, chunkCosts(P, 2), layout);
      if (m >= 2 * P && P > 1) CHECK(timing.makespan - 3.0 * m <= 3.0 * (P - 1) * 0.5 + 0.5);  // 1F1B: 3(P-1)
    }
  }
  // P = 2, m = 8 (the benchmark's shape): busy 24 of 24.5 (0.98).
  const auto timing = replaySchedule(generateSchedule(ScheduleKind::kZeroBubbleV, 2, 8), chunkCosts(2, 2),
                                     ChunkLayout::of(ScheduleKind::kZeroBubbleV, 2, 2));
  CHECK(timing.busy[0] / timing.makespan == Approx(24.0 / 24.5));
}

TEST_CASE("zbv at P = 2 keeps a rank busy while a message travels", "[schedule]") {
  // The generator's second candidate (schedule_chunked.cpp): with free
  // messages as short as the first, with each message 5 % of a chunk's task
  // shorter (24.6 against the first candidate's 24.75 here, where a chunk's
  // task takes 0.5).
  const auto layout = ChunkLayout::of(ScheduleKind::kZeroBubbleV, 2, 2);
  ReplayCosts costs;
  costs.taskSeconds = [](int, const Task& t) { return t.type == TaskType::kBackward ? 1.0 : 0.5; };
  costs.transferSeconds = [](int, int, int) { return 0.025; };
  CHECK(replaySchedule(generateSchedule(ScheduleKind::kZeroBubbleV, 2, 8), costs, layout).makespan ==
        Approx(24.6));
}

TEST_CASE("the replay of a chunked schedule refuses a chunk outside its layout and one that waits on itself",
          "[schedule]") {
  const Schedule outside{{{TaskType::kForward, 0, true, 2}, {TaskType::kBackward, 0, true, 2}}};
  CHECK_THROWS_WITH(replaySchedule(outside, uniformCosts(1), ChunkLayout{1, 2, false}), Catch::Contains("chunk 2"));
  // Chunk 1's forward before chunk 0's on the only rank: it waits for itself.
  const Schedule selfWait{{{TaskType::kForward, 0, true, 1}, {TaskType::kForward, 0, true, 0},
                           {TaskType::kBackward, 0, true, 1}, {TaskType::kBackward, 0, true, 0}}};
  CHECK_THROWS_WITH(replaySchedule(selfWait, uniformCosts(1), ChunkLayout{1, 2, false}), Catch::Contains("deadlocks"));
}
