#include "agent/scheduler_notice.h"

#include <pthread.h>
#include <signal.h>

#include <boost/asio/post.hpp>

#include "varuna/common/control_client.h"
#include "varuna/common/log.h"
#include "loop/event_log.h"

namespace varuna {

SchedulerNotice::SchedulerNotice(boost::asio::io_context& io, std::chrono::milliseconds grace)
    : io_(io), grace_(grace), deadlineTimer_(io) {}

SchedulerNotice::~SchedulerNotice() {
  if (sender_.joinable()) sender_.join();
}

std::chrono::milliseconds SchedulerNotice::exitMargin(std::chrono::milliseconds grace) {
  return std::min(std::chrono::milliseconds(1000), grace / 2);
}

void SchedulerNotice::start(Target target, std::function<void(bool)> onAnswer, std::function<void()> onDeadline) {
  if (started_) return;
  started_ = true;
  const auto deadlineUnixMs = unixMillisNow() + grace_.count();
  log::warn("SIGTERM: the scheduler takes ", target.host, " in ", grace_.count() / 1000.0,
            " s: telling the manager (a second SIGTERM or a SIGINT stops the workers at once)");
  // The manager gets its answer within the grace or not at all.
  const auto timeout = std::max(std::chrono::milliseconds(500), std::min(std::chrono::milliseconds(5000), grace_ / 2));
  // The thread starts with every signal blocked: the agent's loop takes
  // SIGCHLD and SIGTERM, and the notice's system calls are not interrupted.
  sigset_t all, previous;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &previous);
  sender_ = std::thread([this, target = std::move(target), deadlineUnixMs, timeout, onAnswer = std::move(onAnswer)] {
    bool acknowledged = false;
    try {
      proto::notifyPreemption(target.managerAddress, target.credential, target.host, deadlineUnixMs, timeout);
      acknowledged = true;
      log::info("the manager acknowledged the notice for ", target.host);
    } catch (const std::exception& e) {
      log::warn("could not tell the manager that ", target.host, " goes: ", e.what(),
                " (the workers run until the scheduler's deadline)");
    }
    boost::asio::post(io_, [onAnswer, acknowledged] { onAnswer(acknowledged); });
  });
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  deadlineTimer_.expires_after(grace_ - exitMargin(grace_));
  deadlineTimer_.async_wait([onDeadline = std::move(onDeadline)](const boost::system::error_code& ec) {
    if (!ec) onDeadline();
  });
}

}  // namespace varuna
