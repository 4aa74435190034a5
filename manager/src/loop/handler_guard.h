// HandlerGuard: where an exception thrown by an event-loop handler ends.
// run_varuna wraps every handler it gives to Asio (accepts, timers, results
// posted by launch threads) and every callback of its connections in one
// guard, so that no exception escapes io_context::run() (which would end the
// manager, and the job's supervision with it). A failure is logged,
// rate-limited (a handler that fails on every heartbeat must not flood the
// log), and counted; what else is done about it is the caller's choice: a
// timer re-arms itself, a connection whose callback failed is closed, a state
// write is retried at the next tick.
// Used on one thread (the daemon's event loop); it does not lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>
#include <utility>

#include "loop/rate_limiter.h"

namespace varuna {

class HandlerGuard {
 public:
  // At most 5 lines per 10 s by default.
  explicit HandlerGuard(std::chrono::steady_clock::duration window = std::chrono::seconds(10), int burst = 5)
      : limiter_(window, burst) {}
  HandlerGuard(const HandlerGuard&) = delete;
  HandlerGuard& operator=(const HandlerGuard&) = delete;

  // Runs body(); an exception it throws is reported (see report) and not
  // rethrown. Returns false if it threw. `what` names the handler in the log.
  template <typename Body>
  bool run(std::string_view what, Body&& body) noexcept {
    try {
      body();
      return true;
    } catch (const std::exception& e) {
      report(what, e.what());
    } catch (...) {
      report(what, "an exception that is not a std::exception");
    }
    return false;
  }

  // A handler for Asio (or any callback) that calls f(args...) under run().
  // The guard must outlive the handler.
  template <typename F>
  auto wrap(const char* what, F f) {
    return [this, what, f = std::move(f)](auto&&... args) mutable {
      run(what, [&] { f(std::forward<decltype(args)>(args)...); });
    };
  }

  // Logs "<what> failed: <error>" (at most 500 bytes of it, valid UTF-8),
  // rate-limited, and counts it. Never throws.
  void report(std::string_view what, std::string_view error) noexcept;

  uint64_t failures() const { return failures_; }

 private:
  RateLimiter limiter_;
  uint64_t failures_ = 0;
};

}  // namespace varuna
