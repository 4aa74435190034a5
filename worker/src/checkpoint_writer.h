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
#include <string>
#include <thread>
#include <vector>

namespace varuna {

struct CheckpointFile {
  std::string name;
  std::function<std::string()> serialize;  // runs on the writing thread
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
  void enqueue(CheckpointJob job);     // on the background thread
  // Waits until every queued job has finished; rethrows the first failure.
  void drain();

 private:
  void execute(const CheckpointJob& job);
  void loop();

  int rank_;
  int worldSize_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<CheckpointJob> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::exception_ptr failure_;
  std::thread thread_;
};

}  // namespace varuna
