// PeerRouter: run_varuna's peer-routing role. The ControlListener hands it
// every connection whose hello carried the job's token; it turns the hello
// and the frames that follow into calls on its Sink (the daemon), by role:
//  - an agent: Sink::agentHello (the AgentPool admits it);
//  - a host joining (`varuna_agent --join`): Sink::joinHello;
//  - a worker of the running launch: Sink::workerConnected, then the Welcome
//    (how long it may go without hearing from the manager, the salvage
//    timeout), its frames to Sink::workerMessage, and
//    Sink::allWorkersConnected when it was the last rank the launch waited
//    for. A worker of another generation, or one the launch no longer
//    expects (written off as hung or lost), or one whose certificate the
//    job revoked (its agent was replaced), is ordered out (ExitNow, then
//    closed) and recorded as a stale_worker event: a straggler of an earlier
//    generation or an earlier manager must stop training into the store at
//    once, not merely be refused;
//  - a notifier (notify_manager_preempt): its PreemptNotice to
//    Sink::preemptNotice, which answers it; anything else is refused, and a
//    notifier that sends nothing is closed at closeIdleNotifiers once
//    Options::notifierDeadline has passed (it holds a descriptor otherwise);
//  - any other role: refused (proto::ProtocolError, which the listener reports).
// Each peer speaks only for itself (its credential, checked by the listener,
// binds its role, host, rank and generation: credentials.h): a worker whose
// rank the plan places on another host, a worker's frame about another
// rank, a notifier's notice about another host (unless it holds the job's
// secret: the operator's) are refused, counted (refusedMessages) and logged
// at most a few times a minute.
// It decides nothing about the job: what a hello or a frame means is the Sink's.
// Owned by ManagerDaemon::Impl, made in start(); runs on the daemon's
// event-loop thread. The callbacks it gives a connection call the Sink
// directly (never the router), so they need only the Sink alive.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <utility>

#include "varuna/common/protocol.h"
#include "loop/event_log.h"
#include "loop/framed_connection.h"
#include "loop/rate_limiter.h"

namespace varuna {

class PeerRouter {
 public:
  class Sink {
   public:
    virtual ~Sink() = default;
    virtual void agentHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) = 0;
    // A host that joins by itself (role "join", its credential checked): the
    // AgentPool registers it and answers with its agent credential.
    virtual void joinHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) = 0;
    // The running generation, and whether its launch waits for `rank`'s hello.
    virtual int runningGeneration() const = 0;
    virtual bool expectsWorker(int rank) const = 0;
    // The host the running plan places `rank` on (a rank expectsWorker took).
    virtual std::string hostOf(int rank) const = 0;
    // Rank `rank` of the running generation connected; true if it was the
    // last one the launch waited for.
    virtual bool workerConnected(int rank, const std::shared_ptr<FramedConnection>& connection) = 0;
    virtual void allWorkersConnected() = 0;
    virtual void workerMessage(int rank, const proto::Message& message) = 0;
    // Answers the notifier (an Ack) and closes its connection.
    virtual void preemptNotice(const std::shared_ptr<FramedConnection>& connection,
                               const proto::PreemptNotice& notice) = 0;
  };

  // What a worker's Welcome says.
  struct Options {
    // A worker that hears nothing from the manager this long exits on its own.
    std::chrono::milliseconds lostManagerGrace{0};
    // With salvage on, how long a worker that lost a peer waits for the
    // manager's order (0: salvage off, it exits).
    std::chrono::milliseconds salvageTimeout{0};
    // A notifier sends its notice with its hello: one silent this long is closed.
    std::chrono::milliseconds notifierDeadline{5000};
    // The job's secret: a notifier holding it may announce any host.
    std::string jobSecret;
  };
  using TimePoint = std::chrono::steady_clock::time_point;

  // `sink` and `events` outlive the router and every connection it routes.
  PeerRouter(Options options, Sink& sink, EventLog& events)
      : options_(std::move(options)), sink_(sink), events_(events), refusals_(std::make_shared<Refusals>(events)) {}

  // A hello the listener accepted (the token checked) at `now`. Throws
  // proto::ProtocolError for a role it does not know.
  void route(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello, TimePoint now);
  // Closes the notifiers that said hello before now - notifierDeadline and
  // sent nothing since (the daemon's tick).
  void closeIdleNotifiers(TimePoint now);
  size_t waitingNotifiers() const { return notifiers_.size(); }
  // Frames refused because their sender spoke for another rank or host.
  uint64_t refusedMessages() const { return refusals_->count; }

 private:
  void onWorkerHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello);
  void orderOut(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello, bool revoked);
  void onNotifierHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello, TimePoint now);

  // Shared with the connections' callbacks (which may outlive a handler).
  struct Refusals {
    explicit Refusals(EventLog& events) : events(events) {}
    // Counted; logged and recorded (message_refused) at most 3 a minute.
    void record(const std::string& peer, const std::string& why);
    EventLog& events;
    uint64_t count = 0;
    RateLimiter limit{std::chrono::seconds(60), 3};
  };

  Options options_;
  Sink& sink_;
  EventLog& events_;
  std::shared_ptr<Refusals> refusals_;
  // Notifiers that said hello, oldest first, until their notice or deadline.
  std::deque<std::pair<std::weak_ptr<FramedConnection>, TimePoint>> notifiers_;
};

}  // namespace varuna
