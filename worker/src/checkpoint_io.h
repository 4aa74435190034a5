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

namespace varuna {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Streams a torch.load-able archive of the dict {name: tensor} into `sink`,
// straight from the tensors' memory (CPU tensors are not copied).
void writeTensorArchive(const NamedTensors& tensors, const std::function<void(const void*, size_t)>& sink);
// Throws ckpt::CheckpointError naming `source` if the bytes are not such a dict.
std::map<std::string, torch::Tensor> unpickleTensors(const std::string& bytes, const std::string& source);

// The state of `params` (full name -> tensor) in `optimizer`, as named tensors.
NamedTensors optimizerState(torch::optim::Optimizer& optimizer, const NamedTensors& params);
// Puts saved state back for `params`; names missing from `saved` keep no state.
void restoreOptimizerState(torch::optim::Optimizer& optimizer, const NamedTensors& params,
                           const std::map<std::string, torch::Tensor>& saved, const std::string& source);

// Hyper-parameters of the first parameter group (lr, betas, ...), and back.
nlohmann::json optimizerSettings(torch::optim::Optimizer& optimizer);
void applyOptimizerSettings(torch::optim::Optimizer& optimizer, const nlohmann::json& settings);

// Generator states of this process (CPU, and CUDA when `device` is CUDA).
NamedTensors generatorStates(torch::Device device);
void restoreGeneratorStates(torch::Device device, const std::map<std::string, torch::Tensor>& states);

}  // namespace varuna
