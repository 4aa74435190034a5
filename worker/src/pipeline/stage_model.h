// StageModel: the pieces one pipeline stage owns, and how a micro-batch flows
// through them.
//
// Built by Varuna::Impl for pieces [begin, end) of the partition; only those
// pieces are ever constructed. Each piece runs on its own small autograd graph
// (its input is a detached leaf), so the backward can go piece by piece and
// hand every finished piece to the gradient buckets straight away, and a
// recompute can rebuild exactly the graph a forward skipped.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <vector>

#include "pipeline/split_backward.h"
#include "varuna/worker/model.h"

namespace varuna {

// What one forward of one micro-batch leaves behind for its backward.
struct MicrobatchState {
  torch::Tensor stageInput;            // received activation (undefined on stage 0)
  std::vector<torch::Tensor> inputs;   // per piece, the leaf fed to it
  std::vector<torch::Tensor> outputs;  // per piece, its output (graph attached)
  torch::Tensor rngState;              // generator state before an activation-free forward
  std::vector<torch::Tensor> buffersBefore;  // the changing buffers before that forward
  bool hasGraph = false;
  // Per piece, a split backward between its B and its W (zero-bubble schedules).
  std::vector<std::unique_ptr<SplitBackward>> splits;
};

class StageModel : public torch::nn::Module {
 public:
  StageModel(const ModelSpec& model, int begin, int end, torch::Device device);

  int numPieces() const { return static_cast<int>(pieces_.size()); }
  int firstPiece() const { return begin_; }
  const std::string& pieceName(int local) const { return names_[local]; }
  bool ownsPiece(int global) const { return global >= begin_ && global < begin_ + numPieces(); }

  // Full parameter name -> tensor, for this stage's pieces.
  const std::map<std::string, torch::Tensor>& namedParams() const { return params_; }
  // Full buffer name -> tensor, and those a training forward changes (learned
  // by learnChangingBuffers; running statistics). Non-persistent buffers
  // (Piece::registerNonPersistentBuffer) are buffers too, but not saved.
  const std::map<std::string, torch::Tensor>& namedBuffers() const { return buffers_; }
  const std::vector<std::string>& changingBuffers() const { return changing_; }
  // Persistent buffers of local piece k, by full name: what a checkpoint holds.
  std::vector<std::pair<std::string, torch::Tensor>> piecePersistentBuffers(int local) const;

  // Runs `forward` (one training forward of a sample), then puts every buffer
  // back as it was and remembers those the forward changed: they are the ones
  // recompute() must leave untouched and replicas must keep in step.
  void learnChangingBuffers(const std::function<void()>& forward);
  // Copies of the changing buffers, and writing such copies back. The writes
  // bypass autograd's version counters: a graph may hold the buffer (e.g.
  // batch norm saves its running statistics) without reading its values.
  std::vector<torch::Tensor> copyChangingBuffers() const;
  void restoreChangingBuffers(const std::vector<torch::Tensor>& values);
  // Parameters of local piece k in registration order.
  std::vector<torch::Tensor> pieceParams(int local) const;
  int localPieceOf(const std::string& fullName) const;

  // Runs every piece. With `keepGraph` the per-piece graphs are stored in
  // `state`; without, the forward runs under no_grad and only the stage input
  // and the generator state are kept, for a later recompute. `microbatch` is the
  // expected leading dimension, checked at every cut.
  torch::Tensor forward(MicrobatchState& state, const torch::Tensor& input, const Batch& batch,
                        int64_t microbatch, bool keepGraph, bool isLastStage);
  // Re-runs an activation-free forward with the generator state and changing
  // buffers it used, then puts the buffers back: buffers end as one forward
  // leaves them (the recompute does not update running statistics twice).
  void recompute(MicrobatchState& state, const Batch& batch, int64_t microbatch, bool isLastStage);
  // Backpropagates `gradOutput` piece by piece (last first), calling
  // `onPieceDone(local)` after each; returns the gradient of the stage input.
  torch::Tensor backward(MicrobatchState& state, const torch::Tensor& gradOutput,
                         const std::function<void(int)>& onPieceDone);
  // The two halves of backward() (SplitBackward): backwardInput returns the
  // gradient of the stage input and keeps what the weights need;
  // backwardWeight then accumulates the parameters' gradients piece by piece
  // (last first), calling `onPieceDone(local)` after each, and frees the graph.
  torch::Tensor backwardInput(MicrobatchState& state, const torch::Tensor& gradOutput);
  void backwardWeight(MicrobatchState& state, const std::function<void(int)>& onPieceDone);

 private:
  torch::Tensor runPieces(MicrobatchState* state, const torch::Tensor& input, const Batch& batch,
                          int64_t microbatch, bool isLastStage);
  void checkCut(int local, const torch::Tensor& out, int64_t microbatch, bool isLastPieceOfModel) const;

  int begin_;
  torch::Device device_;
  std::vector<std::shared_ptr<Piece>> pieces_;
  std::vector<std::string> names_;
  std::map<std::string, torch::Tensor> params_;
  std::map<std::string, int> localPieceOfParam_;
  std::map<std::string, torch::Tensor> buffers_;
  std::map<std::string, int> localPieceOfBuffer_;
  std::set<std::string> nonPersistent_;
  std::vector<std::string> changing_;
};

}  // namespace varuna
