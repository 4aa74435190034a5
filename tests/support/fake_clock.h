// FakeClock: a Clock (varuna/manager/clock.h) that moves only when a test
// moves it. advanceTo() walks time forward to each pending timer's deadline
// in turn, earliest first (ties in the order they were set), and calls its
// callback right there, on the caller's thread: that must be the thread that
// runs the loop (DaemonHarness::runUntil does). Timers ignore the io_context
// they are made for.
//
// Starts far from the clock's epoch: the daemon reads a default TimePoint{}
// as "never".
// Single-threaded: every member runs on the test thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "varuna/manager/clock.h"

namespace varuna::test {

class FakeClock : public Clock {
 public:
  FakeClock() = default;
  FakeClock(const FakeClock&) = delete;
  FakeClock& operator=(const FakeClock&) = delete;
  // A one-shot (runAfter) holds its timer in its own callback: dropping
  // every callback still pending breaks those cycles.
  ~FakeClock() override {
    for (auto& weak : entries_) {
      if (auto entry = weak.lock()) entry->callback = nullptr;
    }
  }

  TimePoint now() const override { return now_; }
  std::unique_ptr<Timer> makeTimer(boost::asio::io_context&) override {
    auto entry = std::make_shared<Entry>();
    entries_.push_back(entry);
    return std::make_unique<FakeTimer>(*this, std::move(entry));
  }

  // The earliest deadline of a pending callback, if any.
  std::optional<TimePoint> nextDeadline() {
    prune();
    std::optional<TimePoint> next;
    for (const auto& weak : entries_) {
      auto entry = weak.lock();
      if (entry && entry->callback && (!next || entry->at < *next)) next = entry->at;
    }
    return next;
  }

  // Moves to `to`, running every callback that falls due on the way, each at
  // its own deadline (a callback may set timers that fall due before `to`).
  void advanceTo(TimePoint to) {
    while (auto entry = earliestDue(to)) {
      now_ = std::max(now_, entry->at);
      auto callback = std::move(entry->callback);
      entry->callback = nullptr;
      callback();
    }
    now_ = std::max(now_, to);
  }
  void advance(Duration by) { advanceTo(now_ + by); }

 private:
  struct Entry {
    TimePoint at;
    uint64_t order = 0;  // when it was set: ties run in that order
    std::function<void()> callback;  // empty: nothing pending
  };

  class FakeTimer : public Timer {
   public:
    FakeTimer(FakeClock& clock, std::shared_ptr<Entry> entry) : clock_(clock), entry_(std::move(entry)) {}
    void expireAfter(Duration delay, std::function<void()> callback) override {
      entry_->at = clock_.now_ + delay;
      entry_->order = clock_.nextOrder_++;
      entry_->callback = std::move(callback);
    }
    void cancel() override { entry_->callback = nullptr; }

   private:
    FakeClock& clock_;
    std::shared_ptr<Entry> entry_;  // the clock keeps a weak_ptr: a destroyed timer is gone
  };

  std::shared_ptr<Entry> earliestDue(TimePoint to) {
    prune();
    std::shared_ptr<Entry> best;
    for (const auto& weak : entries_) {
      auto entry = weak.lock();
      if (!entry || !entry->callback || entry->at > to) continue;
      if (!best || entry->at < best->at || (entry->at == best->at && entry->order < best->order)) best = entry;
    }
    return best;
  }
  void prune() {
    std::erase_if(entries_, [](const std::weak_ptr<Entry>& weak) { return weak.expired(); });
  }

  TimePoint now_ = TimePoint{} + std::chrono::hours(1000);
  uint64_t nextOrder_ = 0;
  std::vector<std::weak_ptr<Entry>> entries_;
};

}  // namespace varuna::test
