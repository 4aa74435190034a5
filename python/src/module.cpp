// varuna._C: the worker runtime for Python. The Python layer (varuna/*.py)
// builds the options and the optimizer bridge; this module holds no logic of
// its own beyond converting: pieces are PythonPiece, the optimizer is
// PythonOptimizer, and every call that trains, waits on peers or writes
// checkpoints runs without the GIL (pieces' forwards and the optimizer
// bridge take it back when they run Python).
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "python_model.h"
#include "python_optimizer.h"
#include "python_piece.h"
#include "python_profiler.h"
#include "varuna/common/errors.h"
#include "varuna/worker/launch_args.h"
#include "varuna/worker/varuna.h"

namespace py = pybind11;
using namespace varuna;
using varuna::python::PythonOptimizer;
using varuna::python::PythonPiece;
using varuna::python::getBatchFn;
using varuna::python::pieceSpecs;

namespace {

using Release = py::call_guard<py::gil_scoped_release>;

// The runtime is destroyed without the GIL: its destructor waits for the
// background checkpoint writer, which may need the GIL to drop a Python
// job's tensors (the pieces take it back to release their modules).
struct ReleaseGilDelete {
  void operator()(Varuna* runtime) const {
    py::gil_scoped_release release;
    delete runtime;
  }
};
using RuntimeHolder = std::unique_ptr<Varuna, ReleaseGilDelete>;

void bindOptions(py::module_& m) {
  py::class_<LaunchArgs>(m, "LaunchArgs")
      .def_readonly("rank", &LaunchArgs::rank)
      .def_readonly("local_rank", &LaunchArgs::localRank)
      .def_readonly("world_size", &LaunchArgs::worldSize)
      .def_readonly("stage_to_rank_map", &LaunchArgs::stageToRankMap)
      .def_readonly("chunk_size", &LaunchArgs::chunkSize)
      .def_property_readonly("batch_size", &LaunchArgs::globalBatchSize,
                             "the global batch (all replicas together); 0 when the launcher gave none")
      .def_readonly("replica_batch_size", &LaunchArgs::replicaBatchSize,
                    "this replica's share of the global batch (the launch contract's --batch-size)")
      .def_property_readonly("stages", &LaunchArgs::stages)
      .def_property_readonly("replicas", &LaunchArgs::replicas)
      .def_property_readonly("stage", &LaunchArgs::stage, "this rank's pipeline stage")
      .def_property_readonly("replica", &LaunchArgs::replica, "this rank's data-parallel replica")
      .def_readonly("resume_step", &LaunchArgs::resumeStep)
      .def_readonly("master_addr", &LaunchArgs::masterAddr)
      .def_readonly("master_port", &LaunchArgs::masterPort)
      .def_readonly("manager_addr", &LaunchArgs::managerAddr)
      .def_readonly("generation", &LaunchArgs::generation)
      .def_readonly("global_store", &LaunchArgs::globalStore)
      .def_readonly("user_args", &LaunchArgs::userArgs);
  m.def(
      "parse_launch_args",
      [](const std::vector<std::string>& argv) {
        std::vector<const char*> raw;
        for (const auto& a : argv) raw.push_back(a.c_str());
        return parseLaunchArgs(static_cast<int>(raw.size()), raw.data(), currentEnvironment());
      },
      py::arg("argv"),
      "The launcher's arguments (run_varuna, varuna_launch.py, torchrun) from argv and the environment; "
      "argv[0] is the program. Raises ValueError naming a bad argument.");

  py::class_<VarunaOptions>(m, "Options")
      .def(py::init<>())
      .def("set_pieces",
           [](VarunaOptions& o, const std::vector<std::tuple<std::string, py::function, int64_t>>& pieces,
              const std::vector<SharedWeight>& shared, uint64_t seed, const std::vector<double>& costs) {
             o.model.pieces = pieceSpecs(pieces);
             o.model.sharedWeights = shared;
             o.model.seed = seed;
             o.model.pieceCosts = costs;
           })
      .def("set_get_batch", [](VarunaOptions& o, py::function fn) { o.getBatch = getBatchFn(std::move(fn)); })
      .def_readwrite("stage_to_rank_map", &VarunaOptions::stageToRankMap)
      .def_readwrite("rank", &VarunaOptions::rank)
      .def_readwrite("local_rank", &VarunaOptions::localRank)
      .def_readwrite("batch_size", &VarunaOptions::batchSize)
      .def_readwrite("chunk_size", &VarunaOptions::chunkSize)
      .def_readwrite("bucket_bytes", &VarunaOptions::bucketBytes)
      .def_readwrite("trace_dir", &VarunaOptions::traceDir)
      .def_property(
          "precision", [](const VarunaOptions& o) { return toString(o.precision); },
          [](VarunaOptions& o, const std::string& p) { o.precision = parsePrecision(p); })
      .def_property(
          "device", [](const VarunaOptions& o) { return o.device.str(); },
          [](VarunaOptions& o, const std::string& d) { o.device = torch::Device(d); })
      .def_property(
          "comm_backend", [](const VarunaOptions& o) { return toString(o.commBackend); },
          [](VarunaOptions& o, const std::string& b) { o.commBackend = parseCommBackend(b); })
      .def_property(
          "on_nonfinite",
          [](const VarunaOptions& o) {
            return o.onNonFiniteGradients == NonFiniteGradients::kStopTraining ? "stop" : "skip";
          },
          [](VarunaOptions& o, const std::string& mode) {
            if (mode != "skip" && mode != "stop") {
              throw ConfigError("on_nonfinite must be 'skip' or 'stop', got '" + mode + "'");
            }
            o.onNonFiniteGradients = mode == "stop" ? NonFiniteGradients::kStopTraining : NonFiniteGradients::kSkipStep;
          })
      .def_property(
          "host_memory",
          [](const VarunaOptions& o) { return o.hostMemory == HostMemory::kCompact ? "compact" : "fast"; },
          [](VarunaOptions& o, const std::string& mode) {
            if (mode != "fast" && mode != "compact") {
              throw ConfigError("host_memory must be 'fast' or 'compact', got '" + mode + "'");
            }
            o.hostMemory = mode == "compact" ? HostMemory::kCompact : HostMemory::kFast;
          })
      .def_property(
          "schedule",
          [](const VarunaOptions& o) {
            return toString(ScheduleChoice{o.schedule, o.scheduleChunks > 0 ? o.scheduleChunks : defaultChunks(o.schedule)});
          },
          [](VarunaOptions& o, const std::string& s) {
            const ScheduleChoice choice = parseScheduleChoice(s);  // "interleaved:3": kind and chunks
            o.schedule = choice.kind;
            o.scheduleChunks = choice.chunks;
          })
      .def_property(
          "peer_timeout_s", [](const VarunaOptions& o) { return o.peerTimeout.count() / 1000.0; },
          [](VarunaOptions& o, double s) { o.peerTimeout = std::chrono::milliseconds(static_cast<int64_t>(s * 1000)); })
      .def_property(
          "master_addr", [](const VarunaOptions& o) { return o.rendezvous.masterAddr; },
          [](VarunaOptions& o, const std::string& a) { o.rendezvous.masterAddr = a; })
      .def_property(
          "master_port", [](const VarunaOptions& o) { return o.rendezvous.masterPort; },
          [](VarunaOptions& o, int p) { o.rendezvous.masterPort = p; })
      .def_property(
          "global_store", [](const VarunaOptions& o) { return o.checkpointing.globalStore; },
          [](VarunaOptions& o, const std::string& s) { o.checkpointing.globalStore = s; })
      .def_property(
          "keep_checkpoints", [](const VarunaOptions& o) { return o.checkpointing.keepCheckpoints; },
          [](VarunaOptions& o, int k) { o.checkpointing.keepCheckpoints = k; })
      .def("apply_launch_args", &VarunaOptions::applyLaunchArgs, py::arg("args"));
}

void bindRuntime(py::module_& m) {
  py::class_<StepResult>(m, "StepResult")
      .def_readonly("loss", &StepResult::loss)
      .def_readonly("overflow", &StepResult::overflow)
      .def_readonly("grad_norm", &StepResult::gradNorm)
      .def_readonly("loss_scale", &StepResult::lossScale)
      .def_readonly("checkpoint_requested", &StepResult::checkpointRequested)
      .def_readonly("compute_seconds_per_microbatch", &StepResult::computeSecondsPerMicrobatch)
      .def_readonly("optimizer_seconds", &StepResult::optimizerSeconds)
      .def_readonly("wait_seconds", &StepResult::waitSeconds)
      .def("__repr__", [](const StepResult& r) {
        return strCat("StepResult(loss=", r.loss, ", overflow=", r.overflow ? "True" : "False",
                      ", grad_norm=", r.gradNorm, ", loss_scale=", r.lossScale, ")");
      });

  py::class_<LossScaleOptions>(m, "LossScaleOptions")
      .def(py::init<>())
      .def_readwrite("dynamic", &LossScaleOptions::dynamic)
      .def_readwrite("initial_scale", &LossScaleOptions::initialScale)
      .def_readwrite("min_scale", &LossScaleOptions::minScale)
      .def_readwrite("growth_interval", &LossScaleOptions::growthInterval);

  py::class_<Varuna, RuntimeHolder>(m, "Runtime")
      // Joins the job's process groups: blocks until every rank is there.
      .def(py::init([](VarunaOptions options) { return RuntimeHolder(new Varuna(std::move(options))); }),
           py::arg("options"), Release())
      .def("parameters", &Varuna::parameters)
      .def("named_parameters", &Varuna::namedParameters)
      .def("named_buffers", &Varuna::namedBuffers)
      .def(
          "set_optimizer",
          [](Varuna& v, py::object bridge, LossScaleOptions lossScale) {
            v.setOptimizer(std::static_pointer_cast<StageOptimizer>(std::make_shared<PythonOptimizer>(std::move(bridge))),
                           lossScale);
          },
          py::arg("bridge"), py::arg("loss_scale"))
      .def("step", &Varuna::step, py::arg("inputs"), py::arg("clip_grad_max_norm") = py::none(), Release())
      .def("evaluate", &Varuna::evaluate, py::arg("inputs"), Release())
      .def(
          "checkpoint",
          [](Varuna& v, const std::string& store, std::optional<int64_t> step, const std::string& tempdir, bool shard,
             bool onDemand) { return v.checkpoint(CheckpointRequest{store, step, tempdir, shard, onDemand}); },
          py::arg("global_store"), py::arg("step") = py::none(), py::arg("tempdir") = "", py::arg("shard") = false,
          py::arg("on_demand") = false, Release())
      .def("load_checkpoint", &Varuna::loadCheckpoint, py::arg("global_store"), py::arg("iteration"),
           py::arg("check_complete") = true, Release())
      .def("load_latest_checkpoint", &Varuna::loadLatestCheckpoint, py::arg("global_store"),
           py::arg("at_most") = py::none(), Release())
      .def("wait_for_checkpoints", &Varuna::waitForCheckpoints, Release())
      .def("abandon", &Varuna::abandon)
      .def("exit_if_checkpoint_requested", &Varuna::exitIfCheckpointRequested, py::arg("result"), Release())
      .def_property_readonly("steps_done", &Varuna::stepsDone)
      .def_property_readonly("samples_seen", &Varuna::samplesSeen)
      .def_property_readonly("rank", &Varuna::rank)
      .def_property_readonly("stage", &Varuna::stage)
      .def_property_readonly("replica", &Varuna::replica)
      .def_property_readonly("num_stages", &Varuna::numStages)
      .def_property_readonly("num_replicas", &Varuna::numReplicas)
      .def_property_readonly("is_last_stage", &Varuna::isLastStage)
      .def_property_readonly("loss_scale", [](const Varuna& v) { return v.lossScaler().scale(); })
      .def_property_readonly("num_chunks", &Varuna::numChunks)
      .def_property_readonly("owned_pieces", &Varuna::ownedPieces,
                             "[(begin, end)] of global pieces, one range per chunk this rank holds");

  m.def(
      "cuda_device_for_local_rank",
      [](int localRank, const std::string& backend) {
        return cudaDeviceForLocalRank(localRank, resolveCommBackend(parseCommBackend(backend), torch::kCUDA)).str();
      },
      py::arg("local_rank"), py::arg("comm_backend"),
      "The GPU of a worker with this local rank: its own with NCCL, shared (modulo the host's GPUs) with Gloo.");
  m.def("install_checkpoint_signal_handler", &installCheckpointSignalHandler,
        "SIGUSR1 asks for a checkpoint: the next step() tells every rank (StepResult.checkpoint_requested).");
  m.def("exit_worker", [](int code) { exitWorker(code); }, py::arg("code"),
        "Exits at once with `code`, flushing output and skipping destructors that could wait on peers that left.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Varuna's worker runtime (C++), for the varuna Python package.";
  // The runtime's errors as Python exceptions carrying the exit code a
  // worker should leave with (`exit_code`): ConfigError (a ValueError: bad
  // setup, exit 2) and Error (a RuntimeError: a lost peer, a storage failure,
  // a superseded generation).
  // Stored as pybind11 asks (a plain static py::object would be released
  // after the interpreter is gone, at exit); `exit_code` on the classes too,
  // for instances Python code raises itself.
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> configErrorType;
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> runtimeErrorType;
  configErrorType.call_once_and_store_result([&] {
    py::object type = py::exception<ConfigError>(m, "ConfigError", PyExc_ValueError);
    type.attr("exit_code") = kExitConfigError;
    return type;
  });
  runtimeErrorType.call_once_and_store_result([&] {
    py::object type = py::exception<Error>(m, "Error", PyExc_RuntimeError);
    type.attr("exit_code") = 1;
    return type;
  });
  py::register_exception_translator([](std::exception_ptr p) {
    auto raise = [](PyObject* type, const Error& e) {
      py::object instance = py::reinterpret_borrow<py::object>(type)(e.what());
      instance.attr("exit_code") = e.exitCode();
      PyErr_SetObject(type, instance.ptr());
    };
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ConfigError& e) {
      raise(configErrorType.get_stored().ptr(), e);
    } catch (const Error& e) {
      raise(runtimeErrorType.get_stored().ptr(), e);
    }
  });
  m.attr("EXIT_CHECKPOINTED") = kExitCheckpointed;
  bindOptions(m);
  bindRuntime(m);
  varuna::python::bindProfiler(m);
}
