#include "daemon/worker_registry.h"

#include "varuna/common/protocol.h"

namespace varuna {

void WorkerRegistry::expect(const Plan& plan) {
  clear();
  for (const auto& p : plan.placement) insert(p.rank);
}

WorkerState& WorkerRegistry::insert(int rank) {
  auto [it, inserted] = workers_.try_emplace(rank);
  if (inserted && rank >= 0 && rank < kMaxIndexedRank) {
    if (static_cast<size_t>(rank) >= byRank_.size()) byRank_.resize(static_cast<size_t>(rank) + 1, nullptr);
    byRank_[static_cast<size_t>(rank)] = &it->second;  // a map's nodes stay where they are
  }
  return it->second;
}

WorkerState* WorkerRegistry::find(int rank) {
  return const_cast<WorkerState*>(static_cast<const WorkerRegistry*>(this)->find(rank));
}

const WorkerState* WorkerRegistry::find(int rank) const {
  if (rank >= 0 && rank < kMaxIndexedRank) {
    return static_cast<size_t>(rank) < byRank_.size() ? byRank_[static_cast<size_t>(rank)] : nullptr;
  }
  auto it = workers_.find(rank);
  return it == workers_.end() ? nullptr : &it->second;
}

bool WorkerRegistry::connect(int rank, const std::shared_ptr<FramedConnection>& connection, TimePoint now) {
  WorkerState& worker = insert(rank);
  // A second hello of a connected rank (its process reconnected while the
  // old connection still looks open, e.g. half-open after a link cut): the
  // newer connection is the one that counts; the old one must not feed
  // heartbeats or step reports of its own.
  if (worker.connection && worker.connection != connection && worker.connection->open()) {
    worker.connection->close("replaced by a newer connection of the same rank");
  }
  worker.connection = connection;
  worker.lastSeen = now;
  if (!worker.connected) ++connected_;
  worker.connected = true;
  return unconnected() == 0;
}

void WorkerRegistry::erase(std::map<int, WorkerState>::iterator it) {
  if (it->second.connected) --connected_;
  if (it->first >= 0 && static_cast<size_t>(it->first) < byRank_.size()) byRank_[static_cast<size_t>(it->first)] = nullptr;
  workers_.erase(it);
}

void WorkerRegistry::forget(int rank) {
  if (auto it = workers_.find(rank); it != workers_.end()) erase(it);
}

void WorkerRegistry::orderOut(const std::shared_ptr<FramedConnection>& connection, int generation,
                              const std::string& reason) {
  if (!connection || !connection->open() || exitOrdered_.count(connection)) return;
  connection->send(proto::ExitNow{generation, reason});
  exitOrdered_.insert(connection);
  std::weak_ptr<FramedConnection> weak = connection;
  connection->start([](const proto::Message&) {},
                    [this, weak](const std::string&) {
                      if (auto c = weak.lock()) exitOrdered_.erase(c);  // `c` keeps it alive through the erase
                    });
}

void WorkerRegistry::orderRankOut(int rank, int generation, const std::string& reason) {
  auto it = workers_.find(rank);
  if (it == workers_.end()) return;
  orderOut(it->second.connection, generation, reason);
  erase(it);
}

void WorkerRegistry::orderHostOut(const std::string& host, const Plan& plan, int generation,
                                  const std::string& reason) {
  for (auto it = workers_.begin(); it != workers_.end();) {
    const bool onHost = it->first < static_cast<int>(plan.placement.size()) && plan.placement[it->first].host == host;
    if (!onHost) {
      ++it;
      continue;
    }
    orderOut(it->second.connection, generation, reason);
    erase(it++);
  }
}

size_t WorkerRegistry::orderAllOut(int generation, const std::string& reason) {
  size_t ordered = 0;
  for (const auto& [rank, worker] : workers_) {
    if (!worker.connection || !worker.connection->open() || exitOrdered_.count(worker.connection)) continue;
    orderOut(worker.connection, generation, reason);
    ++ordered;
  }
  clear();
  return ordered;
}

void WorkerRegistry::closeAll(const std::string& reason) {
  for (auto& [rank, worker] : workers_) {
    if (worker.connection) worker.connection->close(reason);
  }
  for (const auto& c : std::set<std::shared_ptr<FramedConnection>>(exitOrdered_)) c->closeAfterSending(reason);
}

}  // namespace varuna
