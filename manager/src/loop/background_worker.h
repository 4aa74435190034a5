// BackgroundWorker: one thread with a queue, for the work run_varuna's event
// loop must not wait on: looking at the checkpoint store (a listing and a
// stat per file, which a network filesystem can stall for seconds) and
// AutoConfig's planning (seconds of CPU for a big cluster). Each job's result
// is posted back to the loop's io_context, where its completion runs; so the
// loop only ever sees finished results, in the order the jobs were queued.
//
// Owned by the ManagerDaemon (and by the agent, for its log cap); run() and
// pending() are called on the loop thread only. Its thread blocks every
// signal: they are the loop's. A job's work runs on the worker's thread and must not touch
// the loop's state (it gets copies); its completion runs on the loop thread.
// work() reports its errors in its result: an exception it throws anyway is
// logged and that job's completion is not run (pending() still drops).
//
// Destruction (on the loop thread, or after the loop stopped) discards the
// jobs not started, waits for the one running (it is not interrupted: a
// stalled filesystem call delays the exit by as much) and joins; results
// posted but not yet run are dropped, so a completion never runs on a
// destroyed owner.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace varuna {

class BackgroundWorker {
 public:
  // `name` names the thread (ps, gdb) and the log lines; at most 15 characters are kept.
  BackgroundWorker(boost::asio::io_context& loop, std::string name);
  ~BackgroundWorker();
  BackgroundWorker(const BackgroundWorker&) = delete;
  BackgroundWorker& operator=(const BackgroundWorker&) = delete;

  // Queues work() (after the jobs queued before it); done(result) then runs
  // on the loop. Work and Done must be copyable; the result is moved.
  template <typename Work, typename Done>
  void run(Work work, Done done) {
    ++pending_;
    enqueue([this, work = std::move(work), done = std::move(done)]() mutable {
      auto result = std::make_shared<decltype(work())>(work());
      deliver([done = std::move(done), result]() mutable { done(std::move(*result)); });
    });
  }

  // Jobs queued or running whose completion has not run yet (loop thread).
  size_t pending() const { return pending_; }

 private:
  void enqueue(std::function<void()> job);
  // Posts `completion` to the loop; it runs only while this worker exists.
  void deliver(std::function<void()> completion);
  void threadMain();

  boost::asio::io_context& loop_;
  std::string name_;
  // Read by posted completions on the loop thread: false once this is gone.
  std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);
  size_t pending_ = 0;  // loop thread only

  std::mutex mutex_;  // guards queue_ and stopping_
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;  // last: started (in the constructor's body) once everything above exists
};

}  // namespace varuna
