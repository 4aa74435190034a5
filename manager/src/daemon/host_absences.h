// HostAbsences: the listed hosts that are out of the job, why, and when each
// may come back (docs/run_varuna.md, "When lost, preempted and slow hosts
// come back"). Pure bookkeeping on the caller's clock, no I/O: the agent pool
// starts the agents, this says when.
//
// The rules in one place:
//  - lost or failed to start: its agent is started again after a backoff that
//    doubles per failure, from RetryPolicy::first to ::most (first 0: only a
//    write of the machine list brings it back);
//  - preempted: out until the notice's deadline, tried like a lost host after;
//  - slow (--exclude_slow): back only when the machine list is written;
//  - a write of the machine list gives every host it lists another chance now;
//  - a host lost again soon after it came back (flapping) continues its
//    backoff instead of starting over.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace varuna {

struct HostAbsence {
  using TimePoint = std::chrono::steady_clock::time_point;
  std::string why;  // the first reason: "lost", "agent_failed", "preempted", "slow", "released"
  TimePoint since{};
  std::optional<TimePoint> retryAt;         // its agent's next start-up (none: when the list is written)
  std::chrono::milliseconds backoff{0};     // the wait after the next failed start-up or loss
  // The notice's deadline: not back before it. Set from a notice until the
  // host is back or readmitted (HostAbsences::preempted).
  std::optional<TimePoint> preemptedUntil;
  bool slow = false;                        // --exclude_slow: back only when the list is written
  int attempts = 0;                         // start-ups since it went
};

struct RetryPolicy {
  std::chrono::milliseconds first{0};  // 0: no retries, only list writes
  std::chrono::milliseconds most{0};
};

class HostAbsences {
 public:
  using TimePoint = HostAbsence::TimePoint;

  explicit HostAbsences(RetryPolicy policy) : policy_(policy) {}

  // Records that `host` is out; the first reason stays.
  HostAbsence& markAbsent(const std::string& host, const std::string& why, TimePoint now);
  // After a loss or a failed start-up: the next start-up after the backoff.
  void scheduleRetry(const std::string& host, TimePoint now);
  // A preemption notice: out until `until`, then tried like a lost host.
  void markPreempted(const std::string& host, TimePoint until, TimePoint now);
  // Excluded as slow: back only when the machine list is written.
  void markSlow(const std::string& host, TimePoint now);
  // A start-up of its agent begins.
  void noteAttempt(const std::string& host);

  // True when nothing but its agent keeps `host` out (not slow, past the notice).
  bool mayComeBack(const std::string& host, TimePoint now) const;
  bool preempted(const std::string& host) const;
  // Out, with a start-up due by `now`.
  bool retryDue(const std::string& host, TimePoint now) const;

  // `host` is usable again: its record, which is forgotten. Empty if it was not out.
  std::optional<HostAbsence> back(const std::string& host, TimePoint now);
  // The machine list was written and lists `host`: if it is out, every reason
  // to wait is cleared and it is due now. Returns the reason it was out, if it was.
  std::optional<std::string> readmit(const std::string& host, TimePoint now);

  // A host no longer listed: nothing of it is kept.
  void forget(const std::string& host) {
    absent_.erase(host);
    returned_.erase(host);
  }

  const HostAbsence* find(const std::string& host) const;
  HostAbsence* find(const std::string& host);
  const std::map<std::string, HostAbsence>& all() const { return absent_; }
  bool empty() const { return absent_.empty(); }
  const RetryPolicy& policy() const { return policy_; }

  // state.json's "out" of a host: why, since when, what brings it back (null if it is in).
  nlohmann::json describe(const std::string& host, bool agentStarting, TimePoint now) const;

 private:
  RetryPolicy policy_;
  std::map<std::string, HostAbsence> absent_;
  // When each host came back and its backoff then (flapping).
  std::map<std::string, std::pair<TimePoint, std::chrono::milliseconds>> returned_;
};

}  // namespace varuna
