// CheckpointWatcher: what the manager knows of the job's checkpoint store.
// Every look at the store runs on its own thread (a BackgroundWorker), never
// on the loop: a stalled network filesystem must not stall heartbeats. It
// keeps the newest usable checkpoint (checkpoint_complete when it changes),
// reports the complete-looking ones it passes over (checkpoint_skipped, once
// each) and a store it cannot read (store_error, once per error, keeping the
// last checkpoint known: never a fresh start for a read error).
//
// A launch's store work is here too: the generation record (fencing) and a
// thorough scan for the checkpoint to resume from.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "loop/background_worker.h"
#include "varuna/manager/checkpoint_scan.h"
#include "loop/event_log.h"
#include "varuna/manager/clock.h"
#include "loop/handler_guard.h"

namespace varuna {

class CheckpointWatcher {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  // What a launch needs from the store.
  struct LaunchPrep {
    std::string recordError;  // the generation record could not be written (no launch)
    StoreScan scan;           // thorough
  };

  CheckpointWatcher(boost::asio::io_context& io, std::shared_ptr<HandlerGuard> guard, EventLog& events,
                    std::string globalStore, StoreScanner scanner, Clock& clock);
  // Jobs on the store's thread whose result has not reached the loop yet
  // (tests on a fake clock hold time still while there are any).
  size_t pendingJobs() const { return worker_->pending(); }

  // At start-up, before the loop runs (nothing waits on it yet): synchronously.
  void scanNow();
  // The periodic look: at most one in flight (a slow store gets one scan at a
  // time, not a queue of them).
  void poll();
  // The last look, at the stop (queued even if a scan is in flight: that one
  // may predate the final checkpoint); `done` runs on the loop when it is back.
  void finalScan(std::function<void()> done);
  bool finalScanDone() const { return finalScanDone_; }
  // Records `generation` in the store and scans it thoroughly; `done` gets
  // the result on the loop.
  void prepareLaunch(int generation, std::function<void(const LaunchPrep&)> done);
  // A scan's newest usable checkpoint (see the top), as readStoreScan does
  // for a launch's scan; then `note` it.
  std::optional<int64_t> read(const StoreScan& scan);
  // `ageSeconds`: the scan's latestAgeSeconds, which dates its completion.
  void note(std::optional<int64_t> latest, TimePoint now, std::optional<double> ageSeconds = std::nullopt);

  std::optional<int64_t> latest() const { return latest_; }
  TimePoint latestSeenAt() const { return latestSeenAt_; }  // zero: not seen since this manager started
  // When the latest was completed, from its marker's age (also for one
  // completed before this manager started); unknown if the store did not say.
  std::optional<TimePoint> latestCompletedAt() const { return latestCompletedAt_; }
  const std::set<int64_t>& skipped() const { return skipped_; }

 private:
  StoreScanRequest request(bool thorough) const { return StoreScanRequest{globalStore_, thorough, latest_}; }
  void scanned(const StoreScan& scan);

  Clock& clock_;
  std::shared_ptr<HandlerGuard> guard_;
  EventLog& events_;
  std::string globalStore_;
  StoreScanner scanner_;
  std::optional<int64_t> latest_;
  TimePoint latestSeenAt_{};
  std::optional<TimePoint> latestCompletedAt_;
  std::set<int64_t> skipped_;  // reported as checkpoint_skipped
  std::string readError_;      // the last error reading the store (logged once per text)
  bool scanInFlight_ = false;
  bool finalScanDone_ = true;  // false from the stop until its final scan is back
  // Last: destroyed first, so no result reaches a half-destroyed watcher
  // (its destructor drops what is queued and waits for the job running).
  std::unique_ptr<BackgroundWorker> worker_;
};

}  // namespace varuna
