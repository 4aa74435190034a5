// The point-to-point messages of one training step, and the order in which
// each stage issues its sends and receives.
//
// Why an order at all: NCCL matches point-to-point messages by order, not by
// tag, and runs every operation between two ranks on one stream, one after the
// other. A stage that posted all its receives first and its sends later (what
// a tag-matching transport like Gloo allows) would leave each of two
// neighbours waiting, on that stream, for a message queued behind its own
// receive. So both ends of every pair of stages agree on one total order of
// the messages between them, in both directions, and issue their operations in
// that order: the k-th operation of one side meets the k-th of the other.
//
// The agreed order: the messages sorted by the time their sender finishes
// producing them in a replay of the schedule (equal costs), ties broken by
// sender and message. A stage issues a receive as early as the order allows
// (at the start of the step, or right after the send before it), so that in
// the replay every receive is posted no later than its send, and each of its
// own sends as soon as the task producing it ends. The CPU tests run the same
// plan on Gloo matching by order (VARUNA_P2P_MATCH_BY_ORDER), so CI executes
// the very order a multi-GPU job issues; Gloo's own matching by tag on the
// CPU posts every receive first instead (receivesFirst below: faster there).
//
// Pure functions over a Schedule and its ChunkLayout; every stage computes the
// same plan, so no message about the plan is ever needed.
#pragma once

#include <string>
#include <vector>

#include "varuna/common/schedule.h"

namespace varuna {

enum class MessageKind { kActivation, kGradient };

// An activation crosses cut c from virtual stage c to c+1; a gradient
// crosses it back. Messages between two chunks of one stage (zbv's turn) are
// hand-offs in memory, not messages.
struct StepMessage {
  MessageKind kind = MessageKind::kActivation;
  int cut = 0;
  int microbatch = 0;
  int fromStage = 0, toStage = 0;
  bool operator==(const StepMessage&) const = default;
};

struct P2pOp {
  bool send = false;  // else a receive
  StepMessage message;
  int peer() const { return send ? message.toStage : message.fromStage; }
  bool operator==(const P2pOp&) const = default;
};

// One stage's operations, by the task they go with: beforeTask[k] is issued
// before task k waits for its inputs, afterTask[k] once task k is done (its
// send first, then the receives the order lets it post next).
struct StageMessagePlan {
  std::vector<std::vector<P2pOp>> beforeTask, afterTask;
};

// The plan of every stage. Throws std::logic_error where the schedule leaves
// no order both ends can follow (a schedule generator's bug; the replay's
// own checks come first). A schedule of forwards only (evaluationOrder) has
// activations only.
std::vector<StageMessagePlan> planStepMessages(const Schedule& schedule, const ChunkLayout& layout);

// The same operations for a transport that matches messages by tag (Gloo
// on the CPU): every receive posted before the first task, in the plan's
// order, and the sends where the plan has them. Why: Gloo sends a message
// only once its receive is posted; a receive posted later costs, in the
// middle of the step, a round trip through both ranks' Gloo threads and a
// lock those threads hold while they read, which a busy CPU host may not
// schedule for milliseconds (measured with scripts/pipeline_trace.py:
// docs/benchmarks.md). Posted up front, a send goes out from the sending
// task's thread at once. What it costs: a step's receive buffers are all
// allocated at its start (each a cut's tensor for one micro-batch). Never
// for NCCL, which matches by order.
StageMessagePlan receivesFirst(StageMessagePlan plan);

// evaluate()'s order: on every stage, its chunks in model order, each over
// every micro-batch (forwards without activations kept). The plan of this
// order, not the order itself, is what makes it safe under NCCL: with two
// chunks per rank, issuing each message where the loop reaches it would
// pair a rank's second send with its neighbour's first.
Schedule evaluationOrder(const ChunkLayout& layout, int microbatches);

// One stage's tasks with its operations in issue order, for golden strings
// and error messages: "<a0.0 [f0] a0.1> ..." is the activation of micro-batch
// 0 over cut 0 received before the forward [f0] and micro-batch 0's over cut
// 1 sent after it; g names a gradient.
std::string describe(const StageSchedule& tasks, const StageMessagePlan& plan);

}  // namespace varuna
