// StageOptimizer: the optimizer of one stage as the runtime drives it. The
// runtime calls step() once the stage's gradients are reduced, unscaled and
// clipped, and keeps the optimizer's state in checkpoints per parameter,
// keyed by the parameter's full name ("<param>/<key>"), never by address, so
// it loads under any partition (docs/checkpoints.md).
//
// Two implementations: wrapTorchOptimizer for libtorch's SGD, Adam and AdamW
// (C++ programs), and the Python front end's bridge to any torch.optim
// optimizer (python/varuna/optimizer.py). Both write the same names for the
// optimizers they share, so checkpoints interchange between C++ and Python.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace varuna {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

class StageOptimizer {
 public:
  virtual ~StageOptimizer() = default;

  // One update of every parameter it holds.
  virtual void step() = 0;
  // The state of `params` (full name -> tensor) as "<name>/<key>" tensors. A
  // parameter without state yet has no entries.
  virtual NamedTensors state(const NamedTensors& params) = 0;
  // Checks saved state for `params` without changing anything (a checkpoint
  // is checked whole first) and returns what applies it. Throws ConfigError
  // naming `source` when the state is not this optimizer's.
  virtual std::function<void()> decodeState(const NamedTensors& params, const std::map<std::string, torch::Tensor>& saved,
                                            const std::string& source) = 0;
  // Hyper-parameters of the first parameter group, with "type" (lower-case
  // class name: "adamw", "sgd", "rmsprop") and "lr".
  virtual nlohmann::json settings() = 0;
  // Throws ConfigError when `saved` is another type of optimizer's.
  virtual void checkSettings(const nlohmann::json& saved) = 0;
  // Carries the saved settings over (the learning rate, which a schedule may have changed).
  virtual void applySettings(const nlohmann::json& saved) = 0;
};

// libtorch's SGD, Adam or AdamW (anything else: ConfigError when checkpointed).
std::shared_ptr<StageOptimizer> wrapTorchOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer);

// Common to every implementation: the settings of `saved` name the same type
// as `current` and carry a learning rate.
void checkSameOptimizerType(const nlohmann::json& current, const nlohmann::json& saved);

}  // namespace varuna
