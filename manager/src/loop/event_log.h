// EventLog: the manager's record of what happened to the job, one JSON object
// per line in <state_dir>/events.jsonl ({"time": ISO-8601, "unix_ms", "event",
// ...fields}): launches, agent failures, worker exits, notices, morphs with
// the duration of each phase. Appends and flushes every line, so a crash loses
// nothing already logged. write() never throws: a line that cannot be written
// (full disk) is counted and logged (rate-limited) and the next one tries
// again; bytes that are not UTF-8 are replaced. Past `maxBytes` the file is
// renamed events.jsonl.1 (replacing the one before) and a new one started, so
// a job of months, or a flood, never fills the state disk: what is kept is
// between maxBytes and twice that. Used from the manager's event-loop thread only.
#pragma once

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "loop/rate_limiter.h"

namespace varuna {

class EventLog {
 public:
  static constexpr uint64_t kDefaultMaxBytes = 64ull << 20;
  explicit EventLog(const std::string& path, uint64_t maxBytes = kDefaultMaxBytes);
  void write(const std::string& event, nlohmann::json fields = nlohmann::json::object()) noexcept;
  const std::string& path() const { return path_; }
  uint64_t lost() const { return lost_; }

 private:
  void noteLost(const char* why) noexcept;
  // Past maxBytes_: the file becomes <path>.1 and a new one starts.
  void rotate();

  std::string path_;
  std::ofstream out_;
  uint64_t maxBytes_;
  uint64_t bytes_ = 0;  // in the current file
  uint64_t lost_ = 0;
  RateLimiter lostLog_{std::chrono::seconds(10), 1};
};

// "2026-11-22T04:21:51.123Z": now, or a time given in milliseconds since 1970.
std::string isoTimeNow();
std::string isoTime(int64_t unixMs);
int64_t unixMillisNow();

}  // namespace varuna
