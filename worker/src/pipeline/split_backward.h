// SplitBackward: one piece's backward for one micro-batch, in the two halves
// the zero-bubble schedules run at different times: B, the gradient of the
// piece's input (what the previous stage waits for), and W, the gradients of
// its parameters (what nobody waits for).
//
// How W avoids a second pass through the piece: before B, the piece's
// autograd graph is walked once. B runs the nodes on the input's path (those
// from which the input's gradient accumulator is reachable). Where a
// parameter's gradient branches off that path (a node on the path with an
// edge to a node off it that leads to parameters: the matrix product of a
// Linear, a batch norm, an embedding's add), a pre-hook keeps the gradient
// arriving at the node during B. W starts autograd's engine at those nodes
// with the kept gradients and asks for the parameters only, so the engine
// computes just the branches (for a Linear, input^T x grad) and never the
// input's path again. All branch points start one engine call, each one's
// edges down the path cut for the call, so that no branch point's gradient
// reaches another's along the path.
//
// Memory: once B is done, the tensors saved by the nodes only B runs (on
// the input's path and not branch points: attention, activation functions,
// reshapes) are released, as a whole backward frees them node by node.
// What stays until W is what W reads: the branch points' saved tensors (a
// Linear's input) and the gradients kept there (one per branch point, the
// size of that node's output). For a GPT block that is 5.5 MB of the 7.4 MB
// B held before (bench_split_backward).
//
// Where the split could not be exact, the whole backward runs in B and W
// only marks the piece done: an output that does not depend on the input; a
// parameter reached from two branch points one of which lies below the other
// on the path (a weight used twice inside the piece: kept whole since W ran
// one engine call per group, which went down the path from the upper one;
// W's cut edges would now allow it, but nothing has needed it); a
// leaf that needs a gradient but is not one of the piece's parameters (W
// computes the parameters' only); a branch point whose gradients carry hooks
// (register_hook, retain_grad: they would run again in W). A piece without an
// input (the model's first) does its whole backward in W: nothing waits for it.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

namespace varuna {

class SplitBackward {
 public:
  // `input` is the piece's input leaf (undefined for the model's first piece);
  // `params` the piece's parameters. The graph from `output` must be intact.
  SplitBackward(torch::Tensor output, torch::Tensor gradOutput, torch::Tensor input,
                const std::vector<torch::Tensor>& params);
  ~SplitBackward();
  SplitBackward(const SplitBackward&) = delete;
  SplitBackward& operator=(const SplitBackward&) = delete;

  // B: the input's gradient accumulates into input.grad(). Once.
  void inputGradient();
  // W: the parameters' gradients accumulate into their grad(); the graph is
  // released. Once, after inputGradient().
  void weightGradient();

  // How this piece was split (tests and docs).
  enum class Mode { kSplit, kAllInB, kAllInW, kNothing };
  Mode mode() const { return mode_; }

 private:
  struct Plan;
  void plan(const std::vector<torch::Tensor>& params);
  void runWeightBranches();  // W of a split piece

  torch::Tensor output_, gradOutput_, input_;
  Mode mode_ = Mode::kNothing;
  std::unique_ptr<Plan> plan_;
  bool inputDone_ = false, weightDone_ = false;
};

}  // namespace varuna
