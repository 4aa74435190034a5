// StateFile: state.json in the state folder, what `run_varuna status` and
// operators read. Written atomically from every handler that changes the
// job, and once a second by the daemon's tick; a failure (a full disk) must
// not end the handler, let alone the manager: it is logged (rate-limited)
// and the tick writes again until it works (the state is rebuilt from
// scratch each time).
//
// The state is built on the caller's thread (the loop: it reads the loop's
// state), but turned into text and written by a thread of its own: at 10 000
// workers that is a megabyte, 10-15 ms of the loop's time once a second,
// which everything queued behind it would wait for. write() waits for its
// file (the state after a change is on disk when it returns);
// writeInBackground() does not (the tick's rewrite). Writes land in the order
// they were asked for; a background state not yet started is replaced by a
// newer one rather than written too. While writes fail, both wait, so the
// failure is known when they return.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "loop/rate_limiter.h"

namespace varuna {

class StateFile {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  // What a build makes: the state, and parts of it too large to copy on the
  // caller's thread that rarely change (the plan: 0.6 MB of JSON at 10 000
  // workers), shared, not copied; the writer sets each into `state` under its key.
  struct Snapshot {
    nlohmann::json state;  // an object
    std::vector<std::pair<std::string, std::shared_ptr<const nlohmann::json>>> shared;
  };
  using Build = std::function<Snapshot()>;

  explicit StateFile(std::string stateDir);
  ~StateFile();  // writes what is queued first
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  // Builds the state and writes it, returning once it is on disk; never throws.
  void write(const Build& build, TimePoint now);
  // Builds the state and queues it for writing; never throws.
  void writeInBackground(const Build& build, TimePoint now);
  // The tick's question: failing (retry), or not written for a second.
  bool due(TimePoint now) const;
  bool failing() const { return failing_; }
  // A write queued or running (tests wait for it before reading the file).
  bool writing() const;

 private:
  // Queues `state` (replacing a queued one not started) and returns its ticket.
  uint64_t enqueue(Snapshot snapshot);
  void waitFor(uint64_t ticket);
  void writerMain();
  void writeNow(Snapshot snapshot);

  std::string stateDir_;
  TimePoint lastWrite_{};  // loop thread only
  std::atomic<bool> failing_{false};
  RateLimiter log_{std::chrono::seconds(30), 1};  // writer thread only

  mutable std::mutex mutex_;  // guards what follows
  std::condition_variable wake_;  // the writer: a state is queued, or stop
  std::condition_variable done_;  // the callers: a state was written
  std::optional<Snapshot> queued_;
  uint64_t queuedTicket_ = 0;   // the ticket of queued_ (or of the last one queued)
  uint64_t writtenTicket_ = 0;  // every ticket up to this one is written (or failed)
  bool stopping_ = false;
  std::thread writer_;  // last: started once everything above exists
};

}  // namespace varuna
