// The C++ Profiler for Python (varuna.Profiler, python/varuna/profiler.py):
// the model's pieces and get_batch_fn converted as for the runtime
// (python_model.h), the options as ProfilerOptions, and run() without the GIL
// (it waits on peers and in the rendezvous store; the pieces' forwards and
// get_batch_fn take the GIL back when they run Python). The profile crosses
// back as the JSON text profile.json holds, so Python sees exactly the file's
// fields.
#include "python_profiler.h"

#include <pybind11/stl.h>
#include <torch/extension.h>

#include <chrono>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "python_model.h"
#include "varuna/common/profile.h"
#include "varuna/worker/launch_args.h"
#include "varuna/worker/profiler.h"

namespace py = pybind11;

namespace varuna::python {
namespace {

// The Profiler is destroyed without the GIL: its communicator joins threads
// and its model's Python callables take the GIL to drop themselves.
struct ReleaseGilDeleteProfiler {
  void operator()(Profiler* profiler) const {
    py::gil_scoped_release release;
    delete profiler;
  }
};
using ProfilerHolder = std::unique_ptr<Profiler, ReleaseGilDeleteProfiler>;

using PythonPieces = std::vector<std::tuple<std::string, py::function, int64_t>>;

ModelSpec modelSpec(const PythonPieces& pieces, const std::vector<SharedWeight>& shared, uint64_t seed) {
  ModelSpec model;
  model.pieces = pieceSpecs(pieces);
  model.sharedWeights = shared;
  model.seed = seed;
  return model;
}

}  // namespace

void bindProfiler(py::module_& m) {
  py::class_<ProfilerOptions>(m, "ProfilerOptions")
      .def(py::init<>())
      .def_readwrite("micro_batch_sizes", &ProfilerOptions::microBatchSizes)
      .def_readwrite("pieces", &ProfilerOptions::pieces)
      .def_readwrite("warmup", &ProfilerOptions::warmup)
      .def_readwrite("repetitions", &ProfilerOptions::repetitions)
      .def_readwrite("output_dir", &ProfilerOptions::outputDir)
      .def_readwrite("add_to_existing", &ProfilerOptions::addToExisting)
      .def_readwrite("reuse_cached", &ProfilerOptions::reuseCached)
      .def_readwrite("optimizer", &ProfilerOptions::optimizer)
      .def_readwrite("rank", &ProfilerOptions::rank)
      .def_readwrite("world_size", &ProfilerOptions::worldSize)
      .def_readwrite("host", &ProfilerOptions::host)
      .def_readwrite("profile_communication", &ProfilerOptions::profileCommunication)
      .def_readwrite("comm_repetitions", &ProfilerOptions::commRepetitions)
      .def_readwrite("max_comm_bytes", &ProfilerOptions::maxCommBytes)
      .def_property(
          "precision", [](const ProfilerOptions& o) { return toString(o.precision); },
          [](ProfilerOptions& o, const std::string& p) { o.precision = parsePrecision(p); })
      .def_property(
          "comm_backend", [](const ProfilerOptions& o) { return toString(o.commBackend); },
          [](ProfilerOptions& o, const std::string& b) { o.commBackend = parseCommBackend(b); })
      .def_property(
          "device", [](const ProfilerOptions& o) { return o.device.str(); },
          [](ProfilerOptions& o, const std::string& d) { o.device = torch::Device(d); })
      .def_property(
          "peer_timeout_s", [](const ProfilerOptions& o) { return o.peerTimeout.count() / 1000.0; },
          [](ProfilerOptions& o, double s) { o.peerTimeout = std::chrono::milliseconds(static_cast<int64_t>(s * 1000)); })
      .def("apply_launch_args", &ProfilerOptions::applyLaunchArgs, py::arg("args"));

  py::class_<Profiler, ProfilerHolder>(m, "Profiler")
      .def(py::init([](const PythonPieces& pieces, const std::vector<SharedWeight>& shared, uint64_t seed,
                       py::function getBatch, ProfilerOptions options) {
             return ProfilerHolder(
                 new Profiler(modelSpec(pieces, shared, seed), getBatchFn(std::move(getBatch)), std::move(options)));
           }),
           py::arg("pieces"), py::arg("shared_weights"), py::arg("seed"), py::arg("get_batch"), py::arg("options"))
      // Every rank calls it; it returns when rank 0 has written the profile
      // (or with the error that stopped every rank).
      .def("run",
           [](Profiler& profiler) {
             std::string text;
             {
               py::gil_scoped_release release;
               text = profile::toJson(profiler.run()).dump();
             }
             return text;
           });

  m.def(
      "read_profile",
      [](const std::string& path, const std::string& expectedFingerprint) {
        py::gil_scoped_release release;
        return profile::toJson(profile::readProfile(path, expectedFingerprint)).dump();
      },
      py::arg("path"), py::arg("expected_fingerprint") = "",
      "profile.json as the C++ side reads it (JSON text); raises ConfigError when it is missing, malformed, of "
      "another version, or (given a fingerprint) of another model.");
  m.def(
      "model_fingerprint",
      [](const PythonPieces& pieces, const std::vector<SharedWeight>& shared, uint64_t seed) {
        ModelSpec model = modelSpec(pieces, shared, seed);
        std::string fingerprint;
        {
          py::gil_scoped_release release;
          fingerprint = modelFingerprint(model);
        }
        return fingerprint;
      },
      py::arg("pieces"), py::arg("shared_weights"), py::arg("seed"),
      "The fingerprint a profile of this model carries (builds each piece once).");
}

}  // namespace varuna::python
