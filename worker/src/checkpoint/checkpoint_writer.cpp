#include <optional>

#include "checkpoint/checkpoint_writer.h"

#include <torch/cuda.h>

#include <future>
#include <set>
#include <utility>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"

namespace varuna {
namespace {

// The copy a background write works from, taken while training waits. On
// the host for device tensors: no second copy of the model in GPU memory, and
// pinned, so the device-to-host copies run at full speed, asynchronously
// (the caller synchronises once after all of them).
torch::Tensor snapshotOf(const torch::Tensor& tensor) {
  const auto t = tensor.detach();
  if (!t.is_cuda()) return t.clone();
  auto host = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
  host.copy_(t, /*non_blocking=*/true);
  return host;
}

void snapshot(std::vector<CheckpointFile>& files) {
  std::set<c10::DeviceIndex> devices;
  for (auto& file : files) {
    for (auto& [name, t] : file.tensors) {
      if (t.is_cuda()) devices.insert(t.device().index());
      t = snapshotOf(t);
    }
  }
  for (const auto device : devices) torch::cuda::synchronize(device);
}

}  // namespace

CheckpointWriter::CheckpointWriter(CheckpointWriterOptions options)
    : options_(std::move(options)), thread_([this] { loop(); }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;  // queued jobs still run: a checkpoint is never dropped silently
  }
  changed_.notify_all();
  thread_.join();
}

void CheckpointWriter::execute(const CheckpointJob& job, const std::function<void()>& onCaptured) {
  namespace fs = std::filesystem;
  const fs::path dir = ckpt::partialDir(job.globalStore, job.step, options_.writer.run);
  const fs::path local = job.tempdir.empty() ? fs::path() : ckpt::checkpointDir(job.tempdir, job.step);
  std::vector<CheckpointFile> captured;
  const std::vector<CheckpointFile>* files = &job.files;
  if (onCaptured) {
    captured = job.files;
    snapshot(captured);
    files = &captured;
    onCaptured();  // training may change the live tensors from now on
  }
  // Two writers: serialising, checksumming and the kernel's copy of one file
  // overlap with another file's, which a single stream cannot do.
  std::vector<ckpt::FileEntry> entries(files->size());
  auto writeEvery = [&](size_t first) {
    for (size_t i = first; i < files->size(); i += 2) {
      const auto& file = (*files)[i];
      entries[i] = ckpt::writeFileStreaming(local.empty() ? dir : local, file.name, [&file](const ckpt::Sink& sink) {
        if (file.raw) {
          sink(file.raw->data(), file.raw->size());
        } else {
          writeTensorArchive(file.tensors, sink);
        }
      });
    }
  };
  auto second = std::async(std::launch::async, writeEvery, 1);
  writeEvery(0);
  second.get();
  if (!local.empty()) {
    for (const auto& file : job.files) {
      ckpt::copyFileAtomic(local / file.name, dir / file.name);
      fs::remove(local / file.name);
    }
    std::error_code ec;
    fs::remove(local, ec);  // only if empty: another rank on this host may share it
  }
  ckpt::writePart(job.globalStore, job.step, options_.writer, entries);
  if (ckpt::finalize(job.globalStore, job.step, options_.writer) == ckpt::Finalized::kCompleted) {
    log::info("checkpoint ", ckpt::checkpointDir(job.globalStore, job.step).string(), " complete");
    applyRetention(job);
  }
}

void CheckpointWriter::applyRetention(const CheckpointJob& job) {
  // Checked again: a generation superseded since the rename must not delete
  // what the new one may be loading.
  ckpt::checkNotSuperseded(job.globalStore, options_.writer.generation);
  try {
    const auto removed = ckpt::applyRetention(job.globalStore, options_.keepCheckpoints, options_.writer.generation);
    if (!removed.empty()) {
      log::info("retention (keep ", options_.keepCheckpoints, "): removed ", removed.size(), " old or unfinished ",
                "checkpoint folder(s), e.g. ", removed.front().filename().string());
    }
  } catch (const std::exception& e) {
    log::warn("retention after checkpoint ", job.step, " failed (the next checkpoint tries again): ", e.what());
  }
}

void CheckpointWriter::run(const CheckpointJob& job) { execute(job, nullptr); }

void CheckpointWriter::enqueue(CheckpointJob job) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
  queue_.push_back(std::move(job));
  ++uncaptured_;
  changed_.notify_all();
}

void CheckpointWriter::markCaptured() {
  std::lock_guard<std::mutex> lock(mutex_);
  --uncaptured_;
  changed_.notify_all();
}

void CheckpointWriter::waitUntilCaptured() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [this] { return uncaptured_ == 0; });
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
    // Released before the mutex is taken again: its tensors may be a Python
    // job's (parameters, optimizer state), and dropping them can take the GIL.
    std::optional<CheckpointJob> held(std::move(queue_.front()));
    CheckpointJob& job = *held;
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    bool captured = false;
    try {
      execute(job, [&] {
        captured = true;
        markCaptured();
      });
    } catch (const ckpt::SupersededError& e) {
      log::error("background checkpoint of step ", job.step, " refused: ", e.what());
      lock.lock();
      if (!failure_) failure_ = std::current_exception();
      lock.unlock();
    } catch (const std::exception& e) {
      // Storage (full disk, I/O error): reported, and training goes on.
      if (options_.onFailure) options_.onFailure(job.step, e.what());
    }
    if (!captured) markCaptured();  // failed before: the tensors are free anyway
    held.reset();
    lock.lock();
    busy_ = false;
    changed_.notify_all();
  }
}

}  // namespace varuna
