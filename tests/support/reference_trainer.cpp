#include "reference_trainer.h"

#include <torch/autograd.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <set>

namespace varuna::test {

ReferenceRun trainReference(const ModelSpec& spec, const gpt::CharDataset& data, const ReferenceConfig& config) {
  std::vector<std::shared_ptr<Piece>> pieces;
  std::map<std::string, torch::Tensor> named;
  std::vector<torch::Tensor> all;
  for (int i = 0; i < static_cast<int>(spec.pieces.size()); ++i) {
    pieces.push_back(buildPiece(spec, i));
    pieces.back()->to(config.device);
    for (const auto& p : pieces.back()->named_parameters()) {
      named[spec.pieces[i].name + "." + p.key()] = p.value();
      all.push_back(p.value());
    }
  }
  {
    torch::NoGradGuard noGrad;
    for (const auto& [a, b] : spec.sharedWeights) named.at(b).copy_(named.at(a));
  }
  torch::optim::SGD optimizer(all, torch::optim::SGDOptions(config.lr).momentum(config.momentum));
  const int64_t B = config.globalBatch;
  const int64_t chunk = config.chunkSize > 0 ? std::min(config.chunkSize, B) : B;
  ReferenceRun run;
  auto samples = [&](int64_t first) {
    Batch batch = data.samples(first, B, config.seqLen, config.dataSeed);
    for (auto& [key, t] : batch) t = t.to(config.device);
    return batch;
  };
  for (int64_t step = 0; step < config.steps; ++step) {
    optimizer.zero_grad();
    const Batch batch = samples(step * B);
    // Gradients accumulate over the micro-batches: sum_i (b_i / B) grad(loss_i)
    // is the gradient of the mean loss over the global batch.
    double loss = 0;
    for (int64_t first = 0; first < B; first += chunk) {
      const int64_t size = std::min(chunk, B - first);
      Batch micro;
      for (const auto& [key, t] : batch) micro[key] = t.narrow(0, first, size);
      torch::Tensor x;
      for (auto& piece : pieces) x = piece->forward(x, micro);
      const double weight = static_cast<double>(size) / static_cast<double>(B);
      (size == B ? x : x * weight).backward();
      loss += weight * x.item<double>();
    }
    run.losses.push_back(loss);
    std::set<std::string> duplicates;
    for (const auto& [a, b] : spec.sharedWeights) {
      auto sum = named.at(a).grad() + named.at(b).grad();
      named.at(a).mutable_grad() = sum;
      named.at(b).mutable_grad() = sum.clone();
      duplicates.insert(b);
    }
    double sumOfSquares = 0;
    for (const auto& [name, p] : named) {
      if (duplicates.count(name)) continue;
      const double n = p.grad().norm().item<double>();
      sumOfSquares += n * n;
    }
    const double norm = std::sqrt(sumOfSquares);
    run.gradNorms.push_back(norm);
    const double coefficient = config.clip / (norm + 1e-6);
    if (coefficient < 1.0) {
      for (auto& p : all) p.mutable_grad().mul_(coefficient);
    }
    optimizer.step();
  }
  auto onCpu = [](const torch::Tensor& t) { return t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true); };
  for (const auto& [name, p] : named) run.params[name] = onCpu(p);
  for (size_t i = 0; i < pieces.size(); ++i) {
    for (const auto& b : pieces[i]->named_buffers()) run.buffers[spec.pieces[i].name + "." + b.key()] = onCpu(b.value());
  }
  torch::NoGradGuard noGrad;
  const Batch held = samples(config.steps * config.globalBatch);
  torch::Tensor x;
  for (auto& piece : pieces) {
    piece->eval();
    x = piece->forward(x, held);
  }
  run.evalLoss = x.item<double>();
  return run;
}

}  // namespace varuna::test
