// WorkerRegistry: the workers of the running generation, as the manager sees
// them (connected or not, last heard from, last step, whether they wait on a
// peer), and the connections of workers ordered out (ExitNow), kept until the
// worker's exit closes them. Ending a generation reaches its workers over
// their own connections, whatever their agents' state (frozen, dead, cut off).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "loop/framed_connection.h"
#include "varuna/manager/planner.h"

namespace varuna {

struct WorkerState {
  using TimePoint = std::chrono::steady_clock::time_point;
  std::shared_ptr<FramedConnection> connection;
  TimePoint lastSeen{};
  bool connected = false;
  int64_t step = -1;     // the last finished step it reported (heartbeat or step report)
  bool waiting = false;  // its last heartbeat: blocked on a peer, not computing
};

class WorkerRegistry {
 public:
  using TimePoint = WorkerState::TimePoint;
  WorkerRegistry() = default;
  // byRank_ points into workers_: a copy would point into the original's.
  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;

  // A launch: every rank of `plan` expected, none connected yet.
  void expect(const Plan& plan);
  // No worker counts any more (a launch being prepared, a generation over).
  void clear() {
    workers_.clear();
    byRank_.clear();
    connected_ = 0;
  }

  bool expects(int rank) const { return workers_.count(rank) > 0; }
  WorkerState* find(int rank);
  const WorkerState* find(int rank) const;
  // Its hello: true once every expected rank has connected.
  bool connect(int rank, const std::shared_ptr<FramedConnection>& connection, TimePoint now);
  // A rank that is gone (exited, written off): nothing it sends counts.
  void forget(int rank);
  size_t size() const { return workers_.size(); }
  // Expected ranks without a hello yet; O(1) (asked at every hello).
  size_t unconnected() const { return workers_.size() - connected_; }
  const std::map<int, WorkerState>& all() const { return workers_; }

  // ExitNow over the worker's own connection; after it nothing the worker
  // sends counts. The connection is kept until the worker's exit closes it.
  void orderOut(const std::shared_ptr<FramedConnection>& connection, int generation, const std::string& reason);
  // That rank ordered out and forgotten.
  void orderRankOut(int rank, int generation, const std::string& reason);
  // The ranks placed on `host` ordered out and forgotten.
  void orderHostOut(const std::string& host, const Plan& plan, int generation, const std::string& reason);
  // The generation is over: every connected worker is ordered out, and all
  // are forgotten (a worker of it that says hello again is ordered out too).
  // Returns how many were ordered.
  size_t orderAllOut(int generation, const std::string& reason);
  // Leaving the loop: connections of the generation closed, exit orders
  // sent first (a worker that misses one exits after its grace).
  void closeAll(const std::string& reason);

 private:
  // Ranks this far are found through byRank_: a relay's beats and reports
  // look up 10 000 ranks a second on a big job, and a tree walk per lookup
  // showed in the manager's profile. Others (never a plan's) go to the tree.
  static constexpr int kMaxIndexedRank = 1 << 20;
  WorkerState& insert(int rank);
  void erase(std::map<int, WorkerState>::iterator it);

  std::map<int, WorkerState> workers_;  // ordered by rank: the watchdog walks it beside the running set
  std::vector<WorkerState*> byRank_;    // rank -> its node in workers_, nullptr if none
  size_t connected_ = 0;  // of workers_, those with connected set
  std::set<std::shared_ptr<FramedConnection>> exitOrdered_;
};

}  // namespace varuna
