// Tensor (de)serialisation for checkpoints and the optimizer-state bridge.
//
// Files are PyTorch zip archives of a plain dict {str: Tensor}, written as
// torch::pickle_save does but without its type tags, so Python reads them
// with a plain torch.load (weights_only, the default, included). Optimizer state is keyed by
// parameter name ("<param>/exp_avg", "<param>/step", ...), never by address,
// so it loads under any partition. Supported optimizers: SGD, Adam, AdamW.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "varuna/worker/stage_optimizer.h"

namespace varuna {


// Streams a torch.load-able archive of the dict {name: tensor} into `sink`,
// straight from the tensors' memory (CPU tensors are not copied).
void writeTensorArchive(const NamedTensors& tensors, const std::function<void(const void*, size_t)>& sink);
// Throws ckpt::DamagedError naming `source` if the bytes are not such a dict.
std::map<std::string, torch::Tensor> unpickleTensors(const std::string& bytes, const std::string& source);

// The state of `params` (full name -> tensor) in `optimizer`, as named tensors.
NamedTensors optimizerState(torch::optim::Optimizer& optimizer, const NamedTensors& params);
// Saved state decoded for `params` without touching the optimizer, so a
// checkpoint is checked whole before anything changes; applied by
// applyOptimizerState. A parameter missing from `saved` had no state yet.
// Throws ConfigError naming `source` when the state is of another optimizer.
struct DecodedOptimizerState {
  std::vector<std::pair<torch::Tensor, std::unique_ptr<torch::optim::OptimizerParamState>>> states;
  std::vector<torch::Tensor> withoutState;  // parameters whose state is cleared
};
DecodedOptimizerState decodeOptimizerState(torch::optim::Optimizer& optimizer, const NamedTensors& params,
                                           const std::map<std::string, torch::Tensor>& saved,
                                           const std::string& source);
void applyOptimizerState(torch::optim::Optimizer& optimizer, DecodedOptimizerState decoded);

// Hyper-parameters of the first parameter group (lr, betas, ...). The check
// throws ConfigError when the checkpoint's optimizer is of another type; the
// apply carries the (possibly scheduled) learning rate over.
nlohmann::json optimizerSettings(torch::optim::Optimizer& optimizer);
void checkOptimizerSettings(torch::optim::Optimizer& optimizer, const nlohmann::json& settings);
void applyOptimizerSettings(torch::optim::Optimizer& optimizer, const nlohmann::json& settings);

// Generator states of this process (CPU, and CUDA when `device` is CUDA).
NamedTensors generatorStates(torch::Device device);
void restoreGeneratorStates(torch::Device device, const std::map<std::string, torch::Tensor>& states);

}  // namespace varuna
