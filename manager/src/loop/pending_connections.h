// PendingConnections: run_varuna's accepted connections that have not said
// hello yet (unauthenticated: anyone who can reach the port). Bounds what
// they can cost: at most `maxPending` of them, plus as many as the daemon is
// waiting for (agents it is starting, workers it launched that have not said
// hello: a launch of 1000 workers is a legitimate burst); at the cap the
// OLDEST is closed to admit the new one. Each gets `helloDeadline` to send
// its hello (expire(), called by the daemon's tick, closes the late ones).
//
// Why the oldest goes: every real peer (agent, worker, notifier) sends its
// hello the moment it connects, so it is pending for a round trip; what sits
// pending for long is idle or trickling. Refusing the newest instead would let
// `maxPending` idle sockets, renewed every deadline, lock every real peer out;
// closing the oldest means a flood must outpace a peer's first round trip to
// starve it.
//
// Owned by the ManagerDaemon; event-loop thread only. Closing a connection
// calls its onClose, which may call erase() on this object: every method
// removes a connection before closing it, so that re-entry is harmless.
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>

#include "loop/framed_connection.h"
#include "varuna/manager/pending_limits.h"

namespace varuna {

class PendingConnections {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  explicit PendingConnections(PendingLimits limits = {}) : limits_(limits) {}

  // Admits a connection accepted at `now` (and limits its first frame). At
  // the cap, maxPending + expectedPeers, closes the oldest pending one first
  // ("evicted").
  void add(const std::shared_ptr<FramedConnection>& connection, TimePoint now, size_t expectedPeers = 0);
  // It said hello, or closed: no longer pending. Unknown ones are ignored.
  void erase(const std::shared_ptr<FramedConnection>& connection);
  // Closes every connection pending for longer than the hello deadline;
  // returns how many.
  size_t expire(TimePoint now);
  // Closes the oldest pending connection (to free a descriptor when accept
  // fails with EMFILE); false if there is none.
  bool shedOldest(const std::string& reason);
  // Closes every pending connection (the manager exits).
  void closeAll(const std::string& reason);

  size_t size() const { return order_.size(); }
  bool empty() const { return order_.empty(); }
  const PendingLimits& limits() const { return limits_; }
  // Totals since start: closed over the cap, closed past the deadline.
  uint64_t evicted() const { return evicted_; }
  uint64_t expired() const { return expired_; }

 private:
  struct Entry {
    std::shared_ptr<FramedConnection> connection;
    TimePoint acceptedAt;
  };
  // Removes and closes the oldest entry.
  void closeOldest(const std::string& reason);

  PendingLimits limits_;
  std::list<Entry> order_;  // oldest first: accept order is deadline order
  std::unordered_map<const FramedConnection*, std::list<Entry>::iterator> index_;
  uint64_t evicted_ = 0;
  uint64_t expired_ = 0;
};

}  // namespace varuna
