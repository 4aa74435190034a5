// BlockedOnPeers: marks the training thread as blocked on a peer (a c10d
// receive or send wait, an all-reduce or broadcast wait, a rendezvous-store
// barrier, waiting for the other ranks' checkpoint parts) for the scope of the
// wait. ManagerLink's heartbeats carry the flag (`waiting`), which is how
// run_varuna tells a hung rank (its step stalls while it computes) from the
// peers it holds up (they wait).
//
// The flag is owned by Varuna::Impl and outlives the Communicator and the
// ManagerLink that point at it. Written by the training thread only, read by
// the link thread: relaxed atomics (a heartbeat samples it; no ordering with
// other data is needed), a few nanoseconds per wait. Scopes nest: the
// outermost one restores false. A null flag (the profiler's communicator, a
// test) makes the scope a no-op.
#pragma once

#include <atomic>

namespace varuna {

class BlockedOnPeers {
 public:
  explicit BlockedOnPeers(std::atomic<bool>* flag)
      : flag_(flag), previous_(flag && flag->exchange(true, std::memory_order_relaxed)) {}
  ~BlockedOnPeers() {
    if (flag_) flag_->store(previous_, std::memory_order_relaxed);
  }
  BlockedOnPeers(const BlockedOnPeers&) = delete;
  BlockedOnPeers& operator=(const BlockedOnPeers&) = delete;

 private:
  std::atomic<bool>* flag_;
  bool previous_;
};

}  // namespace varuna
