#include "checkpoint_writer.h"

#include <utility>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"

namespace varuna {

CheckpointWriter::CheckpointWriter(int rank, int worldSize)
    : rank_(rank), worldSize_(worldSize), thread_([this] { loop(); }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;  // queued jobs still run: a checkpoint is never dropped silently
  }
  changed_.notify_all();
  thread_.join();
}

void CheckpointWriter::execute(const CheckpointJob& job) {
  namespace fs = std::filesystem;
  const fs::path dir = ckpt::checkpointDir(job.globalStore, job.step);
  const fs::path local = job.tempdir.empty() ? fs::path() : ckpt::checkpointDir(job.tempdir, job.step);
  std::vector<ckpt::FileEntry> entries;
  for (const auto& file : job.files) {
    const std::string bytes = file.serialize();
    if (local.empty()) {
      entries.push_back(ckpt::writeFileAtomic(dir, file.name, bytes));
    } else {
      entries.push_back(ckpt::writeFileAtomic(local, file.name, bytes));
      ckpt::copyFileAtomic(local / file.name, dir / file.name);
      fs::remove(local / file.name);
    }
  }
  if (!local.empty()) {
    std::error_code ec;
    fs::remove(local, ec);  // only if empty: another rank on this host may share it
  }
  ckpt::writePart(dir, rank_, entries);
  if (ckpt::finalize(job.globalStore, job.step, worldSize_)) {
    log::info("checkpoint ", dir.string(), " complete");
  }
}

void CheckpointWriter::run(const CheckpointJob& job) { execute(job); }

void CheckpointWriter::enqueue(CheckpointJob job) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
  queue_.push_back(std::move(job));
  changed_.notify_all();
}

void CheckpointWriter::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [this] { return queue_.empty() && !busy_; });
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

void CheckpointWriter::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ with nothing left
    CheckpointJob job = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    try {
      execute(job);
    } catch (const std::exception& e) {
      log::error("background checkpoint of step ", job.step, " failed: ", e.what());
      lock.lock();
      if (!failure_) failure_ = std::current_exception();
      lock.unlock();
    }
    lock.lock();
    busy_ = false;
    changed_.notify_all();
  }
}

}  // namespace varuna
