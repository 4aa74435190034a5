// Which device a worker computes on and which c10d backend carries its
// tensors between ranks.
//
// NCCL (the default for CUDA) wants one GPU per rank: it refuses two ranks on
// one device. Gloo carries CUDA tensors too (collectives through c10d's own
// CUDA support; point-to-point through pinned host buffers, see comm.h), so a
// job of several stages or replicas can share one GPU, as the original
// Varuna's own set-up did.
#pragma once

#include <torch/types.h>

#include <string>

namespace varuna {

enum class CommBackend {
  kAuto,  // NCCL on CUDA (when built with it), Gloo on the CPU
  kGloo,  // Gloo, on CPU or CUDA tensors
  kNccl,  // NCCL; CUDA only
};
CommBackend parseCommBackend(const std::string& name);  // "auto", "gloo", "nccl"
std::string toString(CommBackend backend);

// The backend `requested` means on `device`: kAuto resolved; NCCL on the CPU,
// or in a build without the NCCL path, is a ConfigError naming the fix.
CommBackend resolveCommBackend(CommBackend requested, torch::Device device);

// The GPU of a worker with this local rank: cuda:<localRank> with NCCL (a
// ConfigError when the host has fewer GPUs, naming --comm_backend gloo), and
// cuda:<localRank mod GPUs> with Gloo. A ConfigError when no GPU is visible.
torch::Device cudaDeviceForLocalRank(int localRank, CommBackend backend);

// Deterministic kernels (torch.use_deterministic_algorithms) for equivalence
// runs; on CUDA also cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG, which
// must be set before the first cuBLAS call, so call this first thing).
void useDeterministicAlgorithms();

}  // namespace varuna
