#include "pipeline/step_traffic.h"

#include <chrono>

#include "varuna/common/errors.h"

namespace varuna {

StepTraffic::StepTraffic(Setup setup) : s_(std::move(setup)) {
  const auto m = s_.microbatchSizes.size();
  activations_.assign(s_.layout.chunks, std::vector<Slot>(m));
  gradients_.assign(s_.layout.chunks, std::vector<Slot>(m));
}

void StepTraffic::issue(const std::vector<P2pOp>& ops, const torch::Tensor& produced) {
  for (const P2pOp& op : ops) {
    if (op.send) {
      start(op, produced);
    } else {
      post(op);
    }
  }
}

void StepTraffic::post(const P2pOp& op) {
  const StepMessage& msg = op.message;
  const bool activation = msg.kind == MessageKind::kActivation;
  // An activation over cut k arrives at virtual stage k+1; a gradient at k.
  const int chunk = s_.layout.chunkOf(activation ? msg.cut + 1 : msg.cut);
  const CutShape& shape = activation ? (*s_.inShape)[chunk] : (*s_.outShape)[chunk];
  Slot& slot = (activation ? activations_ : gradients_)[chunk][msg.microbatch];
  slot.tensor = torch::empty(shape.withBatch(s_.microbatchSizes[msg.microbatch]),
                             torch::TensorOptions().dtype(shape.dtype).device(s_.device));
  const TagKind tag = activation ? s_.activationTag : kGradientTag;
  slot.work = s_.comm->recv(slot.tensor, s_.rankOf(msg.fromStage), tagFor(tag, msg.cut, msg.microbatch));
}

void StepTraffic::start(const P2pOp& op, const torch::Tensor& produced) {
  const StepMessage& msg = op.message;
  VARUNA_CHECK(produced.defined(), "the plan sends over cut ", msg.cut, " after a task that produced nothing");
  auto payload = produced.contiguous();
  const TagKind tag = msg.kind == MessageKind::kActivation ? s_.activationTag : kGradientTag;
  sends_.emplace_back(s_.comm->send(payload, s_.rankOf(msg.toStage), tagFor(tag, msg.cut, msg.microbatch)), payload);
}

torch::Tensor StepTraffic::take(Slot& slot, const char* during) {
  if (slot.work) {
    const auto start = std::chrono::steady_clock::now();
    s_.comm->waitFor(slot.work, during);
    waited_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    slot.work.reset();
  }
  VARUNA_CHECK(slot.tensor.defined(), "a task's input was neither received nor handed over (", during, ")");
  return std::exchange(slot.tensor, torch::Tensor());
}

torch::Tensor StepTraffic::takeActivation(int chunk, int microbatch) {
  return take(activations_[chunk][microbatch], "receiving an activation");
}

torch::Tensor StepTraffic::takeGradient(int chunk, int microbatch) {
  return take(gradients_[chunk][microbatch], "receiving a gradient");
}

void StepTraffic::handActivation(int toChunk, int microbatch, torch::Tensor t) {
  activations_[toChunk][microbatch].tensor = std::move(t);
}

void StepTraffic::handGradient(int toChunk, int microbatch, torch::Tensor t) {
  gradients_[toChunk][microbatch].tensor = std::move(t);
}

void StepTraffic::finishSends() {
  const auto start = std::chrono::steady_clock::now();
  for (auto& [work, tensor] : sends_) s_.comm->waitFor(work, "sending to a neighbour stage");
  sends_.clear();
  waited_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace varuna
