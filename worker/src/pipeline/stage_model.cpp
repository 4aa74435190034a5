#include "pipeline/stage_model.h"

#include <ATen/Context.h>
#include <algorithm>
#include <torch/autograd.h>

#include "varuna/common/errors.h"

namespace varuna {
namespace {

std::string shapeString(const torch::Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

// Generator of the device the model runs on (dropout etc. draw from it).
at::Generator generatorFor(torch::Device device) {
  return at::globalContext().defaultGenerator(device);
}

}  // namespace

StageModel::StageModel(const ModelSpec& model, int begin, int end, torch::Device device)
    : StageModel(model, std::vector<PieceRange>{{begin, end}}, device) {}

StageModel::StageModel(const ModelSpec& model, const std::vector<PieceRange>& chunks, torch::Device device)
    : device_(device) {
  chunkStart_.push_back(0);
  for (const PieceRange& chunk : chunks) {
    for (int i = chunk.begin; i < chunk.end; ++i) global_.push_back(i);
    chunkStart_.push_back(static_cast<int>(global_.size()));
  }
  for (int local = 0; local < static_cast<int>(global_.size()); ++local) {
    const int i = global_[local];
    auto piece = buildPiece(model, i);
    piece->to(device);
    const std::string& name = model.pieces[i].name;
    register_module(name, piece);
    for (const auto& p : piece->named_parameters(/*recurse=*/true)) {
      const std::string full = name + "." + p.key();
      params_[full] = p.value();
      localPieceOfParam_[full] = local;
    }
    for (const auto& b : piece->named_buffers(/*recurse=*/true)) {
      const std::string full = name + "." + b.key();
      buffers_[full] = b.value();
      localPieceOfBuffer_[full] = local;
      if (!piece->isPersistentBuffer(b.key())) nonPersistent_.insert(full);
    }
    pieces_.push_back(std::move(piece));
    names_.push_back(name);
  }
}

bool StageModel::ownsPiece(int global) const {
  return std::find(global_.begin(), global_.end(), global) != global_.end();
}

std::vector<torch::Tensor> StageModel::pieceParams(int local) const {
  std::vector<torch::Tensor> out;
  for (const auto& p : pieces_[local]->parameters(/*recurse=*/true)) out.push_back(p);
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> StageModel::piecePersistentBuffers(int local) const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [name, t] : buffers_) {
    if (localPieceOfBuffer_.at(name) == local && !nonPersistent_.count(name)) out.push_back({name, t});
  }
  return out;
}

void StageModel::learnChangingBuffers(const std::function<void()>& forward) {
  std::map<std::string, torch::Tensor> before;
  for (const auto& [name, t] : buffers_) before[name] = t.detach().clone();
  forward();
  changing_.clear();
  torch::NoGradGuard noGrad;
  for (const auto& [name, t] : buffers_) {
    if (!torch::equal(t, before.at(name))) changing_.push_back(name);
    t.variable_data().copy_(before.at(name));
  }
}

std::vector<torch::Tensor> StageModel::copyChangingBuffers() const {
  std::vector<torch::Tensor> copies;
  for (const auto& name : changing_) copies.push_back(buffers_.at(name).detach().clone());
  return copies;
}

void StageModel::restoreChangingBuffers(const std::vector<torch::Tensor>& values) {
  VARUNA_CHECK_EQ(values.size(), changing_.size());
  torch::NoGradGuard noGrad;
  for (size_t i = 0; i < values.size(); ++i) buffers_.at(changing_[i]).variable_data().copy_(values[i]);
}

int StageModel::localPieceOf(const std::string& fullName) const {
  auto it = localPieceOfParam_.find(fullName);
  return it == localPieceOfParam_.end() ? -1 : it->second;
}

void StageModel::checkCut(int local, const torch::Tensor& out, int64_t microbatch, bool isLastPieceOfModel) const {
  const std::string& name = names_[local];
  if (!out.defined()) throw ConfigError(strCat("piece '", name, "' returned an undefined tensor"));
  if (isLastPieceOfModel) {
    if (out.numel() != 1 || !out.is_floating_point()) {
      throw ConfigError(strCat("the last piece '", name, "' must return the scalar loss, got a tensor of shape ",
                               shapeString(out)));
    }
    return;
  }
  if (out.dim() < 1 || out.size(0) != microbatch) {
    throw ConfigError(strCat("piece '", name, "' returned a tensor of shape ", shapeString(out),
                             " at its CutPoint; what crosses a cut must be one tensor of shape (b, ...) "
                             "with b = ", microbatch, ", the micro-batch size"));
  }
  if (!out.is_floating_point()) {
    throw ConfigError(strCat("piece '", name, "' returned a ", out.scalar_type(),
                             " tensor at its CutPoint; activations crossing cuts must be floating point "
                             "(pass integer data such as token ids through the batch inputs instead)"));
  }
}

torch::Tensor StageModel::runPieces(int chunk, MicrobatchState* state, const torch::Tensor& input, const Batch& batch,
                                    int64_t microbatch, bool isLastStage) {
  torch::Tensor current = input;
  const int lastPiece = chunkEnd(chunk) - 1;
  for (int k = chunkBegin(chunk); k <= lastPiece; ++k) {
    torch::Tensor leaf = current;
    if (state && current.defined()) {
      leaf = current.detach().requires_grad_(true);
      state->inputs.push_back(leaf);
    } else if (state) {
      state->inputs.push_back(torch::Tensor());
    }
    current = pieces_[k]->forward(leaf, batch);
    checkCut(k, current, microbatch, isLastStage && k == lastPiece);
    if (state) state->outputs.push_back(current);
  }
  return current;
}

torch::Tensor StageModel::forward(MicrobatchState& state, const torch::Tensor& input, const Batch& batch,
                                  int64_t microbatch, bool keepGraph, bool isLastStage) {
  state.stageInput = input;
  if (keepGraph) {
    state.hasGraph = true;
    return runPieces(state.chunk, &state, input, batch, microbatch, isLastStage);
  }
  {
    auto gen = generatorFor(device_);
    std::lock_guard<std::mutex> lock(gen.mutex());
    state.rngState = gen.get_state();
  }
  state.buffersBefore = copyChangingBuffers();
  torch::NoGradGuard noGrad;
  return runPieces(state.chunk, nullptr, input, batch, microbatch, isLastStage);
}

void StageModel::recompute(MicrobatchState& state, const Batch& batch, int64_t microbatch, bool isLastStage) {
  VARUNA_CHECK(!state.hasGraph && state.rngState.defined(), "recompute without an activation-free forward");
  auto gen = generatorFor(device_);
  torch::Tensor current;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    current = gen.get_state();
    gen.set_state(state.rngState);  // same dropout masks as the original forward
  }
  // The buffers as the original forward saw them, and back to where the
  // forwards since have left them afterwards.
  const auto buffersNow = copyChangingBuffers();
  restoreChangingBuffers(state.buffersBefore);
  runPieces(state.chunk, &state, state.stageInput, batch, microbatch, isLastStage);
  restoreChangingBuffers(buffersNow);
  state.buffersBefore.clear();
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(current);
  }
  state.hasGraph = true;
}

torch::Tensor StageModel::backward(MicrobatchState& state, const torch::Tensor& gradOutput,
                                   const std::function<void(int)>& onPieceDone) {
  VARUNA_CHECK(state.hasGraph, "backward without a graph");
  torch::Tensor grad = gradOutput;
  const int first = chunkBegin(state.chunk);
  for (int j = static_cast<int>(state.outputs.size()) - 1; j >= 0; --j) {
    if (state.outputs[j].requires_grad()) torch::autograd::backward({state.outputs[j]}, {grad});
    if (onPieceDone) onPieceDone(first + j);
    const torch::Tensor& in = state.inputs[j];
    if (!in.defined()) return torch::Tensor();
    grad = in.grad().defined() ? in.grad() : torch::zeros_like(in);
  }
  return grad;
}

torch::Tensor StageModel::backwardInput(MicrobatchState& state, const torch::Tensor& gradOutput) {
  VARUNA_CHECK(state.hasGraph && state.splits.empty(), "input gradient without a graph, or twice");
  state.splits.resize(state.outputs.size());
  torch::Tensor grad = gradOutput;
  const int first = chunkBegin(state.chunk);
  for (int j = static_cast<int>(state.outputs.size()) - 1; j >= 0; --j) {
    const torch::Tensor& in = state.inputs[j];
    state.splits[j] = std::make_unique<SplitBackward>(state.outputs[j], grad, in, pieceParams(first + j));
    state.splits[j]->inputGradient();
    if (!in.defined()) return torch::Tensor();
    grad = in.grad().defined() ? in.grad() : torch::zeros_like(in);
  }
  return grad;
}

void StageModel::backwardWeight(MicrobatchState& state, const std::function<void(int)>& onPieceDone) {
  VARUNA_CHECK(!state.splits.empty() && state.splits.size() == state.outputs.size(),
               "weight gradient before the input gradient");
  const int first = chunkBegin(state.chunk);
  for (int j = static_cast<int>(state.splits.size()) - 1; j >= 0; --j) {
    if (state.splits[j]) state.splits[j]->weightGradient();
    if (onPieceDone) onPieceDone(first + j);
  }
}

}  // namespace varuna
