#include "daemon/agent_pool.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "varuna/common/certificate_credential.h"
#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/common/secrets.h"
#include "varuna/manager/credentials.h"
#include "varuna/manager/job_config.h"
#include "varuna/common/time_util.h"

namespace varuna {
namespace {

namespace asio = boost::asio;
using nlohmann::json;

// The manager's heartbeat to its agents (as often as theirs to it).
constexpr auto kHeartbeatInterval = std::chrono::seconds(1);

}  // namespace

const char* toString(AgentPool::Status status) {
  switch (status) {
    case AgentPool::Status::kStarting: return "starting";
    case AgentPool::Status::kUp: return "up";
    case AgentPool::Status::kFailed: return "failed";
    case AgentPool::Status::kGone: return "gone";
  }
  return "unknown";
}

AgentPool::AgentPool(asio::io_context& io, std::shared_ptr<HandlerGuard> guard, EventLog& events,
                     std::unique_ptr<HostLauncher> launcher, Settings settings, Observer& observer, Clock& clock)
    : io_(io),
      clock_(clock),
      guard_(std::move(guard)),
      events_(events),
      launcher_(std::move(launcher)),
      settings_(std::move(settings)),
      observer_(observer),
      absences_(settings_.retry) {
  if (!settings_.ca || settings_.launchesFile.empty()) return;
  // An earlier manager's starts: valid until this one's agents say hello.
  std::ifstream in(settings_.launchesFile);
  if (!in) return;
  try {
    launches_.restore(nlohmann::json::parse(in));
  } catch (const std::exception& e) {
    log::warn("ignoring ", settings_.launchesFile, " (", e.what(), "): the agents an earlier manager started are ",
              "refused until this manager's own agents replace them");
  }
}

AgentPool::~AgentPool() {
  alive_.reset();  // heartbeats posted to the loop are not sent
  if (launchesSavePosted_) saveLaunches();  // the loop stopped before it ran
  // Start-ups still under way (the loop stopped first): their results are
  // never read, but the threads use this pool's launcher.
  for (auto& [id, t] : launchThreads_) {
    if (t.joinable()) t.join();
  }
}

bool AgentPool::isListed(const std::string& host) const {
  return listedHosts_.count(host) > 0 || joined_.count(host) > 0;
}

void AgentPool::setListed(std::vector<Machine> machines) {
  // A name that joined by itself stays the joined host's while its agent is
  // up: one machine must not count twice (the list entry counts once the
  // list is written again after the joined host left).
  std::erase_if(machines, [this](const Machine& m) {
    if (!joined_.count(m.host)) return false;
    log::error("the machine list names ", m.host, ", a host that joined by itself: the entry is ignored while that "
               "host's agent is up");
    return true;
  });
  listed_ = std::move(machines);
  listedHosts_.clear();
  for (const auto& m : listed_) listedHosts_.insert(m.host);
  forgetUnlisted();
  forgetUnlistedLaunches();
}

void AgentPool::forgetUnlistedLaunches() {
  bool changed = false;
  for (const auto& host : launches_.hosts()) {
    if (!listedHosts_.count(host) && !agents_.count(host)) changed |= launches_.forget(host);
  }
  if (changed) saveLaunchesSoon();
}

void AgentPool::forgetUnlisted() {
  for (auto it = agents_.begin(); it != agents_.end();) {
    const bool gone = !it->second.connection && !it->second.launching;
    if (isListed(it->first) || !gone) {
      ++it;
      continue;
    }
    absences_.forget(it->first);
    if (launches_.forget(it->first)) saveLaunchesSoon();  // its certificates are revoked with it
    it = agents_.erase(it);
  }
}

// --- start-ups ------------------------------------------------------------------

void AgentPool::startAgent(const std::string& host) {
  auto [entry, fresh] = agents_.try_emplace(host);
  Agent& agent = entry->second;
  // One start-up per host at a time: a retry or a list write while one is
  // under way leaves it to that one.
  if (!fresh && (agent.status == Status::kStarting || agent.launching)) return;
  startAttempt(agent);
  agent.launching = true;
  absences_.noteAttempt(host);
  const std::string command = agentCommand_(host);
  log::debug("starting the agent on ", host);
  const uint64_t id = nextLaunchThread_++;
  // The agent's credential (its host's only, credentials.h) travels on the
  // command's stdin, never in the command (the remote shell's command line
  // is visible to `ps`). With a CA, a host CA of this start.
  std::string input;
  if (settings_.ca) {
    input = issueAgentCredential(host, launches_.start(host)) + "\n";
  } else {
    input = agentCredential(host) + "\n";
  }
  if (!settings_.agentEnvironment.empty()) input += nlohmann::json(settings_.agentEnvironment).dump() + "\n";
  launchOnceStartsSaved([this, id, host, command, input] { runStartup(id, host, command, input); });
}

void AgentPool::runStartup(uint64_t id, const std::string& host, const std::string& command, const std::string& input) {
  HostLauncher* launcher = launcher_.get();
  launchThreads_.emplace(id, std::thread([this, launcher, host, command, id, input] {
    HostCommandResult result;
    try {
      result = launcher->run(host, command, input);
    } catch (const std::exception& e) {  // out of a thread it would end the process
      result.ok = false;
      result.message = strCat("starting the agent failed: ", e.what());
    }
    asio::post(io_, guard_->wrap("an agent start-up's result", [this, id, host, result] {
      reapLaunchThread(id);
      if (auto a = agents_.find(host); a != agents_.end()) a->second.launching = false;
      onStartupDone(host, result);
    }));
  }));
}

void AgentPool::launchOnceStartsSaved(std::function<void()> launch) {
  if (!settings_.ca || settings_.launchesFile.empty()) {
    launch();
    return;
  }
  // A start's nonce is on disk before its agent can run: a manager killed
  // the moment after still knows the start when it comes back. One write
  // for the starts of one turn of the loop (a job's first start-ups).
  launchesAwaitingSave_.push_back(std::move(launch));
  if (launchesAwaitingSave_.size() > 1) return;  // the save is posted already
  asio::post(io_, guard_->wrap("saving the agents' starts before they run", [this, alive = std::weak_ptr<bool>(alive_)] {
    if (alive.expired()) return;
    saveLaunches();
    auto launches = std::exchange(launchesAwaitingSave_, {});
    if (shutDown_) return;  // the job stopped meanwhile: no agent to start
    for (auto& start : launches) start();
  }));
}

uint64_t AgentPool::startAttempt(Agent& agent) {
  const uint64_t attempt = agent.attempt + 1;
  agent = Agent{};
  agent.status = Status::kStarting;
  agent.attempt = attempt;
  return attempt;
}

void AgentPool::reapLaunchThread(uint64_t id) {
  auto it = launchThreads_.find(id);
  if (it == launchThreads_.end()) return;
  if (it->second.joinable()) it->second.join();  // it posted its result and is returning: no wait to speak of
  launchThreads_.erase(it);
}

void AgentPool::onStartupDone(const std::string& host, const HostCommandResult& result) {
  if (shutDown_) return;
  auto it = agents_.find(host);
  if (it == agents_.end() || it->second.status != Status::kStarting) return;  // up already (or gone)
  if (!result.ok) {
    if (result.exitStatus == kExitConfigError && !absences_.find(host)) {
      // The same program and code_dir are used everywhere: no host will do
      // better. (A host coming back that says so is only that host's
      // trouble, e.g. a re-imaged machine: it stays out, retried.)
      const std::string reason = strCat("host ", host, ": ", result.output.empty() ? result.message : result.output);
      events_.write("agent_failed", {{"host", host}, {"reason", reason}, {"config_error", true}});
      observer_.agentConfigError(host, reason);
      return;
    }
    startupFailed(host, result.message);
    return;
  }
  // The agent reported success after saying hello; the hello may still be in
  // flight on its socket. Give it a moment.
  const uint64_t attempt = it->second.attempt;  // a later start-up of the host is not this one's to fail
  clock_.runAfter(io_, settings_.helloWait, guard_->wrap("waiting for an agent's hello", [this, host, attempt] {
    auto a = agents_.find(host);
    if (!shutDown_ && a != agents_.end() && a->second.status == Status::kStarting && a->second.attempt == attempt) {
      startupFailed(host, "the agent started but never reached the manager at " + settings_.advertisedAddress);
    }
  }));
}

void AgentPool::startupFailed(const std::string& host, const std::string& message) {
  const auto now = clock_.now();
  HostAbsence& absence = absences_.markAbsent(host, "agent_failed", now);
  absences_.scheduleRetry(host, now);
  const std::string retry =
      absence.retryAt && isListed(host)
          ? strCat("; retrying in ", std::chrono::duration<double>(*absence.retryAt - now).count(), " s")
          : std::string();
  log::error("cannot start the agent on ", host, ": ", message, retry);
  events_.write("agent_failed", {{"host", host}, {"reason", message}, {"attempts", absence.attempts}});
  agents_.at(host).status = Status::kFailed;
  observer_.hostsChanged();
}

// --- connections ------------------------------------------------------------------

bool AgentPool::admit(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
  auto it = agents_.find(hello.host);
  // Checked again: a newer start may have been made since its handshake.
  const auto identity = connection->stream().authenticatedIdentity();
  std::string revoked;
  if (shutDown_ || it == agents_.end() || it->second.status == Status::kUp ||
      (identity && !stillSpeaksFor(*identity, revoked))) {
    const std::string why = shutDown_                ? "belongs to a job that stopped"
                            : it == agents_.end()    ? "is not in the machine list"
                            : !revoked.empty()       ? "has a newer agent: " + revoked
                                                     : "already has an agent";
    const std::string host = proto::boundedText(hello.host, proto::kMaxLoggedPeerTextBytes);
    log::warn("agent from ", connection->peer(), " for host ", host, " refused: the host ", why);
    connection->send(proto::Ack{false, strCat("host ", host, " ", why)});
    connection->closeAfterSending("refused");
    return false;
  }
  Agent& agent = it->second;
  agent.status = Status::kUp;
  agent.connection = connection;
  agent.lastSeen = clock_.now();
  agent.released = false;
  const std::string host = hello.host;
  std::weak_ptr<FramedConnection> weak = connection;
  connection->start([this, host](const proto::Message& m) { onMessage(host, m); },
                    [this, host, weak](const std::string& reason) {
                      auto a = agents_.find(host);
                      if (a != agents_.end() && a->second.connection == weak.lock()) onClosed(host, reason);
                    });
  noteAgentUp(host, connection);
  log::info("agent up on ", host, " (", connection->peer(), ")");
  events_.write("agent_up", {{"host", host}});
  if (absences_.mayComeBack(host, clock_.now())) back(host, "its agent is up again");
  observer_.hostsChanged();
  return true;
}

// --- hosts that join by themselves ---------------------------------------------------

std::string AgentPool::joinRefusal(const proto::Hello& hello) const {
  if (shutDown_) return "the job stopped";
  if (!isValidHostAddress(hello.host)) return "the name is not an IP address or host name";
  if (hello.slots < 1 || hello.slots > kMaxJoinSlots) {
    return strCat("slots ", hello.slots, " is not in 1..", kMaxJoinSlots, " (varuna_agent --slots)");
  }
  if (listedHosts_.count(hello.host)) return "the host is in the machine list: run_varuna starts its agent";
  auto it = agents_.find(hello.host);
  if (it != agents_.end() && (it->second.status == Status::kStarting || it->second.status == Status::kUp ||
                              it->second.launching)) {
    return strCat(proto::kJoinHostPresent, ", from another agent (give each host a name of its own)");
  }
  return "";
}

bool AgentPool::join(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
  if (const std::string why = joinRefusal(hello); !why.empty()) {
    const std::string host = proto::boundedText(hello.host, proto::kMaxLoggedPeerTextBytes);
    // Bounded like the listener's refusals: a flood of joins must not fill the disk.
    uint64_t suppressed = 0;
    if (joinRefusals_.allow(clock_.now(), &suppressed)) {
      log::warn("join of host ", host, " from ", connection->peer(), " refused: ", why,
                suppressed ? strCat(" (", suppressed, " more refused since the last line)") : std::string());
      events_.write("join_refused",
                    {{"host", host}, {"peer", connection->peer()}, {"reason", why}, {"suppressed_before", suppressed}});
    }
    connection->send(proto::Ack{false, strCat("join of host ", host, " refused: ", why)});
    connection->closeAfterSending("join refused");
    return false;
  }
  const std::string host = hello.host;  // a valid host address: fit for logs as it is
  // First, as they may throw, and then nothing has changed.
  std::string nonce = credentials::newNonce();
  std::string credential = issueAgentCredential(host, nonce);
  joined_[host] = JoinedHost{Machine{host, hello.slots, 0}, std::move(nonce)};  // an earlier join's nonce is void
  Agent& agent = agents_[host];
  const uint64_t attempt = startAttempt(agent);
  agent.joined = true;
  absences_.forget(host);
  observer_.hostBack(host);  // whatever the job held against an earlier host of that name is over
  connection->send(proto::Joined{std::move(credential), settings_.agentEnvironment,
                                 settings_.joinedAgentGrace.count(), settings_.joinedAgentLostManager.count(),
                                 settings_.joinedAgentBeatRelay.count()});
  connection->closeAfterSending("joined");
  log::info("host ", host, " joined (", hello.slots, " slots, from ", connection->peer(), "); waiting for its agent");
  events_.write("host_joined", {{"host", host}, {"slots", hello.slots}, {"peer", connection->peer()}});
  clock_.runAfter(io_, settings_.helloWait, guard_->wrap("waiting for a joined agent's hello", [this, host, attempt] {
    auto a = agents_.find(host);
    if (shutDown_ || a == agents_.end() || a->second.status != Status::kStarting || a->second.attempt != attempt) return;
    log::error("host ", host, " joined but its agent never said hello; it is forgotten");
    events_.write("join_abandoned", {{"host", host}});
    a->second.status = Status::kGone;
    leaveJoined(host, "no hello after joining", /*expected=*/true, /*preempted=*/false);
    observer_.hostsChanged();
  }));
  observer_.hostsChanged();
  return true;
}

std::string AgentPool::agentCredential(const std::string& host) const {
  auto it = joined_.find(host);
  return issueAgentCredential(host, it == joined_.end() ? std::string() : it->second.nonce);
}

std::string AgentPool::issueAgentCredential(const std::string& host, const std::string& nonce) const {
  if (settings_.ca) return settings_.ca->issue({"agent", host, -1, -1, nonce}, /*isCa=*/true).encode();
  return nonce.empty() ? credentials::agent(settings_.token, host)
                       : credentials::joinedAgent(settings_.token, host, nonce);
}

tls::HostCaStanding AgentPool::acceptsHostCa(const tls::PskIdentity& hostCa, const tls::PskIdentity& peer,
                                             std::string& why) const {
  std::string revoked;  // why, when it is
  if (auto joined = joined_.find(hostCa.host); joined != joined_.end()) {
    if (constantTimeEquals(hostCa.hint, joined->second.nonce)) return tls::HostCaStanding::kValid;
    revoked = "of an earlier join or agent of the host";
  } else {
    // A listed host, or one the list no longer has whose agent still runs
    // (its starts are forgotten when the agent goes: forgetUnlisted).
    const auto standing = launches_.standing(hostCa.host, hostCa.hint);
    if (standing == AgentLaunches::Standing::kLatest) return tls::HostCaStanding::kValid;
    if (standing == AgentLaunches::Standing::kEarlier && peer.role != "agent") return tls::HostCaStanding::kValid;
    revoked = agents_.count(hostCa.host) ? "of an earlier start of the host's agent" : "of a host not in the job";
  }
  why = strCat("the certificate of host '", proto::boundedText(hostCa.host, proto::kMaxLoggedPeerTextBytes), "' is ",
               revoked, peer.role == "worker" ? " (the worker is ordered out)" : "");
  return peer.role == "worker" ? tls::HostCaStanding::kRevoked : tls::HostCaStanding::kRefused;
}

bool AgentPool::stillSpeaksFor(const tls::PskIdentity& identity, std::string& why) const {
  if (!settings_.ca || !identity.certified) return true;
  const tls::PskIdentity hostCa{"agent", identity.host, -1, -1, identity.hostCaNonce};
  return acceptsHostCa(hostCa, identity, why) == tls::HostCaStanding::kValid;
}

bool AgentPool::refusedAsRevoked(const std::shared_ptr<FramedConnection>& connection, const std::string& what) const {
  const auto identity = connection->stream().authenticatedIdentity();
  std::string why;
  if (!identity || stillSpeaksFor(*identity, why)) return false;
  log::warn("refused a ", what, " from ", connection->peer(), ": ", why);
  connection->send(proto::Ack{false, why});
  connection->closeAfterSending("revoked");
  return true;
}

void AgentPool::noteAgentUp(const std::string& host, const std::shared_ptr<FramedConnection>& connection) {
  if (!settings_.ca || joined_.count(host)) return;
  const auto identity = connection->stream().authenticatedIdentity();
  if (identity && identity->certified && launches_.agentUp(host, identity->hint)) saveLaunchesSoon();
}

void AgentPool::saveLaunchesSoon() {
  if (settings_.launchesFile.empty() || launchesSavePosted_) return;
  // At most once a second: the changes nothing waits for (an agent up, a
  // host forgotten). Starts are written before they run (launchOnceStartsSaved).
  launchesSavePosted_ = true;
  clock_.runAfter(io_, std::chrono::seconds(1),
                  guard_->wrap("saving the agents' starts", [this, alive = std::weak_ptr<bool>(alive_)] {
                    if (alive.expired()) return;
                    launchesSavePosted_ = false;
                    saveLaunches();
                  }));
}

void AgentPool::saveLaunches() {
  const std::filesystem::path file(settings_.launchesFile);
  try {
    ckpt::writePrivateFileAtomic(file.parent_path(), file.filename().string(), launches_.toJson().dump() + "\n");
  } catch (const std::exception& e) {
    // Not fatal: a restarted manager without it refuses the running agents'
    // notices only until its own agents say hello.
    log::warn("cannot write ", file.string(), ": ", e.what());
  }
}

void AgentPool::leaveJoined(const std::string& host, const std::string& reason, bool expected, bool preempted) {
  joined_.erase(host);  // with its nonce: its agent's, notifier's and workers' credentials are void from here
  forgetJoinedLater(host);
  if (expected || preempted) {
    log::info("joined host ", host, " left the job (", reason, preempted && !expected ? ", after its preemption notice" : "",
              ")");
    events_.write("host_left", {{"host", host}, {"reason", reason}, {"preempted", preempted}});
    if (!expected) observer_.preemptedHostLeft(host);
    return;
  }
  log::error("lost the agent of joined host ", host, " (", reason, "); the host is out until it joins again");
  events_.write("host_lost", {{"host", host}, {"reason", reason}, {"joined", true}});
  observer_.agentLost(host, reason);
}

void AgentPool::forgetJoinedLater(const std::string& host) {
  // Not now: a connection closes (and so reaches here) from inside loops
  // over agents_ (silent agents, heartbeats, shutdown), which must not see
  // their entry erased under them. The entry is gone (status kGone) until
  // then; a join of the name meanwhile makes a new attempt, which stays.
  const uint64_t attempt = agents_.at(host).attempt;
  asio::post(io_, guard_->wrap("forgetting a joined host", [this, host, attempt] {
    auto it = agents_.find(host);
    if (it == agents_.end() || it->second.status != Status::kGone || it->second.attempt != attempt) return;
    if (joined_.count(host) || listedHosts_.count(host)) return;
    absences_.forget(host);
    agents_.erase(it);
  }));
}

void AgentPool::onMessage(const std::string& host, const proto::Message& message) {
  auto& agent = agents_.at(host);
  agent.lastSeen = clock_.now();
  if (const auto* ping = std::get_if<proto::Ping>(&message)) {
    if (agent.connection) agent.connection->send(proto::Pong{ping->sequence, ping->sentNs});
    return;
  }
  observer_.agentMessage(host, message);
}

void AgentPool::onClosed(const std::string& host, const std::string& reason) {
  Agent& agent = agents_.at(host);
  const bool expected = agent.released || shutDown_;
  agent.status = Status::kGone;
  agent.connection.reset();
  if (agent.joined) return leaveJoined(host, reason, expected, absences_.preempted(host));
  const auto now = clock_.now();
  if (expected) {
    // Released because it was preempted (it waits for the notice's deadline)
    // or removed from the list; if it is listed again by now, it comes back.
    if (!shutDown_ && isListed(host) && !absences_.preempted(host)) {
      absences_.markAbsent(host, "released", now).retryAt = now;
    }
    return;
  }
  log::error("lost the agent on ", host, " (", reason, ")");
  events_.write("host_lost", {{"host", host}, {"reason", reason}});
  absences_.markAbsent(host, "lost", now);
  absences_.scheduleRetry(host, now);
  observer_.agentLost(host, reason);
}

bool AgentPool::connected(const std::string& host) const {
  auto it = agents_.find(host);
  return it != agents_.end() && it->second.connection && it->second.connection->open();
}

std::optional<AgentPool::TimePoint> AgentPool::lastHeard(const std::string& host) const {
  if (!connected(host)) return std::nullopt;
  return agents_.at(host).lastSeen;
}

void AgentPool::send(const std::string& host, const proto::Message& message) {
  if (connected(host)) agents_.at(host).connection->send(message);
}

void AgentPool::send(const std::vector<std::string>& hosts, const proto::Message& message) {
  for (const auto& host : hosts) send(host, message);
}

void AgentPool::releaseDeparted() {
  for (auto& [host, agent] : agents_) {
    const bool preempted = absences_.preempted(host);
    const bool gone = preempted || !isListed(host);
    if (gone && agent.connection && agent.connection->open() && !agent.released) {
      agent.released = true;
      agent.connection->send(proto::Shutdown{preempted ? "preempted" : "removed from the machine list"});
      events_.write("host_released", {{"host", host}});
    }
  }
}

void AgentPool::shutdownAll(const std::string& reason) {
  shutDown_ = true;
  for (auto& [host, agent] : agents_) {
    if (agent.connection && agent.connection->open()) {
      agent.released = true;
      agent.connection->send(proto::Shutdown{reason});
    }
  }
}

void AgentPool::closeAll(const std::string& reason) {
  for (auto& [host, agent] : agents_) {
    if (agent.connection) agent.connection->closeAfterSending(reason);
  }
}

// --- the tick ------------------------------------------------------------------------

void AgentPool::tick(TimePoint now, bool retry) {
  if (agents_.size() > listedHosts_.size() + joined_.size()) forgetUnlisted();  // some unlisted: their agents may be gone now
  sendHeartbeats(now);
  if (retry && !shutDown_) retryAbsentHosts(now);
}

void AgentPool::closeSilentAgents(TimePoint now) {
  for (auto& [host, agent] : agents_) {
    if (agent.status == Status::kUp && agent.connection && now - agent.lastSeen > settings_.heartbeatTimeout) {
      agent.connection->close(strCat("no heartbeat for ", std::chrono::duration<double>(settings_.heartbeatTimeout).count(), " s"));
    }
  }
}

void AgentPool::sendHeartbeats(TimePoint now) {
  // An agent that hears nothing from the manager for heartbeat_timeout_s +
  // agent_grace_s takes it as gone (--lost_manager_ms). Each agent gets one
  // a second, but not all at once: with a thousand agents that would hold
  // the loop for tens of milliseconds once a second, and everything queued
  // behind it would wait. Each tick sends to the share of the agents the
  // time since the last tick is of the interval, in host order from where
  // the last one stopped, a few at a time with the loop's other work in
  // between; the frame is encoded once.
  // The fraction of a heartbeat a share leaves is carried to the next tick
  // (3 agents: 0.3 a tick, one every 3-4 ticks, not one each tick).
  if (agents_.empty()) return;
  if (lastHeartbeat_ == TimePoint{}) lastHeartbeat_ = now - kHeartbeatInterval;
  const double share = std::chrono::duration<double>(now - lastHeartbeat_) / kHeartbeatInterval;
  if (share <= 0) return;
  lastHeartbeat_ = now;
  const auto agents = static_cast<double>(agents_.size());
  heartbeatCredit_ = std::min(agents, heartbeatCredit_ + share * agents);  // a stalled loop catches up once, not twice
  const auto due = static_cast<size_t>(heartbeatCredit_);
  heartbeatCredit_ -= static_cast<double>(due);
  heartbeatsDue_ = std::min(agents_.size(), heartbeatsDue_ + due);  // what a busy loop left of the last round too
  if (!heartbeatsPosted_) sendSomeHeartbeats();
}

void AgentPool::sendSomeHeartbeats() {
  // One send is a system call (20 us on loopback): this many stall the loop
  // for well under a millisecond.
  constexpr size_t kHeartbeatsAtOnce = 16;
  static const std::string frame = proto::encode(proto::Heartbeat{-1, 0});
  auto it = agents_.upper_bound(heartbeatCursor_);
  for (size_t sent = 0; heartbeatsDue_ > 0 && sent < kHeartbeatsAtOnce && !agents_.empty(); --heartbeatsDue_, ++sent) {
    if (it == agents_.end()) it = agents_.begin();
    Agent& agent = it->second;
    if (agent.status == Status::kUp && agent.connection && agent.connection->open()) {
      agent.connection->sendEncoded(frame);
    }
    heartbeatCursor_ = it->first;
    ++it;
  }
  if (heartbeatsDue_ == 0 || agents_.empty()) return;
  asio::post(io_, guard_->wrap("sending heartbeats", [this, alive = std::weak_ptr<bool>(alive_)] {
    if (!alive.lock()) return;
    heartbeatsPosted_ = false;  // first: should the send throw, the next tick starts again
    sendSomeHeartbeats();
  }));
  heartbeatsPosted_ = true;
}

void AgentPool::retryAbsentHosts(TimePoint now) {
  if (absences_.empty()) return;
  std::vector<std::string> answered, due;
  for (const auto& [host, absence] : absences_.all()) {
    auto a = agents_.find(host);
    // A host no longer listed is not tried (its record goes with its agent:
    // forgetUnlisted).
    if (a == agents_.end() || !isListed(host) || !absences_.mayComeBack(host, now)) continue;
    const Agent& agent = a->second;
    if (agent.status == Status::kUp) {
      // Preempted, yet its agent still answers after the notice's deadline:
      // the host was not taken. (A released agent is on its way out.)
      if (!agent.released && (!absence.preemptedUntil || agent.lastSeen >= *absence.preemptedUntil)) {
        answered.push_back(host);
      }
      continue;
    }
    // One start-up at a time; a joined host is never started here (it joins again).
    if (agent.status == Status::kStarting || agent.launching || agent.joined) continue;
    if (absences_.retryDue(host, now)) due.push_back(host);
  }
  for (const auto& host : answered) back(host, "its agent still answers after the preemption notice's deadline");
  if (!answered.empty()) observer_.hostsChanged();
  for (const auto& host : due) {
    if (shutDown_) return;
    HostAbsence& absence = *absences_.find(host);
    absence.retryAt.reset();  // a failure of this start-up schedules the next
    log::info("starting the agent on ", host, " again (out for ", static_cast<int>(secondsBetween(absence.since, now)),
              " s: ", absence.why, "; attempt ", absence.attempts + 1, ")");
    startAgent(host);
  }
}

void AgentPool::back(const std::string& host, const std::string& how) {
  const auto now = clock_.now();
  const auto absence = absences_.back(host, now);
  if (!absence) return;
  observer_.hostBack(host);
  const double out = secondsBetween(absence->since, now);
  log::info("host ", host, " is back after ", static_cast<int>(out), " s out (", absence->why, "): ", how);
  events_.write("host_back",
                {{"host", host}, {"why", absence->why}, {"out_s", out}, {"attempts", absence->attempts}, {"how", how}});
}

nlohmann::json AgentPool::readmitListed(TimePoint now, bool* anyBack) {
  json retried = json::array();
  for (const auto& m : listed_) {
    const HostAbsence* absence = absences_.find(m.host);
    if (!absence) continue;
    retried.push_back({{"host", m.host}, {"why", absence->why}, {"slow", absence->slow}});
    absences_.readmit(m.host, now);
    if (usableAgent(m.host)) {
      back(m.host, "the machine list was written");
      if (anyBack) *anyBack = true;
    }
  }
  if (!retried.empty()) {
    log::info("the machine list was written: ", retried.size(), " host(s) that were out get another chance now");
    events_.write("hosts_readmitted", {{"hosts", retried}});
  }
  return retried;
}

void AgentPool::markFailed(const std::string& host) {
  if (auto it = agents_.find(host); it != agents_.end()) it->second.status = Status::kFailed;
}

void AgentPool::listedAdded(const std::string& host) {
  if (joined_.count(host) || !listedHosts_.count(host)) return;  // a joined host's name (setListed)
  auto it = agents_.find(host);
  if (it == agents_.end() || it->second.status != Status::kUp) startAgent(host);
}

// --- what the job may use --------------------------------------------------------------

bool AgentPool::usableAgent(const std::string& host) const {
  auto it = agents_.find(host);
  // A released agent (told to shut down) is on its way out.
  return it != agents_.end() && it->second.status == Status::kUp && !it->second.released;
}

std::vector<Machine> AgentPool::usable() const {
  std::vector<Machine> usable;
  for (const auto& m : listed_) {
    if (usableAgent(m.host)) usable.push_back(m);
  }
  for (const auto& [host, joined] : joined_) {
    if (usableAgent(host)) usable.push_back(joined.machine);
  }
  return usable;
}

bool AgentPool::anyStarting() const { return startingCount() > 0; }

size_t AgentPool::startingCount() const {
  size_t starting = 0;
  for (const auto& [host, agent] : agents_) starting += agent.status == Status::kStarting ? 1 : 0;
  return starting;
}

nlohmann::json AgentPool::describe(TimePoint now) const {
  // Once a second for state.json, on the loop: at 1 250 hosts every copy and
  // repeated lookup here showed in the manager's latency.
  json hosts = json::object();
  auto add = [&](const Machine& m, bool joined) {
    auto it = agents_.find(m.host);
    const bool starting = it != agents_.end() && it->second.status == Status::kStarting;
    json entry = {{"slots", m.slots},
                  {"agent", it != agents_.end() ? toString(it->second.status) : "unknown"},
                  {"preempted", absences_.preempted(m.host)},
                  // Out of the job: why, since when, and what brings it back.
                  {"out", absences_.describe(m.host, starting, now)}};
    if (joined) entry["joined"] = true;
    hosts.emplace(m.host, std::move(entry));
  };
  for (const auto& m : listed_) add(m, false);
  for (const auto& [host, joined] : joined_) add(joined.machine, true);
  return hosts;
}

}  // namespace varuna
