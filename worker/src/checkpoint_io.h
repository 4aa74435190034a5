// Tensor (de)serialisation for checkpoints and the optimizer-state bridge.
//
// Files are torch::pickle_save archives of a Dict[str, Tensor], which Python
// reads with torch.load (see docs/checkpoints.md). Optimizer state is keyed by
// parameter name ("<param>/exp_avg", "<param>/step", ...), never by address,
// so it loads under any partition. Supported optimizers: SGD, Adam, AdamW.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace varuna {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

std::string pickleTensors(const NamedTensors& tensors);
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
