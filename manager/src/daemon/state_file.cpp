#include "daemon/state_file.h"


#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/common/protocol.h"

namespace varuna {

StateFile::StateFile(std::string stateDir) : stateDir_(std::move(stateDir)), writer_([this] { writerMain(); }) {}

StateFile::~StateFile() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  writer_.join();
}

void StateFile::write(const Build& build, TimePoint now) {
  try {
    waitFor(enqueue(build()));
    lastWrite_ = now;
  } catch (const std::exception& e) {  // the build failed
    failing_ = true;
    log::error("cannot build state.json: ", proto::boundedText(e.what()));
  }
}

void StateFile::writeInBackground(const Build& build, TimePoint now) {
  if (failing_) {  // retrying: the caller learns at once whether it worked
    write(build, now);
    return;
  }
  try {
    enqueue(build());
    lastWrite_ = now;
  } catch (const std::exception& e) {
    failing_ = true;
    log::error("cannot build state.json: ", proto::boundedText(e.what()));
  }
}

bool StateFile::due(TimePoint now) const { return failing_ || now - lastWrite_ >= std::chrono::seconds(1); }

bool StateFile::writing() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return writtenTicket_ != queuedTicket_;
}

uint64_t StateFile::enqueue(Snapshot snapshot) {
  uint64_t ticket = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queued_ = std::move(snapshot);
    ticket = ++queuedTicket_;
  }
  wake_.notify_one();
  return ticket;
}

void StateFile::waitFor(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return writtenTicket_ >= ticket; });
}

void StateFile::writerMain() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return queued_.has_value() || stopping_; });
    if (!queued_) return;  // stopping, and everything is written
    Snapshot snapshot = std::move(*queued_);
    queued_.reset();
    const uint64_t ticket = queuedTicket_;  // a replaced state's ticket is covered by its successor's
    lock.unlock();
    writeNow(std::move(snapshot));
    lock.lock();
    writtenTicket_ = ticket;
    done_.notify_all();
  }
}

void StateFile::writeNow(Snapshot snapshot) {
  try {
    nlohmann::json state = std::move(snapshot.state);
    for (const auto& [key, part] : snapshot.shared) state[key] = part ? *part : nlohmann::json();
    ckpt::writeFileAtomic(stateDir_, "state.json",
                          state.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
    if (failing_.exchange(false)) log::info("state.json written again");
  } catch (const std::exception& e) {
    failing_ = true;
    uint64_t suppressed = 0;
    if (log_.allow(std::chrono::steady_clock::now(), &suppressed)) {
      log::error("cannot write ", stateDir_, "/state.json: ", proto::boundedText(e.what()), "; retrying at every tick",
                 suppressed ? strCat(" (", suppressed, " more failures)") : std::string());
    }
  }
}

}  // namespace varuna
