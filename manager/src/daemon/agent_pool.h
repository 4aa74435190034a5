// AgentPool: run_varuna's host agents. For every listed host it keeps the
// agent's state and connection, starts the agent (one start-up at a time per
// host, each on a launch thread whose result is posted back to the loop and
// which is joined then), answers and sends heartbeats, closes agents that went
// silent, and knows which hosts are out and when they come back
// (HostAbsences). What the job makes of it (the usable machines changed, a
// host was lost) goes to its Observer, the daemon.
//
// Runs on the daemon's io_context thread, like everything of the daemon.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "varuna/common/machine_list.h"
#include "varuna/common/control_tls.h"
#include "varuna/common/protocol.h"
#include "daemon/agent_launches.h"
#include "daemon/host_absences.h"
#include "varuna/manager/clock.h"
#include "loop/event_log.h"
#include "loop/framed_connection.h"
#include "loop/handler_guard.h"
#include "loop/rate_limiter.h"
#include "varuna/manager/host_launcher.h"

namespace varuna {

class AgentPool {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  class Observer {
   public:
    virtual ~Observer() = default;
    // A host became usable or stopped being usable (an agent up, back, failed).
    virtual void hostsChanged() = 0;
    // A host that was out is usable again (the controller forgets its exclusion).
    virtual void hostBack(const std::string& host) = 0;
    // The agent of a host in use was lost unexpectedly (the pool has marked it out).
    virtual void agentLost(const std::string& host, const std::string& reason) = 0;
    // The agent of a joined host left after a preemption notice for it (its
    // scheduler's SIGTERM), before the manager released it: expected, not a
    // failure; the job must still stop counting on the host.
    virtual void preemptedHostLeft(const std::string& host) = 0;
    // An agent's start-up failed with a configuration error no host will fix.
    virtual void agentConfigError(const std::string& host, const std::string& reason) = 0;
    // What an agent reports about its workers: their exits (WorkerExited)
    // and their relayed heartbeats (WorkerBeats).
    virtual void agentMessage(const std::string& host, const proto::Message& message) = 0;
  };

  enum class Status { kStarting, kUp, kFailed, kGone };

  struct Settings {
    std::string advertisedAddress;  // host:port agents dial
    std::string token;              // the job secret: each agent gets its host's credential from it (stdin)
    // The job's CA (run_varuna over TLS): each agent gets its host's CA,
    // issued at each start or join, instead of a credential derived from the
    // secret (certificate_credential.h). Null: derived credentials.
    std::shared_ptr<const tls::CertificateCredential> ca;
    // With a CA: where the nonces of the listed hosts' agent starts are kept
    // (AgentLaunches), so that a restarted manager still hears the agents
    // its predecessor started until its own say hello. Empty: not kept.
    std::string launchesFile;
    // The env_file's variables: on the agent's stdin after its credential
    // (with --env_stdin, one line of JSON), never on its command line.
    std::vector<std::pair<std::string, std::string>> agentEnvironment;
    std::chrono::milliseconds heartbeatTimeout{10000};  // an agent silent this long is closed
    std::chrono::milliseconds helloWait{10000};  // after a reported start-up, the wait for its hello
    // What a joined agent is told (Joined), as run_varuna's command line
    // tells the agents it starts: --grace_s, --lost_manager_ms and --beat_relay_ms.
    std::chrono::milliseconds joinedAgentGrace{5000}, joinedAgentLostManager{15000}, joinedAgentBeatRelay{250};
    RetryPolicy retry;
  };

  // `clock` (when agents were heard, the wait for a hello) outlives the pool.
  AgentPool(boost::asio::io_context& io, std::shared_ptr<HandlerGuard> guard, EventLog& events,
            std::unique_ptr<HostLauncher> launcher, Settings settings, Observer& observer, Clock& clock);
  ~AgentPool();  // joins start-ups still under way (their results are never read)

  // The command that starts the agent on `host` (set by the daemon: it knows the job).
  void setAgentCommand(std::function<std::string(const std::string& host)> command) {
    agentCommand_ = std::move(command);
  }

  // The most worker slots a joining host may announce.
  static constexpr int kMaxJoinSlots = 1024;

  // The machine list as last read.
  // Hosts no longer listed whose agent is gone are forgotten (weeks of
  // machines that come and go under new names must not pile up).
  void setListed(std::vector<Machine> machines);
  const std::vector<Machine>& listed() const { return listed_; }
  // Listed, or joined by itself.
  bool isListed(const std::string& host) const;

  // Starts the agent on `host` unless one is starting or up.
  void startAgent(const std::string& host);
  // An agent's hello (already authenticated): false if refused (unknown host,
  // or one with an agent already), with the reason sent to it.
  bool admit(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello);
  // A host joining by itself (role "join", its join credential checked):
  // refused, with the reason sent, when the pool stopped, the name is not a
  // host address, the slots are out of range, or the name is listed or
  // joined already with an agent starting or up. Otherwise the host becomes
  // a machine of the job like a listed one, waiting for its agent's hello
  // (helloWait), and the connection gets Joined: the host's agent credential
  // and the env_file's variables. A joined host leaves with its agent.
  bool join(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello);
  size_t joinedCount() const { return joined_.size(); }
  bool isJoined(const std::string& host) const { return joined_.count(host) > 0; }
  // Without a CA (pre-shared keys only), the credential host's agent is
  // given (credentials.h): A(H), or for a host in the job by a join, A(H, N)
  // of that join. With a CA each start or join issues its own host CA
  // instead (issueAgentCredential; see acceptsHostCa).
  std::string agentCredential(const std::string& host) const;
  // What a chain through `hostCa` (for the leaf `peer`) may do, with a CA:
  // a joined host's CA must name that join's nonce; any other host's, a
  // start of its agent that AgentLaunches holds valid (a host the list
  // dropped keeps its starts until its agent goes). Anything else of the
  // job's root is revoked: a worker is let through to be ordered out (a
  // straggler of an earlier start or join), every other role refused.
  // An agent must hold its host's latest start (an earlier start's agent is
  // one run_varuna has replaced: the new one stops it).
  tls::HostCaStanding acceptsHostCa(const tls::PskIdentity& hostCa, const tls::PskIdentity& peer,
                                    std::string& why) const;
  // Whether a connection authenticated as `identity` still speaks for its
  // host (acceptsHostCa again, after the handshake: a start it belongs to
  // may have been revoked since). True for pre-shared keys.
  bool stillSpeaksFor(const tls::PskIdentity& identity, std::string& why) const;
  // When `connection` no longer does: refuses its `what` (an Ack naming why,
  // then closed) and returns true.
  bool refusedAsRevoked(const std::shared_ptr<FramedConnection>& connection, const std::string& what) const;

 private:
  // A host CA (with a CA) or derived credential for `host`'s agent, naming
  // `nonce`: a join's or a start's with a CA, a join's or "" without.
  std::string issueAgentCredential(const std::string& host, const std::string& nonce) const;
  // The start of a listed host's agent whose certificate `connection` holds
  // said hello (with a CA): earlier starts are revoked.
  void noteAgentUp(const std::string& host, const std::shared_ptr<FramedConnection>& connection);
  // Writes launches_ to Settings::launchesFile, within a second (one write
  // for many changes: each is an fsync, on the loop's thread).
  void saveLaunchesSoon();
  // Runs `launch` (a start-up's thread) once launches_ is written, later in
  // this turn of the loop, with every other start of the turn; at once
  // without a CA or a file.
  void launchOnceStartsSaved(std::function<void()> launch);
  // Restored starts of hosts the machine list no longer has are dropped.
  void forgetUnlistedLaunches();
  void saveLaunches();

 public:

  // Closes agents silent for the heartbeat timeout (each one's loss goes to
  // the observer). First in the daemon's tick.
  void closeSilentAgents(TimePoint now);
  // The rest of the tick: sends the manager's heartbeat once a second, and
  // (unless `retry` is false: the job is not running yet or is stopping)
  // starts the agents of hosts whose retry is due and readmits preempted
  // hosts whose agent still answers.
  void tick(TimePoint now, bool retry);

  // A preemption notice for `host`, taken at `until` (a listed host only).
  bool known(const std::string& host) const { return agents_.count(host) > 0; }
  void preempted(const std::string& host, TimePoint until, TimePoint now) {
    absences_.markPreempted(host, until, now);
  }
  // Excluded as slow (--exclude_slow).
  void slow(const std::string& host, TimePoint now) { absences_.markSlow(host, now); }
  // The machine list was written: listed hosts that are out get another
  // chance now. Returns the hosts readmitted (each with why it was out) and
  // calls the observer's hostBack for those whose agent is up.
  nlohmann::json readmitListed(TimePoint now, bool* anyBack);
  // Hosts newly listed: their agents start (unless up).
  void listedAdded(const std::string& host);

  // An agent lost before the job started counts as a failed start-up (state.json).
  void markFailed(const std::string& host);

  // Machines the job may use: listed, agent up and not released.
  std::vector<Machine> usable() const;
  // True while some agent's first start-up is under way.
  bool anyStarting() const;
  size_t startingCount() const;

  // Sends `message` to the agent of each host (those connected).
  void send(const std::vector<std::string>& hosts, const proto::Message& message);
  void send(const std::string& host, const proto::Message& message);
  bool connected(const std::string& host) const;
  // When its agent, connected, last sent a frame; unset when not connected.
  std::optional<TimePoint> lastHeard(const std::string& host) const;
  // After a launch: hosts preempted or no longer listed are told to shut down.
  void releaseDeparted();
  // The job stopped: every agent is told so (its loss is then expected) and
  // no start-up result counts any more.
  void shutdownAll(const std::string& reason);
  // Leaving the loop: every connection is closed after what it has queued.
  void closeAll(const std::string& reason);

  // state.json's "hosts".
  nlohmann::json describe(TimePoint now) const;
  size_t launchThreads() const { return launchThreads_.size(); }
  const HostAbsences& absences() const { return absences_; }

 private:
  struct Agent {
    Status status = Status::kStarting;
    std::shared_ptr<FramedConnection> connection;
    TimePoint lastSeen{};
    bool released = false;  // sent Shutdown: its loss is expected
    // Kept across start-ups: which one is under way, and whether its launch
    // thread still runs (one at a time per host).
    uint64_t attempt = 0;
    bool launching = false;
    bool joined = false;  // came by itself (join): never started by the pool, forgotten when it goes
  };

  void forgetUnlisted();
  // Resets `agent` to a new start-up (status kStarting, the next attempt number); returns that number.
  static uint64_t startAttempt(Agent& agent);
  void onMessage(const std::string& host, const proto::Message& message);
  void onClosed(const std::string& host, const std::string& reason);
  // A joined host's agent went: the host leaves the job (a lost one is
  // reported to the observer); it comes back only by joining again.
  void leaveJoined(const std::string& host, const std::string& reason, bool expected, bool preempted);
  void forgetJoinedLater(const std::string& host);
  std::string joinRefusal(const proto::Hello& hello) const;
  void onStartupDone(const std::string& host, const HostCommandResult& result);
  void startupFailed(const std::string& host, const std::string& message);
  // Runs the agent command on a thread of its own; its result comes back to the loop.
  void runStartup(uint64_t id, const std::string& host, const std::string& command, const std::string& input);
  void reapLaunchThread(uint64_t id);
  void sendHeartbeats(TimePoint now);
  void sendSomeHeartbeats();
  void retryAbsentHosts(TimePoint now);
  void back(const std::string& host, const std::string& how);
  bool usableAgent(const std::string& host) const;

  boost::asio::io_context& io_;
  Clock& clock_;
  std::shared_ptr<HandlerGuard> guard_;
  EventLog& events_;
  std::unique_ptr<HostLauncher> launcher_;
  Settings settings_;
  Observer& observer_;
  std::function<std::string(const std::string&)> agentCommand_;
  std::vector<Machine> listed_;
  std::set<std::string> listedHosts_;
  // A host that joined by itself, until its agent goes.
  struct JoinedHost {
    Machine machine;
    std::string nonce;  // what binds its agent's (and so its notifier's and workers') credentials to this join
  };
  std::map<std::string, JoinedHost> joined_;
  AgentLaunches launches_;  // listed hosts' agent starts (with a CA)
  bool launchesSavePosted_ = false;
  std::vector<std::function<void()>> launchesAwaitingSave_;  // launchOnceStartsSaved's, until the write
  RateLimiter joinRefusals_{std::chrono::seconds(60), 3};  // written in full, per minute
  std::map<std::string, Agent> agents_;
  HostAbsences absences_;
  std::map<uint64_t, std::thread> launchThreads_;
  uint64_t nextLaunchThread_ = 0;
  TimePoint lastHeartbeat_{};    // the last tick that sent heartbeats
  std::string heartbeatCursor_;  // the host that got the last one: the next goes on after it
  double heartbeatCredit_ = 0;   // the fraction of a heartbeat the last share left
  size_t heartbeatsDue_ = 0;     // those not sent yet
  bool heartbeatsPosted_ = false;  // the next few are posted to the loop
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // reset when this goes
  bool shutDown_ = false;
};

const char* toString(AgentPool::Status status);

}  // namespace varuna
