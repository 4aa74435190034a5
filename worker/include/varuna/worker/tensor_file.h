// Named-tensor files in the format of Varuna's checkpoints: a PyTorch zip
// archive of a plain dict {name: tensor}, loadable in Python with
// torch.load(path) (weights_only included) and in C++ with loadTensorFile or
// torch::pickle_load. For exporting a model out of the system.
#pragma once

#include <torch/types.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace varuna {

// Durable and atomic (temporary name, fsync, rename). Throws on I/O errors.
void saveTensorFile(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors);
std::map<std::string, torch::Tensor> loadTensorFile(const std::string& path);

}  // namespace varuna
