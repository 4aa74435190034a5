// The simulated agents' and workers' state: private to sim_cluster.cpp, which
// runs them, and sim_cluster_queries.cpp, which answers what tests ask.
#pragma once

#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sim_cluster.h"

namespace varuna::sim {

struct SimCluster::Agent {
  enum class State { kConnecting, kUp, kFrozen, kGone };
  std::string host;
  std::shared_ptr<SimPeer> peer;
  State state = State::kConnecting;
  int generation = -1;  // of its latest launch
  std::vector<std::shared_ptr<Worker>> workers;  // alive
  std::vector<proto::WorkerExited> held;         // reports of a frozen agent
  TimePoint nextHeartbeat;
  std::map<int, proto::WorkerBeat> pendingBeats;  // the newest beat of each worker since the last relay
  std::vector<proto::StepReport> pendingReports;  // every step report since then (reportsThroughAgent)
  TimePoint nextBeatForward;
  TimePoint lastRelay{};  // a heartbeat due within a relay interval (+100 ms) of it is left out
  std::optional<TimePoint> killWorkersAt;  // lost the manager: its grace
  bool expectClose = false;  // the manager's close follows an order (Shutdown, a refusal)
};

struct SimCluster::Worker {
  enum class State { kStarting, kConnecting, kUp, kExited };
  std::string host;
  int rank = 0, generation = 0, stage = 0, replica = 0, worldSize = 1;
  bool stray = false;  // connectStaleWorker: no agent, no launch
  std::weak_ptr<Agent> agent;
  std::shared_ptr<SimPeer> peer;
  State state = State::kStarting;
  bool dialling = false;  // counted in dialling_ until its hello went or its connection closed
  bool welcomed = false;
  bool ordered = false;  // an ExitNow or a refusal came: the close that follows is expected
  bool progressFrozen = false, processFrozen = false;
  bool checkpointing = false;
  int64_t step = -1;  // the last finished step
  double computeSeconds = 0.05;  // per micro-batch: this "machine's" speed
  TimePoint startAt;
  // Never, until set: a heartbeat from the hello on, steps from the rendezvous.
  TimePoint nextHeartbeat = TimePoint::max(), nextStep = TimePoint::max();
  std::optional<TimePoint> exitAt;  // a checkpoint, the lost-manager grace
  TimePoint wakeAt = TimePoint::max();  // its entry in wakes_ (max: none)
  int exitCode = 0;
  std::chrono::milliseconds lostManagerGrace{15000};  // until the Welcome says otherwise
  std::string heartbeatFrame;  // encoded Heartbeat{rank, frameStep, frameWaiting}
  bool directBeatSent = false;  // its first heartbeat after the hello (to the manager) went out
  int64_t frameStep = std::numeric_limits<int64_t>::min();
  bool frameWaiting = false;
};

}  // namespace varuna::sim
