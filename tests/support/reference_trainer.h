// Plain single-process training of the example GPT, the yardstick for the
// pipeline-equivalence tests: every piece built in one process, the whole
// global batch in one forward, one backward, tied gradients summed, global-norm
// clipping as torch::nn::utils::clip_grad_norm_, SGD with momentum.
//
// Models with running statistics (BatchNorm) depend on how the batch is cut
// into micro-batches, so with chunkSize the reference runs the global batch as
// consecutive micro-batches in sample order, each forward once and backward
// with weight b_i / B (exactly the gradient of the mean loss), as a pipeline at
// D = 1 sees them; buffers then move once per micro-batch, in order.
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
  // Micro-batch size; 0: the whole global batch in one forward (a model
  // without running statistics gives the same result either way).
  int64_t chunkSize = 0;
  torch::Device device = torch::kCPU;  // where the plain loop runs; results come back on the CPU
};

struct ReferenceRun {
  std::vector<double> losses;
  std::vector<double> gradNorms;
  std::map<std::string, torch::Tensor> params;   // full names, on the CPU
  std::map<std::string, torch::Tensor> buffers;  // full names ("block1.bn.running_mean"), after the last step
  // Final model in eval mode (running statistics) on the global batch of step
  // `steps`, no gradients.
  double evalLoss = 0;
};

ReferenceRun trainReference(const ModelSpec& spec, const gpt::CharDataset& data, const ReferenceConfig& config);

}  // namespace varuna::test
