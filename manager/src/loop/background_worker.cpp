#include "loop/background_worker.h"

#include <pthread.h>
#include <signal.h>

#include "varuna/common/log.h"

namespace varuna {

BackgroundWorker::BackgroundWorker(boost::asio::io_context& loop, std::string name)
    : loop_(loop), name_(std::move(name)) {
  // Every signal blocked in the thread from its first instruction (it
  // inherits the mask): SIGCHLD, SIGTERM and the rest go to the loop's
  // thread, where Asio's signal_set waits, and never interrupt a job.
  sigset_t all, previous;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &previous);
  try {
    thread_ = std::thread([this] { threadMain(); });
  } catch (...) {
    ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
    throw;
  }
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
}

BackgroundWorker::~BackgroundWorker() {
  alive_->store(false);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    queue_.clear();  // not started: nobody will read their results
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void BackgroundWorker::enqueue(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(job));
  }
  wake_.notify_one();
}

void BackgroundWorker::deliver(std::function<void()> completion) {
  boost::asio::post(loop_, [this, alive = alive_, completion = std::move(completion)]() mutable {
    if (!alive->load()) return;  // `this` is gone
    --pending_;
    completion();
  });
}

void BackgroundWorker::threadMain() {
  ::pthread_setname_np(::pthread_self(), name_.substr(0, 15).c_str());
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      job();
    } catch (const std::exception& e) {
      // A thread's exception would end the process; the job's owner gets no result.
      log::error(name_, ": a background job failed: ", e.what());
      deliver([] {});
    } catch (...) {
      log::error(name_, ": a background job failed with an exception that is not a std::exception");
      deliver([] {});
    }
  }
}

}  // namespace varuna
