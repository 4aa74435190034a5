#include "link/manager_link.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "varuna/common/agent_beat.h"
#include "varuna/common/control_client.h"
#include "varuna/common/log.h"
#include "varuna/common/time_util.h"

namespace varuna {
namespace {

// A private close-on-exec copy of the agent's beat socket, or -1 when `fd`
// is not a Unix datagram socket made by this process's parent (not started
// by an agent, a wrapper that did not exec, or a program that reused the
// descriptor, e.g. for syslog): nothing is ever sent into another socket.
// The descriptor itself becomes close-on-exec: programs the training program
// runs do not inherit it.
int adoptAgentBeatSocket(int fd) {
  if (fd < 0) return -1;
  int type = 0, domain = 0;
  socklen_t length = sizeof(type);
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &length) != 0 || type != SOCK_DGRAM) return -1;
  length = sizeof(domain);
  if (::getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &length) != 0 || domain != AF_UNIX) return -1;
  ucred peer{};
  length = sizeof(peer);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0 || peer.pid != ::getppid()) return -1;
  const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (copy >= 0) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return copy;
}

}  // namespace

ManagerLink::ManagerLink(ManagerLinkOptions options, int rank, ManagerLinkTimings timings,
                         const std::atomic<bool>* waitingOnPeers)
    : options_(std::move(options)),
      rank_(rank),
      timings_(timings),
      waitingOnPeers_(waitingOnPeers),
      lastHeard_(Clock::now()),
      retryAt_(lastHeard_),
      agentBeatFd_(adoptAgentBeatSocket(options_.agentBeatFd)),
      thread_([this] { run(); }) {}

ManagerLink::~ManagerLink() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
  if (agentBeatFd_ >= 0) ::close(agentBeatFd_);
}

void ManagerLink::reportStep(const proto::StepReport& report) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.size() < 1000) queue_.push_back(report);  // bounded if the manager is away
    step_ = report.step;
  }
  wake_.notify_all();
}

void ManagerLink::reportCheckpointFailure(int64_t step, const std::string& error) {
  proto::CheckpointFailed failure{rank_, step, proto::boundedText(error)};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Bounded if the manager is away: one per failed checkpoint, the newest kept.
    if (failures_.size() >= 16) failures_.pop_front();
    failures_.push_back(std::move(failure));
  }
  wake_.notify_all();
}

void ManagerLink::setSalvageStopHandler(std::function<void(const std::string& reason)> handler) {
  std::lock_guard<std::mutex> lock(mutex_);
  onSalvageStop_ = std::move(handler);
}

void ManagerLink::reportSalvageReady(const proto::SalvageReady& ready) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    salvageReady_ = ready;
  }
  wake_.notify_all();
}

std::optional<proto::SalvageWrite> ManagerLink::awaitSalvageWrite(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait_for(lock, timeout, [this] { return salvageWrite_.has_value(); });
  return salvageWrite_;
}

void ManagerLink::setStep(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  step_ = step;
}

void ManagerLink::run() {
  // No manager (started by hand or by varuna_launch.py): nothing to report
  // to, and never a reason to end the process.
  if (options_.address.empty()) return;
  std::optional<proto::ControlClient> client;
  bool warned = false;
  Clock::time_point lastSent{};  // the last heartbeat, report or failure: a heartbeat is due an interval after it
  Clock::time_point lastPing{};
  int64_t pingSequence = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    // Once stopping, one last round sends what is queued over a connection
    // that is up; no new connection is made for it, nothing is read, and the
    // grace no longer applies (the worker is ending on its own).
    const bool stopping = stop_;
    if (!client && !stopping && Clock::now() >= retryAt_) {
      lock.unlock();
      try {
        client.emplace(proto::ControlClient::connectAs(
            options_.address, timings_.connectTimeout + timings_.sendTimeout,
            proto::Hello{proto::kVersion, options_.token, "worker", options_.host, rank_, options_.generation}));
        lastSent = Clock::time_point{};  // a heartbeat right away: the manager learns the step at once
        directBeatDue_ = true;           // ...and from us: a relay could reach it before our hello
        lastPing = Clock::time_point{};
        warned = false;
      } catch (const std::exception& e) {
        client.reset();
        lastProblem_ = e.what();
        if (!warned) log::warn("cannot report to the manager (", e.what(), "); retrying in the background");
        warned = true;
        retryAt_ = Clock::now() + timings_.retryInterval;
      }
      checkGrace(Clock::now());
      lock.lock();
      continue;
    }
    // Step reports are dropped while there is no connection (they are stale
    // by the time it is back); failures stay queued (bounded) until it is.
    std::deque<proto::StepReport> reports;
    reports.swap(queue_);
    std::deque<proto::CheckpointFailed> failures;
    if (client) failures.swap(failures_);
    std::optional<proto::SalvageReady> salvageReady;
    if (client) salvageReady.swap(salvageReady_);
    const int64_t step = step_;
    lock.unlock();
    if (client) {
      try {
        // What the manager sent comes first: an exit order must not wait
        // behind anything this worker has to say.
        while (client && !stopping) {
          auto message = client->receive(std::chrono::milliseconds(0));
          if (!message) break;
          onManagerMessage(*message, client);
        }
        if (client && salvageReady) {
          client->send(*salvageReady, timings_.sendTimeout);
          salvageReady.reset();
        }
        if (client) {
          const auto now = Clock::now();
          const bool heartbeatDue = now - lastSent >= options_.heartbeatInterval;
          if (reports.empty() && failures.empty() && heartbeatDue && !stopping) {
            const bool waiting = waitingOnPeers_ && waitingOnPeers_->load(std::memory_order_relaxed);
            sendHeartbeat(*client, step, waiting);
            lastSent = now;
          }
          for (const auto& r : reports) sendStepReport(*client, r);
          for (const auto& f : failures) client->send(f, timings_.sendTimeout);
          if (stopping) {
            // What the manager sent is read (and dropped) so that the close
            // is a close, not a reset for unread data.
            try {
              while (client->receive(std::chrono::milliseconds(0))) {
              }
            } catch (const std::exception&) {
              // The manager closed first: nothing to drain.
            }
          }
          if (!reports.empty() || !failures.empty()) lastSent = now;
          // Pings only to hear the manager answer: the grace counts from the
          // last answer. Five per grace (which a Welcome may just have changed).
          if (!stopping && now - lastPing >= std::max(timings_.lostManagerGrace / 5, timings_.readInterval)) {
            const auto sentNs = std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
            client->send(proto::Ping{++pingSequence, sentNs}, timings_.sendTimeout);
            lastPing = now;
          }
        }
      } catch (const std::exception& e) {
        log::warn("lost the manager connection: ", e.what());
        lastProblem_ = e.what();
        client.reset();
        if (salvageReady) {  // sent again on the next connection
          std::lock_guard<std::mutex> relock(mutex_);
          if (!salvageReady_) salvageReady_ = salvageReady;
        }
        retryAt_ = Clock::now() + timings_.retryInterval;
      }
    }
    if (!stopping) checkGrace(Clock::now());
    lock.lock();
    if (stopping) break;
    // Woken by a report, a failure to send or the destructor; at the latest
    // after readInterval, to read what the manager sent.
    wake_.wait_for(lock, timings_.readInterval, [&] {
      return stop_ || !queue_.empty() || (client && (!failures_.empty() || salvageReady_.has_value()));
    });
  }
}

void ManagerLink::sendHeartbeat(proto::ControlClient& client, int64_t step, bool waiting) {
  if (agentBeatFd_ >= 0 && !directBeatDue_) {
    const auto record = AgentBeatRecord{rank_, waiting ? 1 : 0, step, monotonicNs()}.encode();
    if (::send(agentBeatFd_, record.data(), record.size(), MSG_DONTWAIT | MSG_NOSIGNAL) >= 0) return;
    // A full queue (the agent is busy or stopped): this beat is dropped; the
    // manager judges a stopped agent on its own heartbeats.
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) return;
    log::warn("cannot beat through the agent (", std::strerror(errno), "); beating to the manager directly");
    ::close(agentBeatFd_);
    agentBeatFd_ = -1;
  }
  client.send(proto::Heartbeat{rank_, step, waiting}, timings_.sendTimeout);
  directBeatDue_ = false;
}

void ManagerLink::sendStepReport(proto::ControlClient& client, const proto::StepReport& report) {
  if (agentBeatFd_ >= 0) {
    const auto record = AgentStepRecord{report.rank, report.stage, report.replica, report.step, report.loss,
                                        report.stepSeconds, report.computeSecondsPerMicrobatch}
                            .encode();
    if (::send(agentBeatFd_, record.data(), record.size(), MSG_DONTWAIT | MSG_NOSIGNAL) >= 0) return;
    // A full queue or a broken socket: this one goes directly (a report is
    // never dropped for that); sendHeartbeat decides about the socket.
  }
  client.send(report, timings_.sendTimeout);
}

void ManagerLink::onManagerMessage(const proto::Message& message, std::optional<proto::ControlClient>& client) {
  const auto now = Clock::now();
  if (const auto* ack = std::get_if<proto::Ack>(&message); ack && !ack->ok) {
    // Refused (e.g. a generation the manager does not know that it could not
    // order out): not an answer. Try again; the grace keeps running.
    const std::string why = proto::boundedText(ack->error, proto::kMaxLoggedPeerTextBytes);
    if (why != lastRefusal_) {
      log::warn("the manager refused this worker: ", why, "; exiting unless it is accepted within ",
                seconds(timings_.lostManagerGrace), " s of the last answer");
    }
    lastRefusal_ = why;
    lastProblem_ = "refused: " + why;
    client.reset();
    retryAt_ = now + timings_.retryInterval;
    return;
  }
  lastHeard_ = now;
  lastProblem_.clear();
  lastRefusal_.clear();
  if (const auto* order = std::get_if<proto::ExitNow>(&message)) {
    if (order->generation != options_.generation) {
      log::warn("ignoring an exit order for generation ", order->generation, ": this worker is of generation ",
                options_.generation);
      return;
    }
    exitProcess(strCat("run_varuna ended generation ", order->generation, ": ", order->reason));
  }
  if (const auto* welcome = std::get_if<proto::Welcome>(&message)) {
    if (welcome->lostManagerGraceMs > 0) timings_.lostManagerGrace = std::chrono::milliseconds(welcome->lostManagerGraceMs);
    salvageTimeoutMs_ = std::max<int64_t>(0, welcome->salvageTimeoutMs);
  }
  onSalvageOrder(message);
}

void ManagerLink::onSalvageOrder(const proto::Message& message) {
  if (const auto* stop = std::get_if<proto::SalvageStop>(&message); stop && stop->generation == options_.generation) {
    // Called under the lock: the runtime unhooks the handler (under it)
    // before what it reaches is destroyed. It only interrupts waits: quick.
    std::lock_guard<std::mutex> lock(mutex_);
    if (!onSalvageStop_) {
      exitProcess(strCat("run_varuna stopped generation ", stop->generation, " for a salvage (", stop->reason,
                         ") before this worker could take part"),
                  kExitPeerLost);
    }
    onSalvageStop_(stop->reason);
  } else if (const auto* write = std::get_if<proto::SalvageWrite>(&message);
             write && write->generation == options_.generation) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      salvageWrite_ = *write;
    }
    wake_.notify_all();
  }
}

void ManagerLink::checkGrace(Clock::time_point now) {
  if (now - lastHeard_ <= timings_.lostManagerGrace) return;
  exitProcess(strCat("nothing heard from the manager at ", options_.address, " for ",
                     seconds(timings_.lostManagerGrace), " s (",
                     lastProblem_.empty() ? std::string("no answer") : lastProblem_, "): generation ",
                     options_.generation, " is taken as over"));
}

void ManagerLink::exitProcess(const std::string& why, int code) {
  // The training thread may be blocked in c10d or writing a checkpoint: the
  // process ends from here, without destructors (exitWorker).
  log::error(why, "; exiting with code ", code);
  exitWorker(code);
}

}  // namespace varuna
