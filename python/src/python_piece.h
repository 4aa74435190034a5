// PythonPiece: a piece of the model written in Python (a torch.nn.Module whose
// forward takes (activation, inputs)), as the C++ runtime sees pieces. Its
// parameters and buffers are the Python module's own tensors (the same
// TensorImpl: no copy), registered under the same dotted names in a mirror of
// the module tree, so the runtime's gradients, all-reduces, checkpoints and
// device moves act on what Python sees. Its forward runs Python under the GIL,
// on the training thread; everything else of the runtime runs without it.
#pragma once

#include <torch/extension.h>

#include "varuna/worker/model.h"

namespace varuna::python {

class PythonPiece : public Piece {
 public:
  // Call with the GIL held.
  explicit PythonPiece(pybind11::object module);
  ~PythonPiece() override;

  torch::Tensor forward(const torch::Tensor& activation, const Batch& batch) override;
  // The runtime's train()/eval() (evaluate() runs in eval mode) reach the
  // Python module too: its dropout and BatchNorm follow.
  void train(bool on = true) override;
  const pybind11::object& module() const { return module_; }

 private:
  // The C++ module at dotted `path` below this one (created on the way).
  torch::nn::Module& childAt(const std::string& path);

  pybind11::object module_;
};

}  // namespace varuna::python
