// The pipeline schedule: the order in which each stage runs the forward,
// recompute and backward passes of the micro-batches of one training step.
//
// Pure functions. The worker runtime executes exactly this order and the
// simulator (AutoConfig) replays exactly this order, so prediction and
// execution never drift apart.
//
// Kinds:
//  - kVaruna: Varuna's own. Ready tasks are served in the priority
//    backward > recompute > forward. A forward whose backward is not the stage's
//    very next task keeps no activations (only its input) and is recomputed just
//    in time, when the next stage starts that micro-batch's backward. The last
//    stage never recomputes. 2 stages, 3 micro-batches:
//      stage 0: f0 f1 f2 r0 b0 r1 b1 r2 b2      stage 1: f0 b0 f1 b1 f2 b2
//  - k1F1B: warm-up forwards, then one forward one backward, no recompute.
//  - kGPipe: all forwards, then all backwards, no recompute.
//  - kZeroBubbleH1 ("zb-h1", Qi et al., ICLR 2024): the backward split in two,
//    an input-gradient task B (what the previous stage waits for) and a
//    weight-gradient task W (what nobody waits for), each W deferred to fill
//    time a stage would otherwise wait. With equal F, B and W the bubble is
//    (P-1)(F+B) - W against 1F1B's (P-1)(F+B+W). Stage s holds at most P-s+1
//    micro-batches between their forward and their W (1F1B: P-s), and a
//    micro-batch keeps what its W needs from B to W (docs/worker-api.md).
//    2 stages, 4 micro-batches:
//      stage 0: f0 f1 f2 B0 W0 B1 f3 W1 B2 W2 B3 W3
//      stage 1: f0 B0 f1 B1 W0 f2 B2 W1 f3 B3 W2 W3
//  - kInterleaved1F1B ("interleaved", Narayanan et al., SC 2021): each rank
//    holds v >= 2 chunks of the model, rank s chunk c being virtual stage
//    c*P + s, so a micro-batch goes round the ranks v times; warm-up
//    forwards, then one forward one backward. The bubble shrinks by v:
//    (P-1)(F+B)/v, at v times the messages and a little more activation
//    memory on the first ranks ((P-s-1)*2 + (v-1)*P + 1 chunks in flight on
//    rank s against 1F1B's v(P-s)).
//  - kZeroBubbleV ("zbv", Qi et al., 2024): two chunks per rank in a V (rank
//    s holds virtual stages s and 2P-1-s, so the first and the last are on
//    rank 0, and the turn at the bottom needs no message) with the backward
//    split into B and W as in zb-h1. Near-zero bubble when F, B and W cost
//    the same, at 1F1B's activation memory (2P chunks in flight per rank, the
//    same on every rank).
// Chunked kinds' tasks name their chunk (Task::chunk); ChunkLayout says which
// virtual stage a rank's chunk is.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace varuna {

enum class ScheduleKind { kVaruna, k1F1B, kGPipe, kZeroBubbleH1, kInterleaved1F1B, kZeroBubbleV };
// kBackward is the whole backward of a micro-batch; kBackwardInput and
// kBackwardWeight are its two halves (zero-bubble schedules): the gradient of
// the stage's input, sent on at once, and the parameters' gradients, later.
enum class TaskType { kForward, kRecompute, kBackward, kBackwardInput, kBackwardWeight };

// "varuna", "1f1b", "gpipe", "zb-h1", "interleaved", "zbv"
ScheduleKind parseScheduleKind(std::string_view name);
std::string toString(ScheduleKind kind);

// A schedule and its number of chunks per rank, as the command lines and the
// launch contract spell it: "interleaved:3" is interleaved 1F1B with 3 chunks
// per rank; a bare name takes the kind's default (defaultChunks).
struct ScheduleChoice {
  ScheduleKind kind = ScheduleKind::kVaruna;
  int chunks = 1;

  ScheduleChoice() = default;
  ScheduleChoice(ScheduleKind k, int c) : kind(k), chunks(c) {}
  // The kind with its default number of chunks.
  ScheduleChoice(ScheduleKind k);  // NOLINT(google-explicit-constructor): a kind is a choice
  bool operator==(const ScheduleChoice&) const = default;
  auto operator<=>(const ScheduleChoice&) const = default;
};
// Throws ConfigError naming the text and the fix.
ScheduleChoice parseScheduleChoice(std::string_view text);
// The canonical text: the bare name where chunks is the kind's default.
std::string toString(const ScheduleChoice& choice);
// 2 for the chunked kinds, 1 for the others.
int defaultChunks(ScheduleKind kind);
// Throws ConfigError unless `chunks` suits `kind`: 1 for the unchunked kinds,
// 2..8 for interleaved, exactly 2 for zbv.
void checkChunks(ScheduleKind kind, int chunks);
// Whether the kind places more than one chunk on a rank.
bool isChunked(ScheduleKind kind);

// Where each rank's chunks sit in the model: the model is cut into
// stages x chunks virtual stages, run in order 0, 1, ...
struct ChunkLayout {
  int stages = 1;
  int chunks = 1;
  bool vShape = false;  // zbv: rank s holds s and 2P-1-s; otherwise chunk c is c*P + s

  static ChunkLayout of(ScheduleKind kind, int stages, int chunks);
  int virtualStages() const { return stages * chunks; }
  int virtualStage(int stage, int chunk) const;
  int stageOf(int virtualStage) const;
  int chunkOf(int virtualStage) const;
};

struct Task {
  TaskType type;
  int microbatch;
  // Forward only: keep the activations for the backward. False means the
  // forward runs without autograd and a kRecompute task precedes the backward.
  bool keepActivations = true;
  // Which of the rank's chunks runs it (chunked kinds; 0 otherwise).
  int chunk = 0;

  bool operator==(const Task&) const = default;
};

// Per stage, the ordered list of its tasks for one step.
using StageSchedule = std::vector<Task>;
using Schedule = std::vector<StageSchedule>;

// Throws ConfigError for stages < 1, microbatches < 1, chunks that do not
// suit the kind (checkChunks; chunks < 1 means the kind's default), or
// interleaved on a number of micro-batches that is not a multiple of stages.
Schedule generateSchedule(ScheduleKind kind, int stages, int microbatches, int chunks = 0);

// Whether the kind splits the backward into B and W tasks.
bool splitsBackward(ScheduleKind kind);
// Every kind's name, in the order the help texts list them.
const std::vector<std::string>& scheduleNames();

// "f0 f1 r0 b0 ..." (f = forward without kept activations is still "f"; B and
// W are the input- and weight-gradient halves of a split backward). A stage
// with chunks names each task's chunk after a dot: "f0.0 f0.1 b0.1 b0.0".
std::string describe(const StageSchedule& stage);

// Relative costs used to replay a schedule.
struct TaskCosts {
  double forward = 1.0;
  double recompute = 1.0;
  double backward = 2.0;
  // A split backward's halves (they add up to `backward` for the usual
  // equal-cost comparison).
  double backwardInput = 1.0;
  double backwardWeight = 1.0;
  double transfer = 0.0;  // activation/gradient transfer between neighbouring stages
};

struct ScheduleTiming {
  double makespan = 0.0;
  // Per stage, start and end times of its tasks, in schedule order.
  std::vector<std::vector<double>> start, end;
  std::vector<double> busy;  // per stage, total compute time
};

// Replays the static per-stage order with the given costs: each task starts when
// its stage is free and its inputs have arrived (sends never block). Throws
// std::logic_error if the order can deadlock or a dependency is missing, which
// makes it the schedule generator's own consistency check.
// A chunked schedule needs its layout; without one, every task is of chunk 0
// of its stage. Costs are per task, so a chunk's are its own (a fraction of
// the stage's).
ScheduleTiming replaySchedule(const Schedule& schedule, const std::vector<TaskCosts>& stageCosts,
                              const std::optional<ChunkLayout>& layout = std::nullopt);

// The general form the simulator uses: a duration per task (micro-batches may
// differ, e.g. a smaller last one) and a transfer time per message.
struct ReplayCosts {
  // Seconds `stage` spends computing `task`.
  std::function<double(int stage, const Task& task)> taskSeconds;
  // Seconds from the end of the producing task until the neighbour may use its
  // output: micro-batch `microbatch`'s activation from stage s to s+1, or its
  // gradient from s+1 to s. Under a chunked layout these are virtual stages
  // (the cut is theirs), and between two chunks of one rank there is no
  // transfer to ask about. Null: transfers are free.
  std::function<double(int fromStage, int toStage, int microbatch)> transferSeconds;
};
ScheduleTiming replaySchedule(const Schedule& schedule, const ReplayCosts& costs,
                              const std::optional<ChunkLayout>& layout = std::nullopt);

}  // namespace varuna
