// ManagerLink: the worker's connection to run_varuna. A background thread says
// hello (job token, rank, generation), sends a heartbeat every interval and
// forwards step reports queued by the training thread. The training never
// waits on it: if the manager is unreachable the link retries quietly
// (the agent, not the worker, reacts to a lost manager). Owned by Varuna.
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

 private:
  void run();

  ManagerLinkOptions options_;
  int rank_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<proto::StepReport> queue_;
  int64_t step_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace varuna
