// RateLimiter: at most `burst` lines per window, counting the rest, for any
// log line a peer or a failing disk could otherwise repeat at heartbeat rate.
// The caller passes the time (testable without sleeping). Not thread-safe:
// one per thread that uses it (run_varuna: the event loop).
#pragma once

#include <chrono>
#include <cstdint>

namespace varuna {

class RateLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  RateLimiter(Clock::duration window, int burst) : window_(window), burst_(burst) {}

  // True if a line may be written at `now`. `suppressed` (optional) gets how
  // many calls were refused since the previous line allowed, for the line to say.
  bool allow(Clock::time_point now, uint64_t* suppressed = nullptr) {
    if (windowStart_ == Clock::time_point{} || now - windowStart_ >= window_) {
      windowStart_ = now;
      usedInWindow_ = 0;
    }
    if (usedInWindow_ >= burst_) {
      ++suppressed_;
      return false;
    }
    ++usedInWindow_;
    if (suppressed) *suppressed = suppressed_;
    suppressed_ = 0;
    return true;
  }

 private:
  Clock::duration window_;
  int burst_;
  Clock::time_point windowStart_{};
  int usedInWindow_ = 0;
  uint64_t suppressed_ = 0;
};

}  // namespace varuna
