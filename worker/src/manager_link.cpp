#include "manager_link.h"

#include "varuna/common/control_client.h"
#include "varuna/common/log.h"

namespace varuna {

ManagerLink::ManagerLink(ManagerLinkOptions options, int rank)
    : options_(std::move(options)), rank_(rank), thread_([this] { run(); }) {}

ManagerLink::~ManagerLink() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void ManagerLink::reportStep(const proto::StepReport& report) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.size() < 1000) queue_.push_back(report);  // bounded if the manager is away
    step_ = report.step;
  }
  wake_.notify_all();
}

void ManagerLink::reportCheckpointFailure(int64_t step, const std::string& error) {
  proto::CheckpointFailed failure{rank_, step, proto::boundedText(error)};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Bounded if the manager is away: one per failed checkpoint, the newest kept.
    if (failures_.size() >= 16) failures_.pop_front();
    failures_.push_back(std::move(failure));
  }
  wake_.notify_all();
}

void ManagerLink::setStep(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  step_ = step;
}

void ManagerLink::run() {
  std::optional<proto::ControlClient> client;
  bool warned = false;
  auto retryAt = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    // Once stopping, one last round sends what is queued over a connection
    // that is up; no new connection is made for it.
    const bool stopping = stop_;
    const auto now = std::chrono::steady_clock::now();
    if (!client && !stopping && now >= retryAt) {
      lock.unlock();
      try {
        client.emplace(proto::ControlClient::connect(options_.address, std::chrono::seconds(2)));
        client->send(proto::Hello{proto::kVersion, options_.token, "worker", options_.host, rank_, options_.generation});
        warned = false;
      } catch (const std::exception& e) {
        client.reset();
        if (!warned) log::warn("cannot report to the manager (", e.what(), "); retrying in the background");
        warned = true;
        retryAt = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      }
      lock.lock();
      continue;
    }
    // Step reports are dropped while there is no connection (they are stale
    // by the time it is back); failures stay queued (bounded) until it is.
    std::deque<proto::StepReport> reports;
    reports.swap(queue_);
    std::deque<proto::CheckpointFailed> failures;
    if (client) failures.swap(failures_);
    const int64_t step = step_;
    lock.unlock();
    if (client) {
      try {
        if (reports.empty() && failures.empty() && !stopping) client->send(proto::Heartbeat{rank_, step});
        for (const auto& r : reports) client->send(r);
        for (const auto& f : failures) client->send(f);
      } catch (const std::exception& e) {
        log::warn("lost the manager connection: ", e.what());
        client.reset();
        retryAt = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      }
    }
    lock.lock();
    if (stopping) break;
    wake_.wait_for(lock, options_.heartbeatInterval,
                   [&] { return stop_ || !queue_.empty() || (client && !failures_.empty()); });
  }
}

}  // namespace varuna
