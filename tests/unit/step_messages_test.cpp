// The step's message plan (common/step_messages.h), checked against a model
// of NCCL's point-to-point semantics: between two ranks, operations run one
// after the other in the order each side issued them, and the head of one
// side only completes with the complementary head of the other (a send with
// the receive of the same message). A plan that deadlocks or pairs two
// different messages under that model fails here, on every schedule kind.
#include <catch2/catch.hpp>

#include <deque>
#include <map>
#include <set>
#include <tuple>

#include "varuna/common/errors.h"
#include "varuna/common/schedule.h"
#include "varuna/common/step_messages.h"

using namespace varuna;

namespace {

using MessageKey = std::tuple<int, int, int>;  // kind, cut, micro-batch
MessageKey keyOf(const StepMessage& m) { return {static_cast<int>(m.kind), m.cut, m.microbatch}; }

// What task k of `stage` needs from another stage, derived from the layout on
// its own (not from the plan under test).
std::vector<MessageKey> needs(const Task& t, int stage, const ChunkLayout& layout) {
  const int vs = layout.virtualStage(stage, t.chunk);
  std::vector<MessageKey> out;
  if (t.type == TaskType::kForward && vs > 0 && layout.stageOf(vs - 1) != stage) {
    out.emplace_back(static_cast<int>(MessageKind::kActivation), vs - 1, t.microbatch);
  }
  const bool inputGradient = t.type == TaskType::kBackward || t.type == TaskType::kBackwardInput;
  if (inputGradient && vs + 1 < layout.virtualStages() && layout.stageOf(vs + 1) != stage) {
    out.emplace_back(static_cast<int>(MessageKind::kGradient), vs, t.microbatch);
  }
  return out;
}

// Runs every stage's tasks with the plan's operations under in-order
// matching; returns "" or what went wrong.
std::string runInOrder(const Schedule& schedule, const ChunkLayout& layout, const std::vector<StageMessagePlan>& plans) {
  const int P = layout.stages;
  std::map<std::pair<int, int>, std::deque<P2pOp>> queue;  // (stage, peer) -> issued, not yet matched
  std::vector<std::set<MessageKey>> received(P), posted(P);
  std::vector<size_t> next(P, 0);
  std::vector<bool> issuedBefore(P, false);
  auto issue = [&](int s, const std::vector<P2pOp>& ops) {
    for (const P2pOp& op : ops) {
      queue[{s, op.peer()}].push_back(op);
      if (!op.send) posted[s].insert(keyOf(op.message));
    }
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {  // hosts: issue, wait, run, issue
      while (next[s] < schedule[s].size()) {
        const size_t k = next[s];
        if (!issuedBefore[s]) {
          issue(s, plans[s].beforeTask[k]);
          issuedBefore[s] = true;
        }
        bool ready = true;
        for (const auto& key : needs(schedule[s][k], s, layout)) {
          if (!posted[s].count(key)) {
            return strCat("stage ", s, " task ", k, " needs a message it never posted a receive for");
          }
          ready = ready && received[s].count(key);
        }
        if (!ready) break;
        issue(s, plans[s].afterTask[k]);
        ++next[s];
        issuedBefore[s] = false;
        progress = true;
      }
    }
    for (int a = 0; a < P; ++a) {  // the streams: complementary heads complete together
      for (int b = a + 1; b < P; ++b) {
        auto& qa = queue[{a, b}];
        auto& qb = queue[{b, a}];
        while (!qa.empty() && !qb.empty() && qa.front().send != qb.front().send) {
          if (!(qa.front().message == qb.front().message)) {
            return strCat("stages ", a, " and ", b, " pair two different messages (cuts ", qa.front().message.cut,
                          " and ", qb.front().message.cut, ")");
          }
          const int receiver = qa.front().send ? b : a;
          received[receiver].insert(keyOf(qa.front().message));
          qa.pop_front();
          qb.pop_front();
          progress = true;
        }
      }
    }
  }
  for (int s = 0; s < P; ++s) {
    if (next[s] != schedule[s].size()) return strCat("deadlock: stage ", s, " stuck at task ", next[s]);
  }
  for (const auto& [pair, q] : queue) {
    if (!q.empty()) return strCat("stage ", pair.first, " has operations towards ", pair.second, " never matched");
  }
  return "";
}

// Every message of a stage appears once in its plan, as a send or a receive.
void checkEachMessageOnce(const std::vector<StageMessagePlan>& plans, const ChunkLayout& layout, int m) {
  std::map<std::tuple<int, bool, MessageKey>, int> seen;
  for (int s = 0; s < layout.stages; ++s) {
    for (const auto* list : {&plans[s].beforeTask, &plans[s].afterTask}) {
      for (const auto& ops : *list) {
        for (const auto& op : ops) ++seen[{s, op.send, keyOf(op.message)}];
      }
    }
  }
  int crossing = 0;
  for (int cut = 0; cut + 1 < layout.virtualStages(); ++cut) crossing += layout.stageOf(cut) != layout.stageOf(cut + 1);
  // Each crossing cut: m activations and m gradients, each sent once and received once.
  CHECK(seen.size() == static_cast<size_t>(crossing * m * 4));
  for (const auto& [key, count] : seen) CHECK(count == 1);
}

}  // namespace

TEST_CASE("step messages: golden orders for 1F1B on two stages", "[step_messages]") {
  const auto schedule = generateSchedule(ScheduleKind::k1F1B, 2, 3);
  const auto layout = ChunkLayout::of(ScheduleKind::k1F1B, 2, 1);
  const auto plans = planStepMessages(schedule, layout);
  // Stage 0 never posts a gradient receive before the send it answers; stage
  // 1 posts the next activation's receive right after each gradient it sends
  // (never all at once: on NCCL its gradient sends would queue behind them).
  CHECK(describe(schedule[0], plans[0]) == "[f0] a0.0> [f1] a1.0> <g0.0 [b0] [f2] a2.0> <g1.0 <g2.0 [b1] [b2]");
  CHECK(describe(schedule[1], plans[1]) == "<a0.0 <a1.0 [f0] [b0] g0.0> <a2.0 [f1] [b1] g1.0> [f2] [b2] g2.0>");
}

TEST_CASE("step messages: zbv's turn on one rank needs no message", "[step_messages]") {
  const auto schedule = generateSchedule(ScheduleKind::kZeroBubbleV, 2, 2);
  const auto layout = ChunkLayout::of(ScheduleKind::kZeroBubbleV, 2, 2);
  const auto plans = planStepMessages(schedule, layout);
  for (int s = 0; s < 2; ++s) {
    for (const auto* list : {&plans[s].beforeTask, &plans[s].afterTask}) {
      for (const auto& ops : *list) {
        for (const auto& op : ops) CHECK(op.message.cut != 1);  // virtual stages 1 and 2 are both on rank 1
      }
    }
  }
  CHECK(runInOrder(schedule, layout, plans).empty());
}

TEST_CASE("step messages: every schedule completes under in-order matching", "[step_messages]") {
  struct Kind {
    ScheduleKind kind;
    int chunks;
  };
  const std::vector<Kind> kinds{{ScheduleKind::kVaruna, 1},          {ScheduleKind::k1F1B, 1},
                                {ScheduleKind::kGPipe, 1},           {ScheduleKind::kZeroBubbleH1, 1},
                                {ScheduleKind::kInterleaved1F1B, 2}, {ScheduleKind::kInterleaved1F1B, 3},
                                {ScheduleKind::kZeroBubbleV, 2}};
  for (const auto& k : kinds) {
    for (int P : {1, 2, 3, 4, 5, 8}) {
      for (int m = 1; m <= 16; ++m) {
        if (k.kind == ScheduleKind::kInterleaved1F1B && m % P != 0) continue;
        const auto schedule = generateSchedule(k.kind, P, m, k.chunks);
        const auto layout = ChunkLayout::of(k.kind, P, k.chunks);
        INFO(toString(ScheduleChoice{k.kind, k.chunks}) << " P=" << P << " m=" << m);
        const auto plans = planStepMessages(schedule, layout);
        REQUIRE(plans.size() == static_cast<size_t>(P));
        checkEachMessageOnce(plans, layout, m);
        CHECK(runInOrder(schedule, layout, plans) == "");
      }
    }
  }
}

TEST_CASE("step messages: the in-order model catches the order of posting every receive first", "[step_messages]") {
  // What the runtime did before the plan: all activation receives up front,
  // each gradient receive right after the forward's send. Under in-order
  // matching this deadlocks at the second micro-batch (the model check is
  // not vacuous).
  const auto schedule = generateSchedule(ScheduleKind::k1F1B, 2, 4);
  const auto layout = ChunkLayout::of(ScheduleKind::k1F1B, 2, 1);
  std::vector<StageMessagePlan> upFront(2);
  for (int s = 0; s < 2; ++s) {
    upFront[s].beforeTask.resize(schedule[s].size());
    upFront[s].afterTask.resize(schedule[s].size());
  }
  for (int i = 0; i < 4; ++i) {
    upFront[1].beforeTask[0].push_back({false, {MessageKind::kActivation, 0, i, 0, 1}});
  }
  for (int s = 0; s < 2; ++s) {
    for (size_t k = 0; k < schedule[s].size(); ++k) {
      const Task& t = schedule[s][k];
      if (s == 0 && t.type == TaskType::kForward) {
        upFront[0].afterTask[k].push_back({true, {MessageKind::kActivation, 0, t.microbatch, 0, 1}});
        upFront[0].afterTask[k].push_back({false, {MessageKind::kGradient, 0, t.microbatch, 1, 0}});
      }
      if (s == 1 && t.type == TaskType::kBackward) {
        upFront[1].afterTask[k].push_back({true, {MessageKind::kGradient, 0, t.microbatch, 1, 0}});
      }
    }
  }
  CHECK_THAT(runInOrder(schedule, layout, upFront), Catch::Matchers::StartsWith("deadlock"));
}

TEST_CASE("step messages: a layout of another size is refused", "[step_messages]") {
  const auto schedule = generateSchedule(ScheduleKind::k1F1B, 2, 2);
  CHECK_THROWS_AS(planStepMessages(schedule, ChunkLayout::of(ScheduleKind::k1F1B, 3, 1)), std::logic_error);
}

TEST_CASE("step messages: evaluation's order completes under in-order matching, activations only", "[step_messages]") {
  for (const auto& [kind, chunks] : std::vector<std::pair<ScheduleKind, int>>{
           {ScheduleKind::k1F1B, 1}, {ScheduleKind::kInterleaved1F1B, 2}, {ScheduleKind::kInterleaved1F1B, 3},
           {ScheduleKind::kZeroBubbleV, 2}}) {
    for (int P : {1, 2, 3, 4}) {
      for (int m : {1, 2, 3, 5, 8}) {
        const auto layout = ChunkLayout::of(kind, P, chunks);
        const auto schedule = evaluationOrder(layout, m);
        INFO(toString(ScheduleChoice{kind, chunks}) << " P=" << P << " m=" << m);
        const auto plans = planStepMessages(schedule, layout);
        for (const auto& plan : plans) {
          for (const auto* list : {&plan.beforeTask, &plan.afterTask}) {
            for (const auto& ops : *list) {
              for (const auto& op : ops) CHECK(op.message.kind == MessageKind::kActivation);
            }
          }
        }
        CHECK(runInOrder(schedule, layout, plans) == "");
      }
    }
  }
  // Interleaved on two ranks: rank 0 posts each receive from rank 1 between
  // its own sends, where the neighbour's send falls in time, not after all
  // of its first chunk's sends (which would pair its second send with rank
  // 1's first).
  const auto layout = ChunkLayout::of(ScheduleKind::kInterleaved1F1B, 2, 2);
  const auto schedule = evaluationOrder(layout, 2);
  const auto plans = planStepMessages(schedule, layout);
  CHECK(describe(schedule[0], plans[0]) == "[f0.0] a0.0> [f1.0] a1.0> <a0.1 [f0.1] a0.2> <a1.1 [f1.1] a1.2>");
}

TEST_CASE("step messages: receives first (tag matching) posts every receive before the first task", "[step_messages]") {
  // 1F1B on two stages (the golden orders above): stage 1's receives all
  // move to the start, in the plan's order; the sends stay after the tasks
  // that produce them.
  const auto schedule = generateSchedule(ScheduleKind::k1F1B, 2, 3);
  const auto layout = ChunkLayout::of(ScheduleKind::k1F1B, 2, 1);
  const auto plans = planStepMessages(schedule, layout);
  CHECK(describe(schedule[1], receivesFirst(plans[1])) == "<a0.0 <a1.0 <a2.0 [f0] [b0] g0.0> [f1] [b1] g1.0> [f2] [b2] g2.0>");
  CHECK(describe(schedule[0], receivesFirst(plans[0])) == "<g0.0 <g1.0 <g2.0 [f0] a0.0> [f1] a1.0> [b0] [f2] a2.0> [b1] [b2]");
  // Every schedule: the same operations, each once; the sends where they were.
  for (const auto& [kind, chunks] : std::vector<std::pair<ScheduleKind, int>>{
           {ScheduleKind::kVaruna, 1}, {ScheduleKind::kZeroBubbleH1, 1}, {ScheduleKind::kInterleaved1F1B, 2},
           {ScheduleKind::kZeroBubbleV, 2}}) {
    for (int P : {2, 3, 4}) {
      const int m = 2 * P;
      const auto s = generateSchedule(kind, P, m, chunks);
      const auto l = ChunkLayout::of(kind, P, chunks);
      const auto original = planStepMessages(s, l);
      std::vector<StageMessagePlan> hoisted;
      for (const auto& plan : original) hoisted.push_back(receivesFirst(plan));
      INFO(toString(ScheduleChoice{kind, chunks}) << " P=" << P);
      checkEachMessageOnce(hoisted, l, m);
      for (int stage = 0; stage < P; ++stage) {
        for (size_t k = 0; k < s[stage].size(); ++k) {
          auto sends = [](const std::vector<P2pOp>& ops) {
            std::vector<P2pOp> out;
            std::copy_if(ops.begin(), ops.end(), std::back_inserter(out), [](const P2pOp& op) { return op.send; });
            return out;
          };
          CHECK(sends(hoisted[stage].afterTask[k]) == sends(original[stage].afterTask[k]));
          CHECK(sends(hoisted[stage].beforeTask[k]) == sends(original[stage].beforeTask[k]));
          for (const auto& op : hoisted[stage].afterTask[k]) CHECK(op.send);
          if (k > 0) {
            for (const auto& op : hoisted[stage].beforeTask[k]) CHECK(op.send);
          }
        }
      }
    }
  }
}
