// The on-disk layout of Varuna checkpoints, without libtorch, so the worker
// writes and reads it and the manager can find the latest complete one.
//
//   <global_store>/varuna_ckpt_<step>/
//       meta.json                      step, data position, loss scale, optimizer, layout
//       piece_<i>_<name>.params.pt     a piece's parameters, keyed by full name
//       piece_<i>_<name>.optim.pt      its optimizer state, keyed by "<param>/<slot>"
//       rank_<r>.rng.pt                generator states of rank r
//       parts/rank_<r>.json            what rank r wrote (name, size, crc32)
//       manifest.json                  every file with its size and crc32
//       COMPLETE                       written last: the checkpoint is complete
//   <global_store>/latest              step of the newest complete checkpoint
//
// Every file is written to a temporary name, fsynced and renamed, so a file
// either has its full content or does not exist. The manifest and the
// COMPLETE marker are written only once every rank's part has landed; a
// checkpoint without the marker, or whose files do not match the manifest, is
// refused. All functions are safe to call from any thread.
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

class CheckpointError : public Error {
 public:
  explicit CheckpointError(const std::string& what) : Error(what, kExitConfigError) {}
};

struct FileEntry {
  std::string name;  // relative to the checkpoint directory
  uint64_t size = 0;
  uint32_t crc32 = 0;
};

fs::path checkpointDir(const fs::path& globalStore, int64_t step);
uint32_t crc32(std::string_view bytes, uint32_t previous = 0);

// Receives a file's bytes in order, as they are produced.
using Sink = std::function<void(const void* data, size_t size)>;

// Writes `bytes` to dir/name durably and atomically; returns its entry.
FileEntry writeFileAtomic(const fs::path& dir, const std::string& name, std::string_view bytes);
// The same for bytes produced piecewise by `produce(sink)`: they go straight
// to the file (no in-memory copy) and are checksummed on the way.
FileEntry writeFileStreaming(const fs::path& dir, const std::string& name, const std::function<void(const Sink&)>& produce);
// Copies a finished file (e.g. from a local temp dir) durably and atomically.
void copyFileAtomic(const fs::path& from, const fs::path& to);
std::string readFile(const fs::path& path);

// Rank r's list of files, written after they all landed in the global store.
void writePart(const fs::path& dir, int rank, const std::vector<FileEntry>& files);
// Once all `worldSize` parts exist: merge them into the manifest, write the
// marker, move the latest pointer forward. Returns false if parts are missing.
bool finalize(const fs::path& globalStore, int64_t step, int worldSize);

bool isComplete(const fs::path& dir);
// Checks the marker and, for `files` (all when empty), size and (with
// `checksums`) crc32 against the manifest. Throws CheckpointError naming the
// checkpoint and the bad file.
void verify(const fs::path& dir, const std::vector<std::string>& files = {}, bool checksums = true);
std::vector<FileEntry> readManifest(const fs::path& dir);

// Steps of every checkpoint directory, newest first (complete or not).
std::vector<int64_t> listCheckpoints(const fs::path& globalStore);
// The newest checkpoint whose marker exists and whose files have the sizes of
// its manifest (checksums are checked by whoever loads a file).
std::optional<int64_t> latestComplete(const fs::path& globalStore);

}  // namespace varuna::ckpt
