// PythonOptimizer: the runtime's StageOptimizer over a Python bridge object
// (varuna.optimizer.OptimizerBridge) that wraps any torch.optim optimizer.
// Each call takes the GIL; settings cross as JSON text.
#pragma once

#include <torch/extension.h>

#include "varuna/worker/stage_optimizer.h"

namespace varuna::python {

class PythonOptimizer : public StageOptimizer {
 public:
  explicit PythonOptimizer(pybind11::object bridge) : bridge_(std::move(bridge)) {}
  ~PythonOptimizer() override;

  void step() override;
  NamedTensors state(const NamedTensors& params) override;
  std::function<void()> decodeState(const NamedTensors& params, const std::map<std::string, torch::Tensor>& saved,
                                    const std::string& source) override;
  nlohmann::json settings() override;
  void checkSettings(const nlohmann::json& saved) override;
  void applySettings(const nlohmann::json& saved) override;

 private:
  pybind11::object bridge_;
};

}  // namespace varuna::python
