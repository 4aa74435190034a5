#include "python_optimizer.h"

#include <pybind11/stl.h>

#include "varuna/common/errors.h"

namespace py = pybind11;

namespace varuna::python {
namespace {

// The bridge says "not this optimizer's state" with ValueError: the runtime's
// ConfigError (a checkpoint of another optimizer is a setup error, not damage).
template <typename F>
auto translated(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_ValueError)) throw ConfigError(py::str(e.value()).cast<std::string>());
    throw;
  }
}

}  // namespace

PythonOptimizer::~PythonOptimizer() {
  py::gil_scoped_acquire gil;
  bridge_ = py::object();
}

void PythonOptimizer::step() {
  py::gil_scoped_acquire gil;
  bridge_.attr("step")();
}

NamedTensors PythonOptimizer::state(const NamedTensors& params) {
  py::gil_scoped_acquire gil;
  // Detached here, under the GIL: the runtime's background writer holds them,
  // and tensors with a Python object attached would need the GIL to be dropped.
  NamedTensors state = bridge_.attr("state")(params).cast<NamedTensors>();
  for (auto& [name, tensor] : state) tensor = tensor.detach();
  return state;
}

std::function<void()> PythonOptimizer::decodeState(const NamedTensors& params,
                                                   const std::map<std::string, torch::Tensor>& saved,
                                                   const std::string& source) {
  py::gil_scoped_acquire gil;
  return translated([&] {
    // Dropped by the runtime with or without the GIL: the deleter takes it.
    std::shared_ptr<py::object> apply(new py::object(bridge_.attr("decode_state")(params, saved, source)),
                                      [](py::object* o) {
                                        py::gil_scoped_acquire gil;
                                        delete o;
                                      });
    return std::function<void()>([apply] {
      py::gil_scoped_acquire gil;
      (*apply)();
    });
  });
}

nlohmann::json PythonOptimizer::settings() {
  py::gil_scoped_acquire gil;
  return nlohmann::json::parse(bridge_.attr("settings_json")().cast<std::string>());
}

void PythonOptimizer::checkSettings(const nlohmann::json& saved) {
  py::gil_scoped_acquire gil;
  translated([&] { bridge_.attr("check_settings_json")(saved.dump()); });
}

void PythonOptimizer::applySettings(const nlohmann::json& saved) {
  py::gil_scoped_acquire gil;
  bridge_.attr("apply_settings_json")(saved.dump());
}

}  // namespace varuna::python
