// SchedulerNotice: a scheduler's SIGTERM turned into a preemption notice.
//
// Slurm (preemption with GraceTime, a time limit with --signal) and
// Kubernetes (pod termination, terminationGracePeriodSeconds) announce that a
// machine goes by sending SIGTERM, then SIGKILL after a grace time. An agent
// started with --sigterm_notice_s G takes the first SIGTERM as "this host is
// taken G seconds from now": it tells the manager at once, as
// notify_manager_preempt would (its notifier credential, on a thread of its
// own so the agent's loop keeps beating), and the manager morphs the job off
// the host before the deadline. The agent exits once the manager has stopped
// its workers, or just before the deadline at the latest (killing them), so
// the scheduler finds nothing left.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

namespace varuna {

class SchedulerNotice {
 public:
  SchedulerNotice(boost::asio::io_context& io, std::chrono::milliseconds grace);
  // Waits for the sending thread: its connect, sends and answer are each
  // bounded by the notice's timeout (at most 5 s, at most half the grace).
  ~SchedulerNotice();
  SchedulerNotice(const SchedulerNotice&) = delete;
  SchedulerNotice& operator=(const SchedulerNotice&) = delete;

  struct Target {
    std::string managerAddress, credential, host;  // credential: the host's notifier credential
  };
  // Sends the notice (deadline: now + grace). `onAnswer(acknowledged)` runs on
  // the io_context once the manager answered or could not be reached;
  // `onDeadline()` runs there when the time left is down to the exit margin.
  void start(Target target, std::function<void(bool acknowledged)> onAnswer, std::function<void()> onDeadline);
  bool started() const { return started_; }
  void cancel() { deadlineTimer_.cancel(); }

  // What is kept of the grace for the exit: a second, but at most half of it.
  static std::chrono::milliseconds exitMargin(std::chrono::milliseconds grace);

 private:
  boost::asio::io_context& io_;
  std::chrono::milliseconds grace_;
  boost::asio::steady_timer deadlineTimer_;
  std::thread sender_;
  bool started_ = false;
};

}  // namespace varuna
