// SimCluster's queries: what tests and the bench ask of the simulated
// cluster (orders it got, workers alive, steps reached).
#include "sim_cluster.h"
#include "sim_cluster_state.h"

#include <algorithm>

namespace varuna::sim {

// --- queries --------------------------------------------------------------------------------

std::vector<Order> SimCluster::ordersTo(PeerKind kind, const std::string& host, const std::string& type) const {
  std::vector<Order> out;
  for (const auto& o : orders_) {
    if (o.to == kind && (host.empty() || o.host == host) && (type.empty() || o.type == type)) out.push_back(o);
  }
  return out;
}

size_t SimCluster::count(PeerKind kind, const std::string& type, const std::string& host) const {
  return static_cast<size_t>(std::count_if(orders_.begin(), orders_.end(), [&](const Order& o) {
    return o.to == kind && o.type == type && (host.empty() || o.host == host);
  }));
}

std::vector<proto::LaunchWorkers> SimCluster::launchesTo(const std::string& host) const {
  std::vector<proto::LaunchWorkers> out;
  for (const auto& o : orders_) {
    if (o.to != PeerKind::kAgent || o.host != host) continue;
    if (const auto* launch = std::get_if<proto::LaunchWorkers>(&o.message)) out.push_back(*launch);
  }
  return out;
}

bool SimCluster::workerGot(const std::string& type, int rank, int generation) const {
  return std::any_of(orders_.begin(), orders_.end(), [&](const Order& o) {
    return o.to == PeerKind::kWorker && o.type == type && o.rank == rank && o.generation == generation;
  });
}

bool SimCluster::agentUp(const std::string& host) const {
  auto agent = findAgent(host);
  return agent && agent->state == Agent::State::kUp;
}

bool SimCluster::takeStartFailure(const std::string& host) {
  auto it = failNext_.find(host);
  if (it == failNext_.end() || it->second == 0) return false;
  --it->second;
  return true;
}

int SimCluster::agentStarts(const std::string& host) const { return static_cast<int>(agentStartTimes(host).size()); }

std::vector<TimePoint> SimCluster::agentStartTimes(const std::string& host) const {
  auto it = startAttempts_.find(host);
  return it == startAttempts_.end() ? std::vector<TimePoint>{} : it->second;
}

int SimCluster::worldSize(int generation) const {
  auto it = generations_.find(generation);
  return it == generations_.end() ? 0 : it->second.worldSize;
}

int SimCluster::liveWorkers(int generation) const {
  int n = 0;
  for (const auto& [key, w] : workers_) n += key.first == generation ? 1 : 0;
  return n;
}

int SimCluster::connectedWorkers(int generation) const {
  int n = 0;
  for (const auto& [key, w] : workers_) n += key.first == generation && w->state == Worker::State::kUp ? 1 : 0;
  return n;
}

int SimCluster::welcomedWorkers(int generation) const {
  int n = 0;
  for (const auto& [key, w] : workers_) n += key.first == generation && w->welcomed ? 1 : 0;
  return n;
}

int64_t SimCluster::minStep(int generation) const {
  std::optional<int64_t> lowest;
  for (const auto& [key, w] : workers_) {
    if (key.first == generation) lowest = std::min(lowest.value_or(w->step), w->step);
  }
  return lowest.value_or(-2);
}

int64_t SimCluster::step(int rank) const {
  auto w = find(rank, newestGeneration_);
  return w ? w->step : -2;
}

std::vector<int> SimCluster::liveRanks(int generation) const {
  std::vector<int> ranks;
  for (const auto& [key, w] : workers_) {
    if (key.first == generation) ranks.push_back(key.second);
  }
  return ranks;
}

bool SimCluster::sendFromWorker(int rank, std::string_view frame) {
  auto w = find(rank, newestGeneration_);
  if (!w || w->state != Worker::State::kUp || w->processFrozen) return false;
  return send(*w->peer, frame);
}

}  // namespace varuna::sim
