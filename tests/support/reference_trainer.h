// Plain single-process training of the example GPT, the yardstick for the
// pipeline-equivalence tests: every piece built in one process, the whole
// global batch in one forward, one backward, tied gradients summed, global-norm
// clipping as torch::nn::utils::clip_grad_norm_, SGD with momentum.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "char_dataset.h"
#include "varuna/worker/model.h"

namespace varuna::test {

struct ReferenceConfig {
  int64_t globalBatch = 8;
  int64_t seqLen = 16;
  uint64_t dataSeed = 7;
  int64_t steps = 4;
  double lr = 0.1;
  double momentum = 0.9;
  double clip = 0.5;
};

struct ReferenceRun {
  std::vector<double> losses;
  std::vector<double> gradNorms;
  std::map<std::string, torch::Tensor> params;  // full names
  double evalLoss = 0;  // final model on the global batch of step `steps`, no gradients
};

ReferenceRun trainReference(const ModelSpec& spec, const gpt::CharDataset& data, const ReferenceConfig& config);

}  // namespace varuna::test
