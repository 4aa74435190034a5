#include "varuna/worker/devices.h"

#include <ATen/Context.h>
#include <torch/cuda.h>

#include <cstdlib>

#include "varuna/common/errors.h"

namespace varuna {

CommBackend parseCommBackend(const std::string& name) {
  if (name == "auto") return CommBackend::kAuto;
  if (name == "gloo") return CommBackend::kGloo;
  if (name == "nccl") return CommBackend::kNccl;
  throw ConfigError(strCat("unknown communication backend '", name, "': use auto, gloo or nccl"));
}

std::string toString(CommBackend backend) {
  switch (backend) {
    case CommBackend::kAuto: return "auto";
    case CommBackend::kGloo: return "gloo";
    case CommBackend::kNccl: return "nccl";
  }
  return "?";
}

CommBackend resolveCommBackend(CommBackend requested, torch::Device device) {
  if (requested == CommBackend::kAuto) return device.is_cuda() ? CommBackend::kNccl : CommBackend::kGloo;
  if (requested == CommBackend::kNccl && !device.is_cuda()) {
    throw ConfigError("--comm_backend nccl carries CUDA tensors only, and this worker runs on the CPU: "
                      "use --device cuda, or --comm_backend gloo (or auto)");
  }
#ifndef VARUNA_HAVE_NCCL
  if (requested == CommBackend::kNccl) {
    throw ConfigError("--comm_backend nccl: this build has no NCCL path (its libtorch has no CUDA); "
                      "rebuild against a CUDA libtorch, or use --comm_backend gloo");
  }
#endif
  return requested;
}

torch::Device cudaDeviceForLocalRank(int localRank, CommBackend backend) {
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  if (gpus == 0) {
    throw ConfigError("--device cuda, but no CUDA device is visible to this worker (check CUDA_VISIBLE_DEVICES "
                      "and the driver), or use --device cpu");
  }
  if (backend == CommBackend::kGloo) return {torch::kCUDA, static_cast<c10::DeviceIndex>(localRank % gpus)};
  if (localRank >= gpus) {
    throw ConfigError(strCat("local rank ", localRank, " has no GPU of its own: this host has ", gpus,
                             " and NCCL refuses two ranks on one GPU; start at most ", gpus,
                             " workers per host, or use --comm_backend gloo to share GPUs"));
  }
  return {torch::kCUDA, static_cast<c10::DeviceIndex>(localRank)};
}

void useDeterministicAlgorithms() {
  // Not overwritten: a user's own setting (e.g. :16:8) stays.
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
}

}  // namespace varuna
