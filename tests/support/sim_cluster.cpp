#include "sim_cluster.h"
#include "sim_cluster_state.h"

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/control_client.h"
#include "varuna/common/errors.h"
#include "varuna/manager/credentials.h"

namespace varuna::sim {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

const char* toString(PeerKind kind) {
  switch (kind) {
    case PeerKind::kAgent: return "agent";
    case PeerKind::kWorker: return "worker";
    case PeerKind::kNotifier: return "notifier";
  }
  return "?";
}

namespace {

// The first time >= now of epoch + interval x (fraction + k): beats of N
// peers spread evenly over the period.
TimePoint phased(TimePoint epoch, std::chrono::milliseconds interval, double fraction,
                         TimePoint now) {
  const auto offset = std::chrono::duration_cast<Duration>(interval * fraction);
  auto t = epoch + offset;
  if (t >= now) return t;
  const auto periods = (now - t) / interval + 1;
  return t + periods * std::chrono::duration_cast<Duration>(interval);
}

}  // namespace

SimCluster::SimCluster(asio::io_context& io, SimOptions options, varuna::Clock& clock)
    : io_(io), clock_(clock), options_(options), tickTimer_(clock.makeTimer(io)), gate_(std::make_shared<LaunchGate>()) {
  gate_->cluster = this;
  scheduleTick();
}

SimCluster::~SimCluster() { shutdown(); }

void SimCluster::shutdown() {
  if (shutDown_) return;
  shutDown_ = true;
  gate_->cluster = nullptr;
  gate_->closed = true;
  tickTimer_->cancel();
  for (auto& [host, agent] : agents_) {
    if (agent->peer) agent->peer->close();
    agent->state = Agent::State::kGone;
    agent->workers.clear();
  }
  for (auto& [key, worker] : workers_) {
    if (worker->peer) worker->peer->close();
    worker->state = Worker::State::kExited;
  }
  for (auto& worker : strays_) {
    if (worker->peer) worker->peer->close();
  }
  for (auto& notifier : notifiers_) notifier->close();
  workers_.clear();
  strays_.clear();
  notifiers_.clear();
}

void SimCluster::setManager(const std::string& managerAddress) {
  if (options_.localNetwork) return;  // dialled in memory: the daemon has no port to name
  const auto [ip, port] = proto::splitHostPort(managerAddress, "the manager address");
  manager_ = tcp::endpoint(asio::ip::make_address(ip), static_cast<uint16_t>(port));
}

// --- agents ----------------------------------------------------------------------------------

void SimCluster::startAgent(const std::string& host, const std::string& managerAddress, const std::string& token,
                            std::function<void(bool, const std::string&)> onResult) {
  countStartAttempt(host);
  auto result = std::make_shared<std::function<void(bool, const std::string&)>>(std::move(onResult));
  auto answer = [result](bool ok, const std::string& error) {
    if (!*result) return;
    auto callback = std::move(*result);
    *result = nullptr;
    callback(ok, error);
  };
  if (shutDown_) return answer(false, "the simulated cluster is shut down");
  try {
    setManager(managerAddress);
  } catch (const std::exception& e) {
    return answer(false, e.what());
  }
  if (auto old = findAgent(host); old && old->state != Agent::State::kGone) {
    // As varuna_agent stops the agent an earlier start left (agent.pid).
    old->expectClose = true;
    killAgentWorkers(*old, /*report=*/false);
    closeAgent(*old);
  }
  credentials_[host] = token;  // the host's agent credential, as varuna_agent holds it
  auto agent = std::make_shared<Agent>();
  agent->host = host;
  agent->peer = std::make_shared<SimPeer>(io_, options_.localNetwork);
  agents_[host] = agent;
  std::weak_ptr<Agent> weak = agent;
  agent->peer->connect(
      manager_, proto::Hello{proto::kVersion, token, "agent", host, -1, -1},
      [this, weak](const proto::Message& m) {
        if (auto a = weak.lock()) onAgentMessage(a, m);
      },
      [this, weak, answer](const std::string& reason) {
        auto a = weak.lock();
        if (!a) return;
        if (a->state == Agent::State::kConnecting) answer(false, "cannot reach the manager: " + reason);
        onAgentClosed(a, reason);
      },
      [this, weak, answer] {
        auto a = weak.lock();
        if (!a) return;
        ++framesSent_;  // the hello
        a->state = Agent::State::kUp;
        // Agents' beats spread over the period whatever their number (golden-ratio phases).
        const double phase = std::fmod(0.6180339887 * static_cast<double>(agentsConnected_++), 1.0);
        a->nextHeartbeat = clock_.now() + std::chrono::duration_cast<Duration>(options_.agentHeartbeat * phase);
        // Relays phased too, as varuna_agent's (protocol.h, firstRelayDelay).
        a->nextBeatForward = clock_.now() + proto::firstRelayDelay(options_.agentBeatForward, phase);
        wakeAgentsBy(a->nextHeartbeat);
        answer(true, "");
        if (callbacks_.onAgentUp) callbacks_.onAgentUp(a->host);
      });
}

void SimCluster::onAgentMessage(const std::shared_ptr<Agent>& agent, const proto::Message& message) {
  const auto* launchOrder = std::get_if<proto::LaunchWorkers>(&message);
  record(PeerKind::kAgent, agent->host, -1, launchOrder ? launchOrder->generation : agent->generation, message);
  const Order order = orders_.back();  // a copy: acting on it may record more
  if (launchOrder) {
    launch(agent, *launchOrder);
  } else if (std::holds_alternative<proto::CheckpointAndExit>(message)) {
    const auto now = clock_.now();
    for (const auto& w : std::vector<std::shared_ptr<Worker>>(agent->workers)) {
      Generation* gen = generationOf(w->generation);
      if (gen && gen->stalled()) continue;  // blocked on a peer: no step finishes, no checkpoint
      // The step every rank has finished: the ranks' parts make one checkpoint.
      if (gen && !gen->checkpointStep) gen->checkpointStep = minStep(w->generation);
      w->checkpointing = true;
      w->exitCode = kExitCheckpointed;
      w->exitAt = now + options_.checkpointDelay;
      if (options_.checkpointDelay.count() == 0) {
        exitWorker(w, writeCheckpoint(*w), 0);
      } else {
        schedule(w);
      }
    }
  } else if (std::holds_alternative<proto::KillWorkers>(message)) {
    killAgentWorkers(*agent, /*report=*/true);
  } else if (std::holds_alternative<proto::Shutdown>(message)) {
    killAgentWorkers(*agent, /*report=*/true);
    agent->expectClose = true;
    closeAgent(*agent);
  } else if (const auto* ack = std::get_if<proto::Ack>(&message); ack && !ack->ok) {
    // Refused (a host not listed, or one that has an agent): it exits at once.
    agent->expectClose = true;
    killAgentWorkers(*agent, /*report=*/false);
    closeAgent(*agent);
  }
  if (callbacks_.onOrder) callbacks_.onOrder(order);
}

void SimCluster::onAgentClosed(const std::shared_ptr<Agent>& agent, const std::string& reason) {
  const bool expected = agent->expectClose || agent->state == Agent::State::kGone;
  agent->state = Agent::State::kGone;
  if (!agent->workers.empty()) {
    agent->killWorkersAt = clock_.now() + options_.agentGrace;
    wakeAgentsBy(*agent->killWorkersAt);
  }
  if (!expected) lost("agent of " + agent->host, reason);
}

void SimCluster::launch(const std::shared_ptr<Agent>& agent, const proto::LaunchWorkers& launch) {
  // A relaunch replaces what ran there (reported, with its own generation).
  killAgentWorkers(*agent, /*report=*/true);
  agent->generation = launch.generation;
  agent->pendingBeats.clear();  // the old workers' (varuna_agent: a new beat socket per launch)
  agent->pendingReports.clear();
  const auto now = clock_.now();
  auto [it, fresh] = generations_.try_emplace(launch.generation);
  Generation& gen = it->second;
  if (fresh) {
    gen.worldSize = launch.worldSize;
    gen.epoch = now;
    try {
      gen.map = StageToRankMap::parse(launch.stageToRankMap);
    } catch (const std::exception&) {
      // Reported as stage 0, replica = rank: the manager's plan is not ours to judge.
    }
    newestGeneration_ = std::max(newestGeneration_, launch.generation);
  }
  for (const auto& spec : launch.workers) {
    auto w = std::make_shared<Worker>();
    w->host = agent->host;
    w->rank = spec.rank;
    w->generation = launch.generation;
    w->worldSize = std::max(1, launch.worldSize);
    w->stage = gen.map ? gen.map->stageOf(spec.rank) : 0;
    w->replica = gen.map ? gen.map->replicaOf(spec.rank) : spec.rank;
    w->agent = agent;
    w->step = launch.resumeStep;
    // A few percent apart, like real machines; none slow enough to be flagged.
    w->computeSeconds = 0.050 * (1.0 + 0.02 * std::sin(1.7 * spec.rank));
    w->startAt = now + options_.workerStartDelay;
    if (auto old = find(spec.rank, launch.generation)) exitWorker(old, -1, SIGKILL);
    workers_[{launch.generation, spec.rank}] = w;
    agent->workers.push_back(w);
    if (options_.workerStartDelay.count() == 0) {
      connectWorker(w);
    } else {
      schedule(w);
    }
  }
}

void SimCluster::killAgentWorkers(Agent& agent, bool report) {
  for (const auto& w : std::vector<std::shared_ptr<Worker>>(agent.workers)) exitWorker(w, -1, SIGKILL, report);
  agent.workers.clear();
}

void SimCluster::closeAgent(Agent& agent) {
  agent.state = Agent::State::kGone;
  if (agent.peer) agent.peer->closeAfterSending();
}

bool SimCluster::reportAsAgentOf(const std::string& host, const proto::WorkerExited& exited) {
  auto agent = findAgent(host);
  if (!agent || agent->state != Agent::State::kUp) return false;
  return send(*agent->peer, proto::encode(exited));
}

void SimCluster::report(Agent& agent, const proto::WorkerExited& exited) {
  switch (agent.state) {
    case Agent::State::kUp:
      if (send(*agent.peer, proto::encode(exited))) {
        exitReports_.push_back(ExitReport{exited.host, exited.rank, exited.exitCode, exited.signal,
                                          exited.generation, clock_.now()});
      }
      break;
    case Agent::State::kFrozen:
      agent.held.push_back(exited);  // reaped when it runs again
      break;
    default:
      break;  // gone: nobody reports it
  }
}

// --- workers --------------------------------------------------------------------------------

void SimCluster::connectWorker(const std::shared_ptr<Worker>& worker) {
  worker->state = Worker::State::kConnecting;
  if (options_.maxDialling > 0 && dialling_ >= options_.maxDialling) {
    waitingToDial_.push_back(worker);
    return;
  }
  ++dialling_;
  worker->dialling = true;
  worker->peer = std::make_shared<SimPeer>(io_, options_.localNetwork);
  std::weak_ptr<Worker> weak = worker;
  worker->peer->connect(
      manager_,
      proto::Hello{proto::kVersion, credentials::worker(credentials_[worker->host], worker->rank, worker->generation),
                   "worker", worker->host, worker->rank, worker->generation},
      [this, weak](const proto::Message& m) {
        if (auto w = weak.lock()) onWorkerMessage(w, m);
      },
      [this, weak](const std::string& reason) {
        if (auto w = weak.lock()) onWorkerClosed(w, reason);
      },
      [this, weak] {
        auto w = weak.lock();
        if (!w || w->state != Worker::State::kConnecting) return;
        doneDialling(w);
        ++framesSent_;  // the hello
        w->state = Worker::State::kUp;
        const auto now = clock_.now();
        Generation* gen = w->stray ? nullptr : generationOf(w->generation);
        const double fraction = static_cast<double>(w->rank % w->worldSize) / w->worldSize;
        if (options_.workerHeartbeat.count() > 0) {
          w->nextHeartbeat = phased(gen ? gen->epoch : now, options_.workerHeartbeat, fraction, now);
          schedule(w);
        }
        if (!gen || ++gen->connected != gen->worldSize) return;
        // The rendezvous: every rank is there, steps begin (rank r's at r/N of the period).
        gen->training = true;
        for (auto& [key, other] : workers_) {
          if (key.first != w->generation || options_.step.count() == 0) continue;
          const double f = static_cast<double>(other->rank) / gen->worldSize;
          other->nextStep = now + std::chrono::duration_cast<Duration>(options_.step * f);
          if (options_.workerHeartbeat.count() > 0) other->nextHeartbeat = now + std::chrono::duration_cast<Duration>(options_.workerHeartbeat * f);
          schedule(other);
        }
        if (callbacks_.onAllWorkersConnected) callbacks_.onAllWorkersConnected(w->generation, gen->worldSize);
      });
}

void SimCluster::onWorkerMessage(const std::shared_ptr<Worker>& worker, const proto::Message& message) {
  record(PeerKind::kWorker, worker->host, worker->rank, worker->generation, message);
  const Order order = orders_.back();  // a copy: acting on it may record more
  if (const auto* exitNow = std::get_if<proto::ExitNow>(&message)) {
    if (exitNow->generation == worker->generation) {  // another generation's order is not for this process
      worker->ordered = true;
      exitWorker(worker, kExitSuperseded, 0);
    }
  } else if (const auto* welcome = std::get_if<proto::Welcome>(&message)) {
    worker->welcomed = true;
    if (welcome->lostManagerGraceMs > 0) worker->lostManagerGrace = std::chrono::milliseconds(welcome->lostManagerGraceMs);
  } else if (const auto* ack = std::get_if<proto::Ack>(&message); ack && !ack->ok) {
    // Refused: the link gives up after the lost-manager grace (code 76).
    worker->ordered = true;
    if (!worker->exitAt) {
      worker->exitCode = kExitSuperseded;
      worker->exitAt = clock_.now() + worker->lostManagerGrace;
      schedule(worker);
    }
  }
  if (callbacks_.onOrder) callbacks_.onOrder(order);
}

void SimCluster::doneDialling(const std::shared_ptr<Worker>& worker) {
  if (!worker->dialling) return;
  worker->dialling = false;
  --dialling_;
  asio::post(io_, [this] { dialWaitingWorkers(); });  // not inside the caller's handler
}

void SimCluster::dialWaitingWorkers() {
  while (!waitingToDial_.empty() && (options_.maxDialling == 0 || dialling_ < options_.maxDialling)) {
    auto worker = waitingToDial_.front().lock();
    waitingToDial_.pop_front();
    if (worker && worker->state == Worker::State::kConnecting && !worker->peer) connectWorker(worker);
  }
}

void SimCluster::onWorkerClosed(const std::shared_ptr<Worker>& worker, const std::string& reason) {
  doneDialling(worker);
  if (worker->state == Worker::State::kExited) return;
  if (!worker->ordered) lost(strCat("rank ", worker->rank, " of generation ", worker->generation), reason);
  // No manager: the link ends the process after the grace.
  if (!worker->exitAt) {
    worker->exitCode = kExitSuperseded;
    worker->exitAt = clock_.now() + worker->lostManagerGrace;
    schedule(worker);
  }
}

void SimCluster::exitWorker(const std::shared_ptr<Worker>& worker, int exitCode, int signal, bool reportIt) {
  doneDialling(worker);
  if (worker->state == Worker::State::kExited) return;
  worker->state = Worker::State::kExited;
  if (worker->peer) worker->peer->close();
  if (auto it = workers_.find({worker->generation, worker->rank}); it != workers_.end() && it->second == worker) {
    workers_.erase(it);
  }
  strays_.erase(std::remove(strays_.begin(), strays_.end(), worker), strays_.end());
  if (Generation* gen = worker->stray ? nullptr : generationOf(worker->generation)) {
    gen->frozenRanks.erase(worker->rank);
    if (exitCode != kExitOk && exitCode != kExitCheckpointed) gen->peerLost = true;  // the others block on it
  }
  auto agent = worker->agent.lock();
  if (!agent) return;
  agent->workers.erase(std::remove(agent->workers.begin(), agent->workers.end(), worker), agent->workers.end());
  if (!reportIt) return;
  const std::string tail = exitCode == kExitOk || exitCode == kExitCheckpointed
                               ? std::string()
                               : strCat("simulated worker, rank ", worker->rank, ": ",
                                        exitCode >= 0 ? strCat("exit code ", exitCode) : strCat("signal ", signal));
  // varuna_agent relays what its workers sent before it reports their exit.
  if (!agent->pendingReports.empty()) relayBeats(*agent, TimePoint::max());
  report(*agent, proto::WorkerExited{worker->host, worker->rank, exitCode, signal, worker->generation, tail});
}

int SimCluster::writeCheckpoint(const Worker& worker) {
  const Generation* gen = generationOf(worker.generation);
  if (options_.globalStore.empty() || !gen || !gen->checkpointStep || *gen->checkpointStep < 0) {
    return kExitCheckpointed;  // nothing to write (no store, or no step finished yet)
  }
  const int64_t step = *gen->checkpointStep;
  ckpt::WriterIdentity writer{worker.generation, ckpt::runTag(worker.generation, ""), worker.rank, worker.worldSize};
  try {
    const auto dir = ckpt::partialDir(options_.globalStore, step, writer.run);
    std::filesystem::create_directories(dir);
    const auto entry = ckpt::writeFileAtomic(dir, strCat("rank_", worker.rank, ".sim"),
                                             strCat("simulated rank ", worker.rank, " step ", step, "\n"));
    ckpt::writePart(options_.globalStore, step, writer, {entry});
    ckpt::finalize(options_.globalStore, step, writer);
  } catch (const ckpt::SupersededError&) {
    return kExitSuperseded;
  } catch (const std::exception&) {
    return kExitStorageError;
  }
  return kExitCheckpointed;
}

// --- the tick -------------------------------------------------------------------------------

void SimCluster::scheduleTick() {
  // A fixed cadence; a late tick catches up on what it missed (the load is
  // defined by event counts over time, not by ticks).
  const auto now = clock_.now();
  tickDue_ = std::max(tickDue_ + options_.tick, now);
  tickTimer_->expireAfter(tickDue_ - now, [this] {
    if (shutDown_) return;
    onTick();
    scheduleTick();
  });
}

void SimCluster::onTick() {
  const auto now = clock_.now();
  if (now >= agentsWakeAt_) {  // most ticks: no agent has anything due
    agentsWakeAt_ = TimePoint::max();
    for (auto& [host, agent] : agents_) tickAgent(*agent, now);
  }
  // The workers due (a heap: a tick costs what is due, not what runs; a
  // sender that walks a thousand workers per tick uses enough CPU to be
  // preempted mid-burst, and the manager then wakes twice: what the bench
  // measures would change), then their sends back to back.
  due_.clear();
  while (!wakes_.empty() && wakes_.top().at <= now) {
    Wake wake = wakes_.top();
    wakes_.pop();
    if (wake.worker->wakeAt != wake.at) continue;  // rescheduled since
    wake.worker->wakeAt = TimePoint::max();
    due_.push_back(std::move(wake.worker));
  }
  for (const auto& w : due_) {
    tickWorker(w, now);
    schedule(w);
  }
  due_.clear();
  if (callbacks_.onTick) callbacks_.onTick(now);
}

void SimCluster::tickAgent(Agent& agent, TimePoint now) {
  if (agent.killWorkersAt && now >= *agent.killWorkersAt) {
    agent.killWorkersAt.reset();
    killAgentWorkers(agent, /*report=*/false);
  }
  if (agent.state != Agent::State::kUp) {
    if (agent.killWorkersAt) wakeAgentsBy(*agent.killWorkersAt);
    return;
  }
  static const std::string heartbeat = proto::encode(proto::Heartbeat{-1, 0});
  for (; now >= agent.nextHeartbeat && agent.state == Agent::State::kUp; agent.nextHeartbeat += options_.agentHeartbeat) {
    // As varuna_agent: a relay this recent stands for the heartbeat.
    if (now - agent.lastRelay >= proto::relayStandsForHeartbeat(options_.agentBeatForward)) send(*agent.peer, heartbeat);
  }
  relayBeats(agent, now);
  if (agent.state == Agent::State::kUp) wakeAgentsBy(agent.nextHeartbeat);
  if (agent.killWorkersAt) wakeAgentsBy(*agent.killWorkersAt);
}

void SimCluster::relayBeats(Agent& agent, TimePoint now) {
  if (agent.pendingBeats.empty() && agent.pendingReports.empty()) return;
  if (now >= agent.nextBeatForward) {
    proto::WorkerBeats relay{agent.generation, {}, std::move(agent.pendingReports)};
    for (const auto& [rank, beat] : agent.pendingBeats) relay.beats.push_back(beat);
    agent.pendingBeats.clear();
    agent.pendingReports.clear();
    send(*agent.peer, proto::encode(relay));
    const TimePoint sent = now == TimePoint::max() ? clock_.now() : now;
    agent.lastRelay = sent;
    ++relays_;
    advanceRelayGrid(agent, sent + Duration(1));  // past this relay
    return;
  }
  wakeAgentsBy(agent.nextBeatForward);
}

void SimCluster::advanceRelayGrid(Agent& agent, TimePoint to) {
  // varuna_agent's relay timer fires every interval whether or not anything
  // is pending, so its phase stays however long it had nothing to relay: the
  // next relay is at the first point of its grid at or after `to`.
  const auto interval = std::chrono::duration_cast<Duration>(options_.agentBeatForward);
  if (agent.nextBeatForward < to) agent.nextBeatForward += ((to - agent.nextBeatForward - Duration(1)) / interval + 1) * interval;
}

void SimCluster::queueForRelay(Agent& agent) {
  // The first beat or report after an idle spell waits for the agent's next
  // timer firing, not the next tick (which would bunch every agent's relay
  // after a launch).
  if (agent.pendingBeats.empty() && agent.pendingReports.empty()) advanceRelayGrid(agent, clock_.now());
  wakeAgentsBy(agent.nextBeatForward);
}

void SimCluster::sendStepReport(Worker& w, const proto::StepReport& report) {
  const auto agent = w.agent.lock();
  if (options_.reportsThroughAgent && agent && agent->state == Agent::State::kUp && agent->generation == w.generation) {
    queueForRelay(*agent);
    agent->pendingReports.push_back(report);
    return;
  }
  send(*w.peer, proto::encode(report));
}

void SimCluster::beat(Worker& w, bool waiting) {
  const auto agent = w.agent.lock();
  const bool agentThere = agent && agent->state != Agent::State::kGone && agent->generation == w.generation;
  if (options_.beatsThroughAgent && agentThere && w.directBeatSent) {
    if (agent->state != Agent::State::kUp) return;  // a stopped agent's queue: dropped as stale once it runs
    queueForRelay(*agent);
    agent->pendingBeats[w.rank] = proto::WorkerBeat{w.rank, w.step, waiting};
    ++relaysBeats_;
    return;
  }
  w.directBeatSent = true;  // the first after the hello goes to the manager itself, as a ManagerLink's
  ++directHeartbeats_;
  if (w.frameStep != w.step || w.frameWaiting != waiting || w.heartbeatFrame.empty()) {
    w.heartbeatFrame = proto::encode(proto::Heartbeat{w.rank, w.step, waiting});
    w.frameStep = w.step;
    w.frameWaiting = waiting;
  }
  send(*w.peer, w.heartbeatFrame);
}

void SimCluster::schedule(const std::shared_ptr<Worker>& w) {
  auto at = TimePoint::max();
  if (w->state == Worker::State::kStarting) {
    at = w->startAt;
  } else if (w->state != Worker::State::kExited && !w->processFrozen) {  // a stopped process does nothing
    at = std::min({w->nextHeartbeat, w->nextStep, w->exitAt.value_or(TimePoint::max())});
  }
  if (at == w->wakeAt) return;  // its entry is queued already (or it has none and needs none)
  w->wakeAt = at;
  if (at != TimePoint::max()) wakes_.push(Wake{at, w});
}

void SimCluster::tickWorker(const std::shared_ptr<Worker>& w, TimePoint now) {
  if (w->state == Worker::State::kExited) return;  // exited earlier in this tick
  if (w->state == Worker::State::kStarting) {
    if (now >= w->startAt) connectWorker(w);
    return;
  }
  if (w->exitAt && now >= *w->exitAt && !w->processFrozen) {
    exitWorker(w, w->checkpointing ? writeCheckpoint(*w) : w->exitCode, 0);
    return;
  }
  if (now < w->nextHeartbeat && now < w->nextStep) return;  // nothing due: most workers at most ticks
  if (w->state != Worker::State::kUp || w->processFrozen || !w->peer->open()) return;
  const Generation* gen = w->stray ? nullptr : generationOf(w->generation);
  const bool stalled = gen && gen->stalled();
  const bool waiting = stalled && !w->progressFrozen;
  if (options_.step.count() > 0 && gen && gen->training) {
    if (stalled || w->checkpointing || w->progressFrozen) {
      w->nextStep = now + options_.step;  // no catching up on the steps it was blocked for
    } else {
      for (; now >= w->nextStep && w->peer->open(); w->nextStep += options_.step) {
        ++w->step;
        const int stages = gen->map ? gen->map->numStages() : 1;
        const proto::StepReport report{w->rank, w->stage, w->replica, w->step,
                                       2.0 + 6.0 * std::exp(-static_cast<double>(w->step) / 200.0),
                                       w->computeSeconds * (options_.microbatches + stages - 1), w->computeSeconds};
        sendStepReport(*w, report);
      }
    }
  }
  if (options_.workerHeartbeat.count() > 0) {
    for (; now >= w->nextHeartbeat && w->peer->open(); w->nextHeartbeat += options_.workerHeartbeat) beat(*w, waiting);
  }
}

// --- faults ---------------------------------------------------------------------------------

void SimCluster::dropAgent(const std::string& host, bool withWorkers) {
  auto agent = findAgent(host);
  if (!agent || agent->state == Agent::State::kGone) return;
  closeAgent(*agent);
  agent->peer->close();  // at once, not after sending
  if (withWorkers) killAgentWorkers(*agent, /*report=*/false);
}

void SimCluster::freezeAgent(const std::string& host) {
  auto agent = findAgent(host);
  if (!agent || agent->state != Agent::State::kUp) return;
  agent->state = Agent::State::kFrozen;
  agent->peer->pause();
}

void SimCluster::thawAgent(const std::string& host) {
  auto agent = findAgent(host);
  if (!agent || agent->state != Agent::State::kFrozen) return;
  agent->state = Agent::State::kUp;
  agent->nextHeartbeat = clock_.now();
  wakeAgentsBy(agent->nextHeartbeat);
  agent->peer->resume();  // first: a close that came meanwhile is found before anything is sent
  const auto held = std::move(agent->held);
  agent->held.clear();
  for (const auto& exited : held) report(*agent, exited);
}

void SimCluster::freezeProgress(int rank) {
  auto w = find(rank, newestGeneration_);
  if (!w) return;
  w->progressFrozen = true;
  if (Generation* gen = generationOf(w->generation)) gen->frozenRanks.insert(rank);
}

void SimCluster::thawProgress(int rank) {
  auto w = find(rank, newestGeneration_);
  if (!w) return;
  w->progressFrozen = false;
  if (Generation* gen = generationOf(w->generation); gen && !w->processFrozen) gen->frozenRanks.erase(rank);
}

void SimCluster::freezeWorker(int rank) {
  auto w = find(rank, newestGeneration_);
  if (!w) return;
  w->processFrozen = true;
  schedule(w);  // nothing until thawed
  if (w->peer) w->peer->pause();
  if (Generation* gen = generationOf(w->generation)) gen->frozenRanks.insert(rank);
}

void SimCluster::thawWorker(int rank) {
  auto w = find(rank, newestGeneration_);
  if (!w || !w->processFrozen) return;
  w->processFrozen = false;
  if (Generation* gen = generationOf(w->generation); gen && !w->progressFrozen) gen->frozenRanks.erase(rank);
  if (options_.workerHeartbeat.count() > 0) w->nextHeartbeat = clock_.now();
  schedule(w);
  if (w->peer) w->peer->resume();
}

void SimCluster::exitWorker(int rank, int exitCode, int signal) {
  if (auto w = find(rank, newestGeneration_)) exitWorker(w, exitCode, signal);
}

void SimCluster::connectStaleWorker(const std::string& host, int rank, int generation) {
  auto w = std::make_shared<Worker>();
  w->host = host;
  w->rank = rank;
  w->generation = generation;
  w->stray = true;
  strays_.push_back(w);
  connectWorker(w);
}

void SimCluster::sendPreemptNotice(const std::string& host, int64_t deadlineUnixMs) {
  auto notifier = std::make_shared<SimPeer>(io_, options_.localNetwork);
  notifiers_.push_back(notifier);
  std::weak_ptr<SimPeer> weak = notifier;
  notifier->connect(
      manager_, proto::Hello{proto::kVersion, credentials::notifier(credentials_[host]), "notifier", host, -1, -1},
      [this, host](const proto::Message& m) {
        record(PeerKind::kNotifier, host, -1, -1, m);
        if (callbacks_.onOrder) callbacks_.onOrder(orders_.back());
      },
      [](const std::string&) {},  // the manager closes after its ack
      [this, weak, host, deadlineUnixMs] {
        auto n = weak.lock();
        if (!n) return;
        ++framesSent_;  // the hello
        send(*n, proto::encode(proto::PreemptNotice{host, deadlineUnixMs}));
      });
}

void SimCluster::setHostReachable(const std::string& host, bool reachable) {
  if (reachable) {
    unreachable_.erase(host);
  } else {
    unreachable_.insert(host);
  }
}

// --- helpers --------------------------------------------------------------------------------

void SimCluster::record(PeerKind to, const std::string& host, int rank, int generation, const proto::Message& message) {
  orders_.push_back(Order{to, host, rank, generation, proto::typeName(message), clock_.now(), message});
}

void SimCluster::lost(const std::string& who, const std::string& reason) {
  ++lostConnections_;
  if (callbacks_.onConnectionLost) callbacks_.onConnectionLost(who, reason);
}

bool SimCluster::send(SimPeer& peer, std::string_view frame) {
  if (!peer.send(frame)) return false;
  ++framesSent_;
  return true;
}

std::shared_ptr<SimCluster::Worker> SimCluster::find(int rank, int generation) const {
  auto it = workers_.find({generation, rank});
  return it == workers_.end() ? nullptr : it->second;
}

std::shared_ptr<SimCluster::Agent> SimCluster::findAgent(const std::string& host) const {
  auto it = agents_.find(host);
  return it == agents_.end() ? nullptr : it->second;
}

SimCluster::Generation* SimCluster::generationOf(int generation) {
  auto it = generations_.find(generation);
  return it == generations_.end() ? nullptr : &it->second;
}

}  // namespace varuna::sim
