#include "varuna/common/step_messages.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "varuna/common/errors.h"

namespace varuna {
namespace {

constexpr int kNone = -1;

// Where a stage's tasks are: the forward and the input-gradient task (whole
// backward or B) of each chunk x micro-batch.
struct TaskIndex {
  std::vector<std::vector<int>> forward, inputGradient;  // [chunk][microbatch] -> task, or kNone

  TaskIndex(const StageSchedule& tasks, int chunks, int m)
      : forward(chunks, std::vector<int>(m, kNone)), inputGradient(chunks, std::vector<int>(m, kNone)) {
    for (int k = 0; k < static_cast<int>(tasks.size()); ++k) {
      const Task& t = tasks[k];
      if (t.type == TaskType::kForward && forward[t.chunk][t.microbatch] == kNone) forward[t.chunk][t.microbatch] = k;
      if (t.type == TaskType::kBackward || t.type == TaskType::kBackwardInput) {
        inputGradient[t.chunk][t.microbatch] = k;
      }
    }
  }
};

// A message with the tasks that produce and consume it.
struct PlannedMessage {
  StepMessage message;
  int producer = kNone;  // task index on message.fromStage
  int consumer = kNone;  // task index on message.toStage
  double sentAt = 0;     // the producer's end in the replay
};

int microbatchesOf(const Schedule& schedule) {
  int m = 0;
  for (const auto& stage : schedule) {
    for (const Task& t : stage) m = std::max(m, t.microbatch + 1);
  }
  return m;
}

int taskAt(const std::vector<std::vector<int>>& index, int chunk, int microbatch, const char* what,
           const StepMessage& message) {
  const int k = index[chunk][microbatch];
  if (k == kNone) {
    throw std::logic_error(strCat("the schedule has no ", what, " of micro-batch ", microbatch, " on stage ",
                                  what[0] == 'p' ? message.fromStage : message.toStage, " for the message over cut ",
                                  message.cut));
  }
  return k;
}

bool hasBackward(const Schedule& schedule) {
  for (const auto& stage : schedule) {
    for (const Task& t : stage) {
      if (t.type != TaskType::kForward) return true;
    }
  }
  return false;
}

// End times of a forward-only order (evaluation), each forward taking 1: the
// replay's rules without its checks that every forward meets its backward.
std::vector<std::vector<double>> forwardOnlyEnds(const Schedule& schedule, const ChunkLayout& layout, int m) {
  const int P = static_cast<int>(schedule.size());
  std::vector<std::vector<double>> fEnd(layout.virtualStages(), std::vector<double>(m, -1.0));
  std::vector<std::vector<double>> ends(P);
  std::vector<double> freeAt(P, 0.0);
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int s = 0; s < P; ++s) {
      while (ends[s].size() < schedule[s].size()) {
        const Task& t = schedule[s][ends[s].size()];
        const int vs = layout.virtualStage(s, t.chunk);
        const double arrival = vs == 0 ? 0.0 : fEnd[vs - 1][t.microbatch];
        if (arrival < 0) break;
        freeAt[s] = std::max(freeAt[s], arrival) + 1.0;
        fEnd[vs][t.microbatch] = freeAt[s];
        ends[s].push_back(freeAt[s]);
        progressed = true;
      }
    }
  }
  for (int s = 0; s < P; ++s) {
    if (ends[s].size() != schedule[s].size()) throw std::logic_error("the forward-only order deadlocks");
  }
  return ends;
}

// Every message of the step, in the agreed order (see the header). A
// schedule of forwards only (evaluation) has no gradients.
std::vector<PlannedMessage> orderedMessages(const Schedule& schedule, const ChunkLayout& layout) {
  const int P = static_cast<int>(schedule.size());
  const int m = microbatchesOf(schedule);
  std::vector<TaskIndex> index;
  for (const auto& tasks : schedule) index.emplace_back(tasks, layout.chunks, m);
  const bool gradients = hasBackward(schedule);
  const auto ends = gradients ? replaySchedule(schedule, std::vector<TaskCosts>(P), layout).end
                              : forwardOnlyEnds(schedule, layout, m);

  std::vector<PlannedMessage> messages;
  for (int cut = 0; cut + 1 < layout.virtualStages(); ++cut) {
    const int lower = layout.stageOf(cut), upper = layout.stageOf(cut + 1);
    if (lower == upper) continue;  // a hand-off between two chunks of one stage
    const int lowerChunk = layout.chunkOf(cut), upperChunk = layout.chunkOf(cut + 1);
    for (int i = 0; i < m; ++i) {
      PlannedMessage activation{{MessageKind::kActivation, cut, i, lower, upper}};
      activation.producer = taskAt(index[lower].forward, lowerChunk, i, "producing forward", activation.message);
      activation.consumer = taskAt(index[upper].forward, upperChunk, i, "consuming forward", activation.message);
      activation.sentAt = ends[lower][activation.producer];
      messages.push_back(activation);
      if (!gradients) continue;
      PlannedMessage gradient{{MessageKind::kGradient, cut, i, upper, lower}};
      gradient.producer = taskAt(index[upper].inputGradient, upperChunk, i, "producing backward", gradient.message);
      gradient.consumer = taskAt(index[lower].inputGradient, lowerChunk, i, "consuming backward", gradient.message);
      gradient.sentAt = ends[upper][gradient.producer];
      messages.push_back(gradient);
    }
  }
  // A task sends at most one message, so (sender, producing task) is unique.
  std::sort(messages.begin(), messages.end(), [](const PlannedMessage& a, const PlannedMessage& b) {
    return std::tie(a.sentAt, a.message.fromStage, a.producer) < std::tie(b.sentAt, b.message.fromStage, b.producer);
  });
  return messages;
}

// Issues one stage's operations pair by pair, in the agreed order.
class StagePlanner {
 public:
  StagePlanner(int stage, const std::vector<PlannedMessage>& messages, int tasks) : stage_(stage) {
    plan_.beforeTask.resize(tasks);
    plan_.afterTask.resize(tasks);
    for (int id = 0; id < static_cast<int>(messages.size()); ++id) {
      const StepMessage& msg = messages[id].message;
      if (msg.fromStage != stage && msg.toStage != stage) continue;
      const int peer = msg.fromStage == stage ? msg.toStage : msg.fromStage;
      auto& pair = pairs_[peer];
      position_[id] = static_cast<int>(pair.order.size());
      pair.order.push_back(msg);
    }
  }

  // Receives at the head of each pair's order, posted before the first task.
  void start() {
    for (auto& [peer, pair] : pairs_) postReceivesAhead(pair, plan_.beforeTask[0]);
  }
  // Before task k: everything up to the message it consumes.
  void consume(int k, int id, int peer) { issueThrough(pairs_.at(peer), position_.at(id), plan_.beforeTask[k]); }
  // After task k: its send (and what comes before it).
  void produce(int k, int id, int peer) {
    Pair& pair = pairs_.at(peer);
    const int at = position_.at(id);
    if (at < pair.next) throw std::logic_error("a send issued before the task that produces it");
    pair.produced = at;
    issueThrough(pair, at, plan_.afterTask[k]);
  }
  StageMessagePlan take() {
    for (const auto& [peer, pair] : pairs_) {
      if (pair.next != static_cast<int>(pair.order.size())) {
        throw std::logic_error(strCat("stage ", stage_, " leaves messages with stage ", peer, " unissued"));
      }
    }
    return std::move(plan_);
  }

 private:
  struct Pair {
    std::vector<StepMessage> order;
    int next = 0;          // the first operation not yet issued
    int produced = kNone;  // the latest position whose send this stage has produced
  };

  void issueThrough(Pair& pair, int last, std::vector<P2pOp>& out) {
    while (pair.next <= last) {
      const StepMessage& msg = pair.order[pair.next];
      const bool send = msg.fromStage == stage_;
      if (send && pair.next > pair.produced) {
        throw std::logic_error(strCat("stage ", stage_, " must receive a message over cut ", msg.cut,
                                      " that the agreed order puts after a send it has not produced yet"));
      }
      out.push_back({send, msg});
      ++pair.next;
    }
    postReceivesAhead(pair, out);
  }
  void postReceivesAhead(Pair& pair, std::vector<P2pOp>& out) {
    while (pair.next < static_cast<int>(pair.order.size()) && pair.order[pair.next].toStage == stage_) {
      out.push_back({false, pair.order[pair.next]});
      ++pair.next;
    }
  }

  int stage_;
  StageMessagePlan plan_;
  std::map<int, Pair> pairs_;     // by peer stage
  std::map<int, int> position_;   // message id -> position in its pair's order
};

}  // namespace

std::vector<StageMessagePlan> planStepMessages(const Schedule& schedule, const ChunkLayout& layout) {
  if (layout.stages != static_cast<int>(schedule.size())) {
    throw std::logic_error("the chunk layout is of another number of stages");
  }
  const auto messages = orderedMessages(schedule, layout);
  std::vector<StageMessagePlan> plans;
  for (int s = 0; s < layout.stages; ++s) {
    const int tasks = static_cast<int>(schedule[s].size());
    StagePlanner planner(s, messages, tasks);
    if (tasks > 0) planner.start();
    // Per task, the message it consumes and the one it produces (at most one each).
    std::vector<int> consumes(tasks, kNone), produces(tasks, kNone);
    for (int id = 0; id < static_cast<int>(messages.size()); ++id) {
      if (messages[id].message.toStage == s) consumes[messages[id].consumer] = id;
      if (messages[id].message.fromStage == s) produces[messages[id].producer] = id;
    }
    for (int k = 0; k < tasks; ++k) {
      if (consumes[k] != kNone) planner.consume(k, consumes[k], messages[consumes[k]].message.fromStage);
      if (produces[k] != kNone) planner.produce(k, produces[k], messages[produces[k]].message.toStage);
    }
    plans.push_back(planner.take());
  }
  return plans;
}

StageMessagePlan receivesFirst(StageMessagePlan plan) {
  std::vector<P2pOp> receives;
  auto takeReceives = [&receives](std::vector<P2pOp>& ops) {
    std::erase_if(ops, [&receives](const P2pOp& op) {
      if (!op.send) receives.push_back(op);
      return !op.send;
    });
  };
  // In issue order: before task k, then after it.
  for (size_t k = 0; k < plan.beforeTask.size(); ++k) {
    takeReceives(plan.beforeTask[k]);
    takeReceives(plan.afterTask[k]);
  }
  if (!plan.beforeTask.empty()) plan.beforeTask[0].insert(plan.beforeTask[0].begin(), receives.begin(), receives.end());
  return plan;
}

Schedule evaluationOrder(const ChunkLayout& layout, int microbatches) {
  Schedule schedule(layout.stages);
  for (int s = 0; s < layout.stages; ++s) {
    // Chunk by chunk (a rank's chunks are in model order), every micro-batch.
    for (int c = 0; c < layout.chunks; ++c) {
      for (int i = 0; i < microbatches; ++i) schedule[s].push_back(Task{TaskType::kForward, i, false, c});
    }
  }
  return schedule;
}

std::string describe(const StageSchedule& tasks, const StageMessagePlan& plan) {
  std::istringstream names(describe(tasks));
  std::ostringstream out;
  auto op = [&out](const P2pOp& o) {
    const char kind = o.message.kind == MessageKind::kActivation ? 'a' : 'g';
    out << (o.send ? "" : "<") << kind << o.message.microbatch << '.' << o.message.cut << (o.send ? ">" : "") << ' ';
  };
  for (size_t k = 0; k < tasks.size(); ++k) {
    std::string name;
    names >> name;
    for (const auto& o : plan.beforeTask[k]) op(o);
    out << '[' << name << "] ";
    for (const auto& o : plan.afterTask[k]) op(o);
  }
  std::string text = out.str();
  if (!text.empty()) text.pop_back();
  return text;
}

}  // namespace varuna
