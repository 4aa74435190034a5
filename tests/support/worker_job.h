// Runs the example trainer as a real multi-process Varuna job on loopback, the
// way the launcher does, and reads back what each rank dumped.
//
// The test process hosts the rendezvous TCPStore on a kernel-chosen port (port
// 0, read back), and passes it to the workers with --external_store.
#pragma once

#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/types.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "process.h"

namespace varuna::test {

struct WorkerJobSpec {
  int stages = 1;
  int replicas = 1;
  int64_t perReplicaBatch = 8;
  int64_t chunkSize = 2;
  std::vector<std::string> trainArgs;  // passed to train_gpt after the launcher's
  std::map<std::string, std::string> env;  // more environment for every worker (e.g. a manager's address)
};

struct StepRecord {
  int64_t step;
  double loss;
  bool overflow;
  double gradNorm;
  double lossScale;
};

class WorkerJob {
 public:
  WorkerJob(const WorkerJobSpec& spec, const std::filesystem::path& dir);
  int worldSize() const { return static_cast<int>(workers_.size()); }
  ChildProcess& worker(int rank) { return workers_[rank]; }
  // Waits for every worker; returns their exit codes (-1: still running at the deadline).
  std::vector<int> waitAll(std::chrono::milliseconds timeout);

  std::vector<StepRecord> steps(int rank) const;
  std::map<std::string, torch::Tensor> params(int rank) const;
  // The parameters right before the first step (after a resume's load).
  std::map<std::string, torch::Tensor> initialParams(int rank) const;
  double evalLoss(int rank) const;  // what train_gpt's final evaluate() returned
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::map<std::string, torch::Tensor> readTensors(int rank, const std::string& kind) const;  // rank<r>_<kind>.pt
  std::filesystem::path dir_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
  std::vector<ChildProcess> workers_;
};

std::filesystem::path trainGptBinary();

// Waits for every worker and REQUIREs exit code 0, showing the failing
// worker's stderr. For Catch2 test cases only.
void requireAllSucceeded(WorkerJob& job, std::chrono::seconds timeout = std::chrono::seconds(120));

}  // namespace varuna::test
