// CheckpointWriter: writes this rank's share of a checkpoint, synchronously or
// on its own background thread, and completes the checkpoint when its part is
// the last one to land.
//
// Owned by Varuna::Impl. Jobs run in submission order, so a later checkpoint
// never overtakes (or overwrites) an earlier one still being copied. A job:
// serialise each file, write it (to `tempdir` first when given, then copy to
// the global store), write this rank's part list, then try to finalise (the
// rank whose part completes the set writes manifest, marker and pointer; a
// second finaliser rewrites identical files, harmlessly).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint_io.h"

namespace varuna {

struct CheckpointFile {
  std::string name;
  NamedTensors tensors;  // written as a torch.load-able archive (possibly of an empty dict)...
  std::optional<std::string> raw;  // ...unless these bytes are given: written as they are
};

struct CheckpointJob {
  std::filesystem::path globalStore;
  int64_t step = 0;
  std::filesystem::path tempdir;  // empty: write straight to the global store
  std::vector<CheckpointFile> files;
};

class CheckpointWriter {
 public:
  CheckpointWriter(int rank, int worldSize);
  ~CheckpointWriter();

  void run(const CheckpointJob& job);  // on the calling thread
  // On the background thread. The job holds the live tensors: the writer first
  // copies them in memory (its snapshot), then writes from the copy. The
  // caller must not change them until waitUntilCaptured() returns; Varuna
  // waits before the next optimizer step, a whole step of compute later, so
  // training does not stall.
  void enqueue(CheckpointJob job);
  // Blocks until every queued job has taken its snapshot.
  void waitUntilCaptured();
  // Waits until every queued job has finished; rethrows the first failure.
  void drain();

 private:
  void execute(const CheckpointJob& job, const std::function<void()>& onCaptured);
  void markCaptured();
  void loop();

  int rank_;
  int worldSize_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<CheckpointJob> queue_;
  bool busy_ = false;
  int uncaptured_ = 0;  // queued or running jobs still reading their tensors
  bool stop_ = false;
  std::exception_ptr failure_;
  std::thread thread_;
};

}  // namespace varuna
