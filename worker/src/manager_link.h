// ManagerLink: the worker's connection to run_varuna. A background thread says
// hello (job token, rank, generation), sends a heartbeat every interval and
// forwards step reports and checkpoint failures queued by the runtime. The
// training never waits on it: if the manager is unreachable the link retries
// quietly (the agent, not the worker, reacts to a lost manager). What is
// queued when the link is destroyed is still sent if the connection is up
// (a worker that ends normally reports its last failure). Owned by Varuna.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "varuna/common/protocol.h"
#include "varuna/worker/varuna.h"

namespace varuna {

class ManagerLink {
 public:
  ManagerLink(ManagerLinkOptions options, int rank);
  ~ManagerLink();
  ManagerLink(const ManagerLink&) = delete;
  ManagerLink& operator=(const ManagerLink&) = delete;

  // Called from the training thread after each step; never blocks on I/O.
  void reportStep(const proto::StepReport& report);
  void setStep(int64_t step);
  // A periodic checkpoint of `step` failed (ENOSPC, EIO) and training goes on.
  // Callable from any thread (the training thread or a background checkpoint
  // copy); never blocks on I/O. `error` is cut to proto::kMaxErrorTextBytes.
  void reportCheckpointFailure(int64_t step, const std::string& error);

 private:
  void run();

  ManagerLinkOptions options_;
  int rank_;
  std::mutex mutex_;  // guards the members below it (the link thread and the callers)
  std::condition_variable wake_;
  std::deque<proto::StepReport> queue_;
  std::deque<proto::CheckpointFailed> failures_;
  int64_t step_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace varuna
