// The model as Python gives it, converted for the C++ engine: pieces
// (name, factory, parameter count) become PieceSpecs and get_batch_fn a
// GetBatchFn. Shared by the runtime's bindings (module.cpp) and the
// Profiler's (python_profiler.cpp). The callables run Python, so each takes
// the GIL; the engine calls them from its own thread without it.
#pragma once

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "python_piece.h"
#include "varuna/worker/model.h"
#include "varuna/worker/varuna.h"

namespace varuna::python {

// A Python callable the engine keeps (in a PieceSpec or getBatch) and may
// drop without the GIL: the deleter takes it.
inline std::shared_ptr<pybind11::function> keptCallable(pybind11::function fn) {
  return std::shared_ptr<pybind11::function>(new pybind11::function(std::move(fn)), [](pybind11::function* f) {
    pybind11::gil_scoped_acquire gil;
    delete f;
  });
}

// [(name, factory, parameter count)] -> PieceSpecs whose factories call
// Python (under the GIL) and wrap the module they return.
inline std::vector<PieceSpec> pieceSpecs(
    const std::vector<std::tuple<std::string, pybind11::function, int64_t>>& pieces) {
  std::vector<PieceSpec> specs;
  for (const auto& [name, factory, count] : pieces) {
    specs.push_back({name,
                     [shared = keptCallable(factory)]() -> std::shared_ptr<Piece> {
                       pybind11::gil_scoped_acquire gil;
                       return std::make_shared<PythonPiece>((*shared)());
                     },
                     count});
  }
  return specs;
}

// get_batch_fn(size, device name) -> a dict of tensors, under the GIL.
inline GetBatchFn getBatchFn(pybind11::function fn) {
  return [shared = keptCallable(std::move(fn))](int64_t size, torch::Device device) {
    pybind11::gil_scoped_acquire gil;
    return (*shared)(size, pybind11::str(device.str())).cast<Batch>();
  };
}

}  // namespace varuna::python
