// The on-disk layout of Varuna checkpoints, without libtorch, so the worker
// writes and reads it and the manager can find the latest complete one.
//
//   <global_store>/varuna_job.json         job name and the current generation (fencing)
//   <global_store>/varuna_ckpt_<step>.<run>.partial/  one run writing step <step> (run: g<G>
//                                      for run_varuna's generation G, r<random> for a run without it)
//   <global_store>/varuna_ckpt_<step>/     a complete checkpoint (the partial folder, renamed)
//       meta.json                      step, data position, loss scale, optimizer, layout
//       piece_<i>_<name>.params.pt     a piece's parameters and persistent buffers, by full name
//       piece_<i>_<name>.optim.pt      its optimizer state, keyed by "<param>/<slot>"
//       rank_<r>.rng.pt                generator states of rank r
//       parts/rank_<r>.json            what rank r wrote (name, size, crc32), its generation and world size
//       manifest.json                  every file with its size and crc32, the generation and world size
//       COMPLETE                       the checkpoint is complete
//       DAMAGED                        (only if a loader found a file that fails verification)
//   <global_store>/latest              step of the newest complete checkpoint
//
// Every file is written to a temporary name, fsynced and renamed, so a file
// either has its full content or does not exist. Each generation writes into
// its own partial folder; the rank whose part completes the set (world size
// parts, all of its generation) writes manifest and marker there and renames
// the folder into place, so a complete checkpoint never mixes two runs and a
// partial folder is never read. A writer whose generation is older than the
// one recorded in varuna_job.json is refused (SupersededError).
// All functions are safe to call from any thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "varuna/common/errors.h"

namespace varuna::ckpt {

namespace fs = std::filesystem;

inline constexpr const char* kMarker = "COMPLETE";
inline constexpr const char* kManifest = "manifest.json";
inline constexpr const char* kMeta = "meta.json";
inline constexpr const char* kLatest = "latest";

inline constexpr const char* kDamaged = "DAMAGED";
inline constexpr const char* kJobFile = "varuna_job.json";

// Storage failed or a checkpoint is damaged or missing: retrying, or falling
// back to an older checkpoint, can help (exit code kExitStorageError). A
// checkpoint of another model or optimizer is a ConfigError instead.
class CheckpointError : public Error {
 public:
  explicit CheckpointError(const std::string& what) : Error(what, kExitStorageError) {}
};

// A file of a complete checkpoint is missing, truncated, fails its checksum
// or does not decode: the checkpoint is damaged for good (loaders mark it and
// fall back), unlike an I/O error, which may pass.
class DamagedError : public CheckpointError {
 public:
  explicit DamagedError(const std::string& what) : CheckpointError(what) {}
};

// This writer's generation is older than the store's recorded one.
class SupersededError : public Error {
 public:
  explicit SupersededError(const std::string& what) : Error(what, kExitSuperseded) {}
};

// Who writes a part: finalize() only combines parts of one run (generation)
// and world size. generation -1: a run without run_varuna (no fencing record).
struct WriterIdentity {
  int64_t generation = -1;
  std::string run;  // names the partial folder: runTag(generation, random)
  int rank = 0;
  int worldSize = 1;
};
// "g<generation>" for generation >= 0, else "r<randomTag>".
std::string runTag(int64_t generation, const std::string& randomTag);

struct FileEntry {
  std::string name;  // relative to the checkpoint directory
  uint64_t size = 0;
  uint32_t crc32 = 0;
};

fs::path checkpointDir(const fs::path& globalStore, int64_t step);
// Where one run writes step `step` until it is complete.
fs::path partialDir(const fs::path& globalStore, int64_t step, const std::string& run);
uint32_t crc32(std::string_view bytes, uint32_t previous = 0);

// Receives a file's bytes in order, as they are produced.
using Sink = std::function<void(const void* data, size_t size)>;

// Writes `bytes` to dir/name durably and atomically; returns its entry.
FileEntry writeFileAtomic(const fs::path& dir, const std::string& name, std::string_view bytes);
// The same for a secret: mode 0600 from its creation (whatever the umask).
FileEntry writePrivateFileAtomic(const fs::path& dir, const std::string& name, std::string_view bytes);
// The same for bytes produced piecewise by `produce(sink)`: they go straight
// to the file (no in-memory copy) and are checksummed on the way.
FileEntry writeFileStreaming(const fs::path& dir, const std::string& name, const std::function<void(const Sink&)>& produce);
// Copies a finished file (e.g. from a local temp dir) durably and atomically.
void copyFileAtomic(const fs::path& from, const fs::path& to);
std::string readFile(const fs::path& path);

// The writer's list of files, written into its partial folder after they all
// landed there.
void writePart(const fs::path& globalStore, int64_t step, const WriterIdentity& writer,
               const std::vector<FileEntry>& files);

enum class Finalized {
  kWaiting,          // parts of this generation are still missing
  kCompleted,        // this call completed the checkpoint
  kAlreadyComplete,  // a complete checkpoint of this step exists (this or another call)
};
// Once all world-size parts of the writer's generation exist: check the writer
// is not superseded, merge the parts into the manifest, write the marker,
// rename the partial folder into place and move the latest pointer forward.
// Parts of other generations or world sizes are never combined. Throws
// SupersededError for a superseded writer.
Finalized finalize(const fs::path& globalStore, int64_t step, const WriterIdentity& writer);

// Generation fencing (varuna_job.json in the store). run_varuna records each
// generation before launching it; writers check before completing.
std::optional<int64_t> recordedGeneration(const fs::path& globalStore);
void recordGeneration(const fs::path& globalStore, int64_t generation);  // keeps the file's other keys
// Throws SupersededError when the store records a newer generation than
// `generation` (a writer without a generation, -1, is never fenced).
void checkNotSuperseded(const fs::path& globalStore, int64_t generation);

// Marks a complete checkpoint that failed verification, so no later choice of
// the latest checkpoint picks it again.
void markDamaged(const fs::path& dir, const std::string& reason);

bool isComplete(const fs::path& dir);
// Complete and not marked damaged: a checkpoint that must not be rewritten. A
// damaged one is replaced (moved aside) by a new checkpoint of its step.
bool isIntact(const fs::path& dir);
// Checks the marker and, for `files` (all when empty), size and (with
// `checksums`) crc32 against the manifest. Throws CheckpointError naming the
// checkpoint and the bad file.
void verify(const fs::path& dir, const std::vector<std::string>& files = {}, bool checksums = true);
std::vector<FileEntry> readManifest(const fs::path& dir);
// Reads dir/name and checks it against the manifest's entry (size and crc32)
// in one pass; throws CheckpointError naming the checkpoint and the file.
std::string readVerified(const fs::path& dir, const std::vector<FileEntry>& manifest, const std::string& name);

// Steps of every checkpoint directory, newest first (complete or not).
std::vector<int64_t> listCheckpoints(const fs::path& globalStore);

struct SkippedCheckpoint {
  int64_t step = 0;
  std::string reason;
};
// The newest checkpoints (newest first, at most `limit`, 0: all) whose marker
// exists, that are not marked damaged and whose files have the sizes of their
// manifest (checksums are checked by whoever loads a file). Complete-looking
// checkpoints passed over on the way are added to `skipped`.
std::vector<int64_t> completeCheckpoints(const fs::path& globalStore, size_t limit = 0,
                                         std::vector<SkippedCheckpoint>* skipped = nullptr);
std::optional<int64_t> latestComplete(const fs::path& globalStore, std::vector<SkippedCheckpoint>* skipped = nullptr);

// Retention: keeps the newest `keep` complete checkpoints (0: all) and removes
// older ones, damaged ones older than the newest complete one, partial folders
// of steps at or below the newest complete one or of superseded generations,
// and stray temporary files. Never removes the newest complete checkpoint.
// Returns what it removed; failures to remove are logged by the caller's
// next run, never thrown.
std::vector<fs::path> applyRetention(const fs::path& globalStore, int keep, int64_t currentGeneration);

}  // namespace varuna::ckpt
