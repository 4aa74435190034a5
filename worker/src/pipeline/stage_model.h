// StageModel: the pieces one pipeline stage owns, and how a micro-batch flows
// through them.
//
// Built by Varuna::Impl for pieces [begin, end) of the partition, or, under a
// chunked schedule (interleaved, zbv), for several such ranges, one per chunk
// the rank holds; only those pieces are ever constructed. Pieces are numbered
// locally 0.. across the chunks in chunk order. Each piece runs on its own small autograd graph
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
  int chunk = 0;                       // which of the stage's chunks it runs through (set before forward)
  torch::Tensor stageInput;            // received activation (undefined on stage 0)
  std::vector<torch::Tensor> inputs;   // per piece of the chunk, the leaf fed to it
  std::vector<torch::Tensor> outputs;  // per piece of the chunk, its output (graph attached)
  torch::Tensor rngState;              // generator state before an activation-free forward
  std::vector<torch::Tensor> buffersBefore;  // the changing buffers before that forward
  bool hasGraph = false;
  // Per piece, a split backward between its B and its W (zero-bubble schedules).
  std::vector<std::unique_ptr<SplitBackward>> splits;
};

// The pieces [begin, end) of one chunk.
struct PieceRange {
  int begin = 0, end = 0;
};

class StageModel : public torch::nn::Module {
 public:
  StageModel(const ModelSpec& model, int begin, int end, torch::Device device);
  StageModel(const ModelSpec& model, const std::vector<PieceRange>& chunks, torch::Device device);

  int numPieces() const { return static_cast<int>(pieces_.size()); }
  int numChunks() const { return static_cast<int>(chunkStart_.size()) - 1; }
  // Local pieces [chunkBegin(c), chunkEnd(c)) are chunk c's.
  int chunkBegin(int chunk) const { return chunkStart_[chunk]; }
  int chunkEnd(int chunk) const { return chunkStart_[chunk + 1]; }
  int globalPiece(int local) const { return global_[local]; }
  const std::string& pieceName(int local) const { return names_[local]; }
  bool ownsPiece(int global) const;

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

  // Runs every piece of the chunk `state.chunk`. With `keepGraph` the per-piece graphs are stored in
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
  torch::Tensor runPieces(int chunk, MicrobatchState* state, const torch::Tensor& input, const Batch& batch,
                          int64_t microbatch, bool isLastStage);
  void checkCut(int local, const torch::Tensor& out, int64_t microbatch, bool isLastPieceOfModel) const;

  torch::Device device_;
  std::vector<int> chunkStart_;  // size chunks + 1
  std::vector<int> global_;      // local piece -> global piece
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
