// Profiler: measures what AutoConfig and the simulator need to plan a job
// (docs/profile.md): per piece (the segment between two CutPoints) and
// micro-batch size, forward / backward / recompute time, the bytes crossing
// the piece's cut and the bytes autograd keeps; the optimizer step; and, with
// two or more ranks, point-to-point times of activation-sized messages and
// all-reduce times of stage-gradient-sized buffers over 2..world replicas.
//
// One instance per worker process, constructed in every rank with the same
// ModelSpec and options; run() is called once, from the main thread. The
// (piece, size) measurements are spread round-robin over the ranks (any number
// of ranks profiles any number of pieces); each rank builds only the pieces it
// needs (those it measures and the ones before them, to feed a realistic
// input), one at a time. Results meet on rank 0 through the rendezvous
// TCPStore; rank 0 adds the communication measurements and writes
// <outputDir>/profile.json.
#pragma once

#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "varuna/common/profile.h"
#include "varuna/worker/launch_args.h"
#include "varuna/worker/model.h"
#include "varuna/worker/varuna.h"

namespace varuna {

struct ProfilerOptions {
  // Micro-batch sizes to profile every piece at (the original's batch_sizes).
  std::vector<int64_t> microBatchSizes{1, 2, 4, 8};
  // Pieces to profile, by name or index (the original's pstages_to_profile);
  // empty: all.
  std::vector<std::string> pieces;
  int warmup = 2;        // untimed runs before the timed ones
  int repetitions = 8;   // timed runs; outliers are dropped (profile::summarize)
  // Folder of profile.json (the original's out_folder); required on rank 0.
  std::string outputDir;
  // Read <outputDir>/profile.json (refused if stale or malformed) and add this
  // run's measurements to it; new figures replace old ones for the same
  // (piece, size). No file yet: start a new profile.
  bool addToExisting = false;
  // Skip every measurement the existing profile already has (implies
  // addToExisting).
  bool reuseCached = false;
  Precision precision = Precision::kFp32;
  torch::Device device = torch::kCPU;
  CommBackend commBackend = CommBackend::kAuto;  // as VarunaOptions::commBackend
  std::string optimizer = "adam";  // adam, adamw or sgd (with momentum): what optimizerSecondsPerParam times

  // Where this rank is. host: this machine's identity for same-host vs
  // cross-host links (VARUNA_HOST or the host name; empty: the host name).
  RendezvousOptions rendezvous;
  int rank = 0;
  int worldSize = 1;
  std::string host;
  // A peer silent (no heartbeat) for this long fails the run; waiting on a peer
  // that is still computing never does.
  std::chrono::milliseconds peerTimeout{std::chrono::seconds(60)};
  // Communication measurements (world >= 2). Messages and buffers are capped at
  // maxCommBytes (the simulator extrapolates linearly beyond).
  bool profileCommunication = true;
  int commRepetitions = 20;
  int64_t maxCommBytes = int64_t{256} << 20;

  // Fills rank, world size, rendezvous and host from the launcher's arguments.
  void applyLaunchArgs(const LaunchArgs& args);
};

class Profiler {
 public:
  Profiler(ModelSpec model, GetBatchFn getBatch, ProfilerOptions options);
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Measures, gathers and (rank 0) writes <outputDir>/profile.json. Rank 0
  // returns the whole profile, other ranks what they measured themselves.
  // Must be called on every rank. Throws ConfigError (bad options, a stale or
  // malformed existing profile: on every rank) or PeerLostError.
  profile::Profile run();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// profile::fingerprint of the model's piece names and parameter shapes; builds
// each piece once, alone, to read them. A profile whose fingerprint differs was
// measured on another model and is stale.
std::string modelFingerprint(const ModelSpec& model);

// <outputDir>/profile.json
std::string profilePath(const std::string& outputDir);

}  // namespace varuna
