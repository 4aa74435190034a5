// CheckpointWriter: writes this rank's share of a checkpoint, synchronously or
// on its own background thread, and completes the checkpoint when its part is
// the last one to land.
//
// Owned by Varuna::Impl. Jobs run in submission order, so a later checkpoint
// never overtakes (or overwrites) an earlier one still being copied. A job:
// serialise each file, write it (to `tempdir` first when given, then copy to
// the run's partial folder in the global store), write this rank's part list,
// then try to finalise (ckpt::finalize: the rank whose part completes the set
// of its run renames the folder into place), then apply retention.
// A background job that fails on storage is reported through `onFailure`
// (called on the writer thread) and dropped: training goes on and the next
// checkpoint tries again. A superseded generation is fatal: it is rethrown to
// the training thread by the next enqueue() or drain().
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

#include "checkpoint/checkpoint_io.h"
#include "varuna/common/checkpoint_files.h"

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

struct CheckpointWriterOptions {
  ckpt::WriterIdentity writer;
  int keepCheckpoints = 0;  // retention after each completed checkpoint; 0: keep all
  std::function<void(int64_t step, const std::string& error)> onFailure;
};

class CheckpointWriter {
 public:
  explicit CheckpointWriter(CheckpointWriterOptions options);
  ~CheckpointWriter();

  void run(const CheckpointJob& job);  // on the calling thread; throws its failure
  // On the background thread. The job holds the live tensors: the writer first
  // copies them in memory (its snapshot), then writes from the copy. The
  // caller must not change them until waitUntilCaptured() returns; Varuna
  // waits before the next optimizer step, a whole step of compute later, so
  // training does not stall.
  void enqueue(CheckpointJob job);
  // Blocks until every queued job has taken its snapshot.
  void waitUntilCaptured();
  // Waits until every queued job has finished; rethrows a superseded
  // generation (storage failures were reported through onFailure).
  void drain();

 private:
  void execute(const CheckpointJob& job, const std::function<void()>& onCaptured);
  void markCaptured();
  void loop();

  void applyRetention(const CheckpointJob& job);

  CheckpointWriterOptions options_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<CheckpointJob> queue_;
  bool busy_ = false;
  int uncaptured_ = 0;  // queued or running jobs still reading their tensors
  bool stop_ = false;
  std::exception_ptr failure_;  // a SupersededError from the writer thread
  std::thread thread_;
};

}  // namespace varuna
