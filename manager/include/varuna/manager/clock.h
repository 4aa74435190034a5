// Clock and Timer: the time seam of run_varuna's event loop. Every part of
// the daemon that waits, times out or backs off reads the time and sets its
// timers through a Clock handed in from outside, so tests can run the daemon
// on a fake clock they move by hand (tests/support/fake_clock.h) and a
// sequence of minutes of job time takes milliseconds.
//
// realClock() is std::chrono::steady_clock with Asio's steady_timer: a
// Timer's callback runs as a handler of the io_context the timer was made
// for. A Timer is used on that loop's thread only; realClock() itself is
// stateless and may be read from any thread.
//
// What stays on the real clock on purpose: the rate limits of log lines
// (HandlerGuard, EventLog), which decide nothing, and wall-clock times
// (event stamps, preemption deadlines in Unix milliseconds).
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <functional>
#include <memory>

namespace varuna {

// One pending callback at most. Destroying the timer or cancelling it drops
// the pending callback: it is never called (unlike an Asio handler, there is
// no operation_aborted call to ignore).
class Timer {
 public:
  using Duration = std::chrono::steady_clock::duration;
  virtual ~Timer() = default;
  // Calls `callback` on the loop once `delay` has passed; replaces (drops)
  // any callback still pending.
  virtual void expireAfter(Duration delay, std::function<void()> callback) = 0;
  virtual void cancel() = 0;
};

class Clock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  using Duration = std::chrono::steady_clock::duration;
  virtual ~Clock() = default;

  virtual TimePoint now() const = 0;
  // A timer whose callbacks run on `io`'s thread.
  virtual std::unique_ptr<Timer> makeTimer(boost::asio::io_context& io) = 0;

  // A one-shot that owns itself: `callback` runs once after `delay`, with
  // nothing to keep alive or cancel (a shutdown's last steps).
  void runAfter(boost::asio::io_context& io, Duration delay, std::function<void()> callback);
};

// The process's steady clock and Asio timers (run_varuna, the bench).
Clock& realClock();

}  // namespace varuna
