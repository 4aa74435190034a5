#include "varuna/manager/clock.h"

#include <boost/asio/steady_timer.hpp>

namespace varuna {
namespace {

class SteadyTimer : public Timer {
 public:
  explicit SteadyTimer(boost::asio::io_context& io) : timer_(io) {}
  void expireAfter(Duration delay, std::function<void()> callback) override {
    timer_.expires_after(delay);  // cancels a wait still pending: its handler sees the abort and drops it
    timer_.async_wait([callback = std::move(callback)](const boost::system::error_code& ec) {
      if (!ec) callback();
    });
  }
  void cancel() override { timer_.cancel(); }

 private:
  boost::asio::steady_timer timer_;
};

class SteadyClock : public Clock {
 public:
  TimePoint now() const override { return std::chrono::steady_clock::now(); }
  std::unique_ptr<Timer> makeTimer(boost::asio::io_context& io) override { return std::make_unique<SteadyTimer>(io); }
};

}  // namespace

void Clock::runAfter(boost::asio::io_context& io, Duration delay, std::function<void()> callback) {
  // The timer lives in its own callback until that runs (or, with the loop
  // gone, is destroyed with the callback).
  std::shared_ptr<Timer> timer = makeTimer(io);
  Timer& raw = *timer;
  raw.expireAfter(delay, [timer = std::move(timer), callback = std::move(callback)]() mutable {
    auto self = std::move(timer);  // released once the callback has run
    callback();
  });
}

Clock& realClock() {
  static SteadyClock clock;
  return clock;
}

}  // namespace varuna
