// The manager's look at the checkpoint store: which complete checkpoint a
// relaunch resumes from. Pure I/O on the store, no state: run_varuna runs it
// on its BackgroundWorker, never on the event loop (a network filesystem may
// take seconds to answer), and reads the result there.
//
// The store's `latest` pointer (moved forward by the worker that completes a
// checkpoint, docs/checkpoints.md) is read first: when the checkpoint it names
// is complete, not marked damaged and has the sizes of its manifest, that is
// the answer, without listing the store. Otherwise (no pointer, a damaged or
// missing checkpoint behind it) the store is listed as ckpt::latestComplete
// does, and every complete-looking checkpoint passed over is reported.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "varuna/common/checkpoint_files.h"

namespace varuna {

struct StoreScanRequest {
  std::string globalStore;
  // List the store even when the pointer names a usable checkpoint: before a
  // launch, where a pointer left behind (its writer died between the rename
  // and the pointer update) would cost the progress of the newer checkpoint.
  bool thorough = false;
  // A checkpoint this scan's caller found usable before: if the pointer still
  // names it and it has no DAMAGED marker, its files are not looked at again
  // (a complete checkpoint never changes; a loader that finds it damaged
  // marks it). Saves a stat per file every second on a big model.
  std::optional<int64_t> known;
};

struct StoreScan {
  std::optional<int64_t> latest;                 // the newest usable checkpoint, if any
  std::vector<ckpt::SkippedCheckpoint> skipped;  // complete-looking ones passed over, newest first
  std::string error;                             // non-empty: the store could not be read (latest unset)
  bool listed = false;                           // the store was listed (no usable pointer, or thorough)
  // How long ago `latest` was completed (checkpointAgeSeconds), when it is
  // not the request's `known` one (the caller has its age already).
  std::optional<double> latestAgeSeconds;
};

// How long ago the complete checkpoint of `step` in `globalStore` was
// completed: the age of its COMPLETE marker (written once, just before the
// folder is renamed into place; a DAMAGED marker added later changes the
// folder's time, not this one's). Unknown (nullopt) if it cannot be read; 0
// if the store's clock is ahead of ours. Blocking I/O on the store: for the
// store's thread (CheckpointWatcher's scans), never the event loop.
std::optional<double> checkpointAgeSeconds(const std::string& globalStore, int64_t step);

// Never throws: an error reading the store is StoreScan::error.
StoreScan scanCheckpointStore(const StoreScanRequest& request);

// The seam the daemon calls (tests give it a slow or failing one).
using StoreScanner = std::function<StoreScan(const StoreScanRequest&)>;

}  // namespace varuna
