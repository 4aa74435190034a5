// Communicator: this worker's c10d process groups and the failure detector.
//
// Owned by Varuna::Impl; used from the training thread only (c10d's own
// threads run the asynchronous work). Tensors move only through c10d backends:
// ProcessGroupGloo for CPU tensors, ProcessGroupNCCL or ProcessGroupGloo for
// CUDA tensors (CommOptions::backend). Gloo's collectives take CUDA tensors
// themselves; its send and receive read and write host memory, so with Gloo a
// CUDA tensor sent is copied into a pinned host buffer first, and one received
// lands in such a buffer and is copied to the device when its wait completes
// (waitFor): every point-to-point transfer must be waited on through waitFor.
//
// Matching: NCCL pairs point-to-point messages by their order between two
// ranks and ignores tags; Gloo pairs them by tag. The pipeline issues its
// messages in an order both ends agree on (varuna/common/step_messages.h),
// so either works. VARUNA_P2P_MATCH_BY_ORDER=1 makes Gloo match by order as
// NCCL does (every tag 0): the CPU tests run the pipeline so, to prove on
// CPUs that the order a multi-GPU job issues pairs the right messages.
//
// Failure handling: every wait goes through waitFor(), which turns a c10d error
// or timeout into PeerLostError naming the lost rank. interrupt() (from any
// thread: the manager link, on the manager's salvage order) ends the wait
// under way and every later one with PeerLostError: a survivor blocked on a
// peer that is itself alive but stopped (salvaging) would otherwise wait for
// the whole timeout. The name comes from
// PeerMonitor: each rank bumps a heartbeat counter in the rendezvous store, and
// the first rank that diagnoses a failure records it there so every other rank
// reports the same culprit instead of the neighbour that merely exited.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "varuna/common/errors.h"
#include "varuna/common/stage_map.h"
#include "varuna/worker/devices.h"

namespace varuna {

struct CommOptions {
  std::string masterAddr;
  int masterPort = 0;
  std::string bindAddr;  // Gloo's address on this host; empty: loopback jobs bind loopback, others the host name's
  bool hostStore = false;  // this process hosts the TCPStore
  int rank = 0;
  int worldSize = 1;
  torch::Device device = torch::kCPU;
  CommBackend backend = CommBackend::kAuto;  // resolved against `device` by the Communicator
  // Point-to-point through host buffers even for CPU tensors: the staging
  // path of a Gloo job on CUDA, exercised by the CPU tests.
  bool stageThroughHost = false;
  std::chrono::milliseconds timeout{60000};
  std::chrono::milliseconds heartbeatInterval{200};
  // Set while the calling (training) thread waits on peers (BlockedOnPeers);
  // null: not tracked. Must outlive the Communicator.
  std::atomic<bool>* waitingOnPeers = nullptr;
};

// Heartbeats and post-mortem diagnosis through the rendezvous store.
class PeerMonitor {
 public:
  PeerMonitor(c10::intrusive_ptr<c10d::Store> store, int rank, int worldSize,
              std::chrono::milliseconds interval, std::function<std::string(int)> describeRank);
  ~PeerMonitor();

  // Records this rank's own failure (first writer wins) so peers can name it.
  void recordFailure(const std::string& message);
  // Works out which rank is gone after `cause` and returns the error to throw.
  PeerLostError diagnose(const std::string& during, const std::string& cause);

  // For long waits on peers that may be busy (the profiler): each rank's
  // heartbeat count, and whether some rank recorded a failure. Throw if the
  // store is unreachable.
  std::vector<int64_t> readHeartbeats();
  bool failureRecorded();
  // Ends a diagnosis's wait for heartbeats, now and later (it then returns a
  // PeerLostError saying so); heartbeats go on. Its store calls (and the
  // short wait for a failure another rank is recording) are not cut short.
  // Any thread.
  void interrupt();

 private:
  void run();

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int worldSize_;
  std::chrono::milliseconds interval_;
  std::function<std::string(int)> describeRank_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  bool interrupted_ = false;  // guarded by mutex_, like stop_
  std::thread thread_;
};

class Communicator {
 public:
  Communicator(const CommOptions& options, const StageToRankMap& map);
  ~Communicator();

  int rank() const { return options_.rank; }
  CommBackend backend() const { return options_.backend; }  // resolved: kGloo or kNccl
  // Point-to-point messages pair by tag (Gloo, unless VARUNA_P2P_MATCH_BY_ORDER).
  bool matchesByTag() const { return options_.backend == CommBackend::kGloo && !matchByOrder_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // The whole job (point-to-point uses global ranks through it).
  const c10::intrusive_ptr<c10d::Backend>& world() const { return world_; }
  // A group over `ranks` (which must contain this rank), created on first use
  // under `name`; every member must ask for it in the same order.
  const c10::intrusive_ptr<c10d::Backend>& group(const std::string& name, const std::vector<int>& ranks);

  c10::intrusive_ptr<c10d::Work> send(torch::Tensor& tensor, int dstRank, int tag);
  c10::intrusive_ptr<c10d::Work> recv(torch::Tensor& tensor, int srcRank, int tag);

  // Waits; converts any c10d failure into PeerLostError (see header comment).
  // The training thread counts as blocked on peers meanwhile (CommOptions::
  // waitingOnPeers), as it does in agreeOnStartup and while joining a group.
  void waitFor(const c10::intrusive_ptr<c10d::Work>& work, const char* during);

  // For waits on peers outside this class (a store read another rank must
  // write first): holds CommOptions::waitingOnPeers for the scope.
  std::atomic<bool>* waitingOnPeersFlag() const { return options_.waitingOnPeers; }

  // Store-based all-ranks check used at start-up: every rank publishes "" (ok)
  // or an error message; throws ConfigError with the first error found.
  void agreeOnStartup(const std::string& key, const std::string& myError);

  // Ends every current and later waitFor with PeerLostError(`reason`) (a
  // collective that completed meanwhile still counts). Any thread;
  // idempotent (the first reason stays).
  void interrupt(const std::string& reason);
  bool interrupted() const { return interrupted_.load(); }
  PeerLostError interruption(const std::string& during) const;

  // Called when this rank fails for a local reason, before rethrowing.
  void recordFailure(const std::string& message);
  // How the destructor leaves the job: only a rank that finished cleanly (and
  // was not abandoned) says so and, if it hosts the store, waits for the
  // others; otherwise it leaves at once, touching nothing.
  void finishedCleanly() { finishedCleanly_ = true; }
  void abandon() { abandoned_ = true; }
  PeerMonitor& monitor() { return *monitor_; }

 private:
  c10::intrusive_ptr<c10d::Backend> makeBackend(const std::string& prefix, int groupRank, int groupSize);
  std::string describeRank(int rank) const;
  void refuseSharedGpus();
  // What a failed wait or call on peers throws: the interruption once
  // interrupt() ran (before or during the diagnosis), else the monitor's
  // diagnosis of which peer is gone.
  PeerLostError lostPeer(const std::string& during, const std::string& cause);
  // Point-to-point staging (see the header comment): whether `tensor` travels
  // through a host buffer, the buffer, and the copy a completed receive owes.
  bool staged(const torch::Tensor& tensor) const;
  static torch::Tensor hostBufferFor(const torch::Tensor& tensor);
  void leave() noexcept;
  // waitFor's two ways to wait interruptibly: Gloo's point-to-point work has
  // no future but can be aborted; collectives complete a future
  // (waitOnFuture: false when interrupted before it completed).
  void waitAbortable(const c10::intrusive_ptr<c10d::Work>& work);
  bool waitOnFuture(const c10::intrusive_ptr<c10d::Work>& work, const c10::intrusive_ptr<c10::ivalue::Future>& future);

  // Interruption (interrupt()): the flag and reason, the point-to-point work
  // being waited on (aborted), and the wake-up of a future wait. The wake-up
  // is shared with futures' callbacks, which may run after a wait gave up.
  struct Wakeup {
    std::mutex mutex;
    std::condition_variable cv;
  };
  std::atomic<bool> interrupted_{false};
  std::shared_ptr<Wakeup> wakeup_ = std::make_shared<Wakeup>();
  mutable std::mutex interruptMutex_;  // guards the two below
  std::string interruptReason_;
  c10::intrusive_ptr<c10d::Work> abortable_;

  // Receives into host buffers not yet copied to their device tensors, by
  // work (held, so its address is not reused while listed).
  struct StagedReceive {
    c10::intrusive_ptr<c10d::Work> work;
    torch::Tensor host;
    torch::Tensor target;
  };
  std::map<const c10d::Work*, StagedReceive> stagedReceives_;
  std::optional<StagedReceive> takeStagedReceive(const c10::intrusive_ptr<c10d::Work>& work);

  CommOptions options_;
  StageToRankMap map_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> world_;
  std::map<std::string, c10::intrusive_ptr<c10d::Backend>> groups_;
  std::unique_ptr<PeerMonitor> monitor_;
  bool finishedCleanly_ = false;
  bool abandoned_ = false;
  bool matchByOrder_ = false;  // VARUNA_P2P_MATCH_BY_ORDER: every point-to-point tag 0
};

}  // namespace varuna
