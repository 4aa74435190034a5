// StateFile: state.json in the state folder, what `run_varuna status` and
// operators read. Written atomically from every handler that changes the
// job; a failure (a full disk) must not end the handler, let alone the
// manager: it is logged (rate-limited) and the daemon's tick writes again
// until it works (the state is rebuilt from scratch each time).
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "loop/rate_limiter.h"

namespace varuna {

class StateFile {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  explicit StateFile(std::string stateDir) : stateDir_(std::move(stateDir)) {}

  // Builds the state and writes it; never throws.
  void write(const std::function<nlohmann::json()>& build, TimePoint now);
  // The tick's question: failing (retry), or not written for a second.
  bool due(TimePoint now) const { return failing_ || now - lastWrite_ >= std::chrono::seconds(1); }
  bool failing() const { return failing_; }

 private:
  std::string stateDir_;
  TimePoint lastWrite_{};
  bool failing_ = false;
  RateLimiter log_{std::chrono::seconds(30), 1};
};

}  // namespace varuna
