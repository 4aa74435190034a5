// SalvageManager: run_varuna's part in a salvage (docs/salvage.md), played
// for a WorkerJob on loopback without run_varuna, so the worker side of a
// salvage runs where the manager is not built (the GPU node's worker-only
// build). It welcomes each worker with salvage on and answers its pings; once
// a worker is lost (its connection drops, or a survivor reports first) it
// stops the survivors (SalvageStop), collects their reports, picks the step
// and the writers with the manager's own chooseSalvage, orders the writes
// and orders the other survivors out, as ManagerDaemon does.
//
// One thread of its own serves every connection; the test reads the outcome.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fake_manager.h"
#include "varuna/manager/salvage_choice.h"
#include "worker_job.h"

namespace varuna::test {

class SalvageManager {
 public:
  SalvageManager(int worldSize, int stages, std::chrono::milliseconds salvageTimeout);
  ~SalvageManager();
  SalvageManager(const SalvageManager&) = delete;

  // What a worker needs to dial this manager (WorkerJobSpec::env).
  std::map<std::string, std::string> workerEnvironment() const;
  // The salvage's choice once it was ordered within `timeout`, else nullopt
  // (no loss yet, or no step every stage holds).
  std::optional<SalvageChoice> waitForChoice(std::chrono::milliseconds timeout);
  std::vector<SalvageReport> reports() const;
  // Why it could not choose, if it could not.
  std::string failure() const;

 private:
  struct Worker {
    FakePeer peer;
    int rank = -1;  // -1 until its hello
    bool lost = false;
  };
  void serve();  // the thread: serveUntilQuit, its failure kept for the test
  void serveUntilQuit();
  void serveOne(Worker& worker);
  void handle(Worker& worker, const proto::Message& message);
  void stopSurvivors(const std::string& reason);
  void orderWrites();

  static constexpr int kGeneration = 1;
  const int worldSize_;
  const int stages_;
  const std::chrono::milliseconds salvageTimeout_;
  FakeManager listener_;
  std::vector<Worker> workers_;  // the serving thread's alone
  bool stopped_ = false;         // SalvageStop sent
  std::chrono::steady_clock::time_point stoppedAt_;

  mutable std::mutex mutex_;  // guards what the test reads
  std::condition_variable decided_;
  std::vector<SalvageReport> reports_;
  std::optional<SalvageChoice> choice_;
  std::string failure_;
  std::atomic<bool> quit_{false};
  std::thread thread_;
};

// The whole flow on `trainArgs` (the device, the backend, the model): a 2x2
// job with a SalvageManager trains until rank 3 (stage 1, replica 1) has
// finished a few steps, is killed with SIGKILL, and the survivors salvage.
// REQUIREs: no step lost (the salvaged step is the newest any rank finished),
// the writers exit kExitSalvaged and the others kExitSuperseded, and a job
// resumed from the salvaged step trains the next steps as a job that was
// never interrupted does (losses and parameters within `rtol`; 0: equal).
void requireKillSalvagedWithNoStepLost(const std::vector<std::string>& trainArgs, const std::filesystem::path& dir,
                                       double rtol);

}  // namespace varuna::test
