// StepTraffic: one step's (or one evaluation's) messages on this rank,
// issued in the order its StageMessagePlan (varuna/common/step_messages.h)
// gives, which is what keeps NCCL, matching by order, from pairing the wrong
// messages or waiting on its own queue. It owns the receive buffers and the
// sends in flight; the step asks it for a task's input and hands it what a
// task produced. Private to the worker library (varuna_step.cpp).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "varuna/common/schedule.h"
#include "varuna/common/step_messages.h"

namespace varuna {

// The shape of what crosses a cut, without the micro-batch dimension.
struct CutShape {
  std::vector<int64_t> trailing;
  at::ScalarType dtype = at::kFloat;
  bool known = false;

  std::vector<int64_t> withBatch(int64_t b) const {
    std::vector<int64_t> sizes{b};
    sizes.insert(sizes.end(), trailing.begin(), trailing.end());
    return sizes;
  }
};

// Message tags: kind, the cut the message crosses (virtual stage c to c+1:
// cut c), and the micro-batch. Each pair of ranks sees each tag once a step.
// NCCL ignores them; Gloo matches by them (and by order where
// VARUNA_P2P_MATCH_BY_ORDER is set: comm.h).
enum TagKind : int { kActivationTag = 1, kGradientTag = 2, kEvalTag = 3, kShapeTag = 4 };
constexpr int kCutBits = 12, kMicrobatchBits = 16;
inline int tagFor(TagKind kind, int cut, int microbatch) {
  return (kind << (kCutBits + kMicrobatchBits)) | (cut << kMicrobatchBits) | microbatch;
}

class StepTraffic {
 public:
  struct Setup {
    Communicator* comm = nullptr;
    ChunkLayout layout;
    int stage = 0;
    std::function<int(int stage)> rankOf;  // this replica's rank of a stage
    const std::vector<CutShape>* inShape = nullptr;   // per chunk
    const std::vector<CutShape>* outShape = nullptr;  // per chunk
    torch::Device device = torch::kCPU;
    std::vector<int64_t> microbatchSizes;
    TagKind activationTag = kActivationTag;  // kEvalTag for evaluate()
  };
  explicit StepTraffic(Setup setup);

  // Posts the receives and starts the send among `ops`; a send's tensor is
  // `produced`, what the task before it made.
  void issue(const std::vector<P2pOp>& ops, const torch::Tensor& produced = {});

  // Chunk c's input for micro-batch i: the received activation (waited for),
  // or what handActivation gave it. Taken: the slot is emptied.
  torch::Tensor takeActivation(int chunk, int microbatch);
  torch::Tensor takeGradient(int chunk, int microbatch);
  // Between two chunks of this rank (zbv's turn, P = 1): no message.
  void handActivation(int toChunk, int microbatch, torch::Tensor t);
  void handGradient(int toChunk, int microbatch, torch::Tensor t);

  // Waits for every send started (their tensors stay alive until then).
  void finishSends();
  // Seconds spent blocked in takeActivation, takeGradient and finishSends.
  double waitedSeconds() const { return waited_; }

 private:
  struct Slot {
    torch::Tensor tensor;
    c10::intrusive_ptr<c10d::Work> work;  // the receive, until waited for
  };
  torch::Tensor take(Slot& slot, const char* during);
  void post(const P2pOp& op);
  void start(const P2pOp& op, const torch::Tensor& produced);

  Setup s_;
  std::vector<std::vector<Slot>> activations_, gradients_;  // [chunk][microbatch]
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, torch::Tensor>> sends_;
  double waited_ = 0;
};

}  // namespace varuna
