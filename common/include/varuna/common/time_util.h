// Time conversions and the doubling backoff, shared by the manager's parts
// (configuration is in seconds as doubles; clocks and timers want durations).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace varuna {

// Seconds from `a` to `b` (negative when b is earlier).
template <typename TimePoint>
double secondsBetween(TimePoint a, TimePoint b) {
  return std::chrono::duration<double>(b - a).count();
}

// A configured number of seconds as milliseconds (rounded down).
inline std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

inline double seconds(std::chrono::milliseconds duration) { return static_cast<double>(duration.count()) / 1000; }

// The wall clock, in seconds since 1970 (credential expiries).
inline int64_t unixSecondsNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// From `nowUnixMs` until `deadlineUnixMs` (milliseconds since 1970), at
// least 0 and at most `most`: a deadline a peer sent may lie far in the
// future, where adding it to a time point would overflow.
inline std::chrono::milliseconds clampedUntil(int64_t deadlineUnixMs, int64_t nowUnixMs,
                                              std::chrono::milliseconds most) {
  if (deadlineUnixMs <= nowUnixMs) return std::chrono::milliseconds(0);
  const uint64_t ahead = static_cast<uint64_t>(deadlineUnixMs) - static_cast<uint64_t>(nowUnixMs);
  return std::chrono::milliseconds(static_cast<int64_t>(std::min<uint64_t>(ahead, most.count())));
}

// A wait that doubles after each failure, from `first` up to `most`; reset()
// after a success starts it over.
class DoublingBackoff {
 public:
  DoublingBackoff(std::chrono::milliseconds first, std::chrono::milliseconds most)
      : first_(first), most_(std::max(first, most)) {}

  // The wait before the next try: `first`, then twice the last, capped at `most`.
  std::chrono::milliseconds next() { return current_ = after(current_, first_, most_); }
  // The same rule for a wait kept elsewhere (0: none yet).
  static std::chrono::milliseconds after(std::chrono::milliseconds last, std::chrono::milliseconds first,
                                         std::chrono::milliseconds most) {
    return last.count() == 0 ? first : std::min(2 * last, std::max(first, most));
  }
  std::chrono::milliseconds current() const { return current_; }
  void reset() { current_ = std::chrono::milliseconds(0); }

 private:
  std::chrono::milliseconds first_;
  std::chrono::milliseconds most_;
  std::chrono::milliseconds current_{0};
};

}  // namespace varuna
