// StepExchange: the one job-wide exchange of a step, named. Every rank
// all-reduces (sums) its share, so each sees the same loss, the same gradient
// norm (hence the same clipping and fp16 overflow verdict) and the same
// checkpoint request in the same step. On the wire (a tensor for the
// all-reduce; salvage's SalvageReady/SalvageWrite) it is proto::kExchangeValues
// doubles in this order.
#pragma once

#include <optional>
#include <vector>

#include <torch/torch.h>

#include "varuna/common/protocol.h"

namespace varuna {

struct StepExchange {
  double lossSum = 0;                // the losses of the global batch, summed
  double sumOfSquares = 0;           // of the gradients, over every stage and replica
  bool checkpointRequested = false;  // some rank got SIGUSR1 before the exchange

  // This rank's share as the tensor the all-reduce sums: float64 on the
  // device of `lossSum`; the loss and the squared norm (scalar tensors) stay
  // there (no synchronisation for them).
  static torch::Tensor share(const torch::Tensor& lossSum, const torch::Tensor& sumOfSquares,
                             bool checkpointRequested) {
    auto values = torch::zeros({3}, lossSum.options().dtype(torch::kDouble));
    values[0] = lossSum;
    values[1] = sumOfSquares;
    values[2] = checkpointRequested ? 1.0 : 0.0;
    return values;
  }
  // The summed result.
  static StepExchange fromTensor(const torch::Tensor& summed) {
    const auto values = summed.cpu();
    return {values[0].item<double>(), values[1].item<double>(), values[2].item<double>() > 0};
  }
  std::vector<double> toWire() const { return {lossSum, sumOfSquares, checkpointRequested ? 1.0 : 0.0}; }
  // nullopt: not an exchange (another length).
  static std::optional<StepExchange> fromWire(const std::vector<double>& values) {
    static_assert(proto::kExchangeValues == 3, "StepExchange names three values");
    if (values.size() != proto::kExchangeValues) return std::nullopt;
    return StepExchange{values[0], values[1], values[2] > 0};
  }
};

}  // namespace varuna
