// The model API: a model is a sequence of pieces separated by CutPoints.
//
// Each piece is given as a factory, so a stage constructs only the pieces it
// owns and no process ever allocates another stage's parameters. What crosses
// a cut is one tensor of shape (b, ...) where b is the micro-batch size; every
// piece also receives the micro-batch's named inputs (token ids, labels, masks).
// The first piece receives an undefined activation; the last piece returns the
// scalar loss (the mean over the micro-batch's samples).
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace varuna {

// Named, batch-major inputs of a (micro-)batch: every tensor has the samples
// along dimension 0. std::map keeps iteration order identical on every rank.
using Batch = std::map<std::string, torch::Tensor>;

// One segment of the model between two CutPoints.
class Piece : public torch::nn::Module {
 public:
  // `activation` is what the previous piece returned (undefined for the first
  // piece). Must return one tensor of shape (b, ...), or the scalar loss for
  // the last piece.
  virtual torch::Tensor forward(const torch::Tensor& activation, const Batch& batch) = 0;

  // False for buffers registered with registerNonPersistentBuffer (PyTorch's
  // register_buffer(..., persistent=False)): kept in step across replicas but
  // not saved in checkpoints. libtorch's own register_buffer has no such flag,
  // so every other buffer, including those of nested modules, is persistent.
  bool isPersistentBuffer(const std::string& path) const { return !nonPersistentBuffers_.count(path); }

 protected:
  torch::Tensor registerNonPersistentBuffer(const std::string& name, torch::Tensor tensor) {
    nonPersistentBuffers_.insert(name);
    return register_buffer(name, std::move(tensor));
  }
  // The buffer at `path` ("block.attn.mask") of a nested module is not
  // persistent: for pieces whose buffers come from elsewhere (a Python module).
  void markNonPersistentBuffer(const std::string& path) { nonPersistentBuffers_.insert(path); }

 private:
  std::set<std::string> nonPersistentBuffers_;
};

using PieceFactory = std::function<std::shared_ptr<Piece>()>;

struct PieceSpec {
  // Unique; the piece's parameters are named "<name>.<parameter path>".
  std::string name;
  PieceFactory make;
  // Number of parameters, used to balance stages when no profiled costs are
  // given. -1: unknown (the piece is then built once, alone, to count them).
  int64_t paramCount = -1;
};

// Two parameters holding the same weight, e.g. the word embedding at the start
// and the LM head at the end: {"embed.wte.weight", "head.lm_head.weight"}.
// Their gradients are summed and their values stay bit-identical; at start the
// second takes the first's value.
using SharedWeight = std::pair<std::string, std::string>;

struct ModelSpec {
  std::vector<PieceSpec> pieces;
  std::vector<SharedWeight> sharedWeights;
  // Piece i is built right after torch::manual_seed(seed + i), so its initial
  // weights do not depend on the partition or on which process builds it.
  uint64_t seed = 0;
  // Optional per-piece costs (e.g. profiled compute time); balances stages by
  // cost when given, by parameter count otherwise.
  std::vector<double> pieceCosts;
};

// Builds piece `index` deterministically (seeded as described above).
std::shared_ptr<Piece> buildPiece(const ModelSpec& model, int index);

// Checks names, factories and shared-weight declarations that can be checked
// without building pieces; throws ConfigError naming the problem.
void validateModelSpec(const ModelSpec& model);

// The piece that owns a full parameter name ("block3.attn.qkv.weight" -> 3),
// or -1 when no piece name is a prefix of it.
int pieceOfParameter(const ModelSpec& model, const std::string& fullName);

}  // namespace varuna
