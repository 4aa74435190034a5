#include "python_piece.h"

#include <set>

#include "varuna/common/errors.h"

namespace py = pybind11;

namespace varuna::python {
namespace {

// "a.b.weight" -> {"a.b", "weight"}; "weight" -> {"", "weight"}.
std::pair<std::string, std::string> splitPath(const std::string& path) {
  const auto dot = path.rfind('.');
  if (dot == std::string::npos) return {"", path};
  return {path.substr(0, dot), path.substr(dot + 1)};
}

}  // namespace

PythonPiece::PythonPiece(py::object module) : module_(std::move(module)) {
  if (!py::isinstance(module_, py::module_::import("torch.nn").attr("Module"))) {
    throw ConfigError(strCat("a piece factory returned ", py::str(py::type::of(module_)).cast<std::string>(),
                             ", not a torch.nn.Module"));
  }
  for (const auto& item : module_.attr("named_parameters")()) {
    const auto entry = item.cast<py::tuple>();
    const auto [parent, leaf] = splitPath(entry[0].cast<std::string>());
    const auto tensor = entry[1].cast<torch::Tensor>();
    if (py::isinstance(entry[1], py::module_::import("torch.nn.parameter").attr("UninitializedParameter"))) {
      throw ConfigError(strCat("piece parameter '", entry[0].cast<std::string>(),
                               "' is not initialised yet (a Lazy module): give it its shape in the factory"));
    }
    if (!tensor.requires_grad()) {
      // Frozen: model state like a buffer (checkpointed, kept identical on
      // every replica), but no gradient and not the optimizer's.
      childAt(parent).register_buffer(leaf, tensor);
      continue;
    }
    childAt(parent).register_parameter(leaf, tensor, true);
  }
  // Persistent buffers are those state_dict() lists (PyTorch's
  // register_buffer(..., persistent=False) leaves them out).
  std::set<std::string> persistent;
  for (const auto& key : module_.attr("state_dict")().attr("keys")()) persistent.insert(key.cast<std::string>());
  for (const auto& item : module_.attr("named_buffers")()) {
    const auto entry = item.cast<py::tuple>();
    const std::string path = entry[0].cast<std::string>();
    const auto [parent, leaf] = splitPath(path);
    childAt(parent).register_buffer(leaf, entry[1].cast<torch::Tensor>());
    if (!persistent.count(path)) markNonPersistentBuffer(path);
  }
}

PythonPiece::~PythonPiece() {
  // The runtime may drop a piece without the GIL (it holds none of its own).
  py::gil_scoped_acquire gil;
  module_ = py::object();
}

torch::nn::Module& PythonPiece::childAt(const std::string& path) {
  torch::nn::Module* current = this;
  std::string rest = path;
  while (!rest.empty()) {
    const auto dot = rest.find('.');
    const std::string name = rest.substr(0, dot);
    rest = dot == std::string::npos ? "" : rest.substr(dot + 1);
    const auto children = current->named_children();
    if (const auto* child = children.find(name)) {
      current = child->get();
    } else {
      current = current->register_module(name, std::make_shared<torch::nn::Module>()).get();
    }
  }
  return *current;
}

void PythonPiece::train(bool on) {
  Piece::train(on);
  py::gil_scoped_acquire gil;
  module_.attr("train")(on);
}

torch::Tensor PythonPiece::forward(const torch::Tensor& activation, const Batch& batch) {
  py::gil_scoped_acquire gil;
  py::dict inputs;
  for (const auto& [name, tensor] : batch) inputs[py::str(name)] = tensor;
  py::object out = module_(activation.defined() ? py::cast(activation) : py::none(), inputs);
  if (!THPVariable_Check(out.ptr())) {
    throw ConfigError(strCat("a piece's forward returned ", py::str(py::type::of(out)).cast<std::string>(),
                             ": it must return one tensor (the last piece: the scalar loss)"));
  }
  return out.cast<torch::Tensor>();
}

}  // namespace varuna::python
