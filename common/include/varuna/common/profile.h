// Profile: what the Profiler measured about a model on some hardware, and what
// the simulator and AutoConfig read. A versioned JSON file (docs/profile.md):
// per piece and micro-batch size, forward / backward / recompute times, the
// bytes crossing the piece's cut and the bytes it keeps for backward; point-to-
// point times by message size (same host, other host) and all-reduce times by
// size and replica count. Pure data + (de)serialisation; no libtorch, no I/O
// other than readProfile/writeProfile.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "varuna/common/errors.h"

namespace varuna::profile {

inline constexpr int kVersion = 1;

// A bad, stale or incompatible profile: says which file and what to do.
class ProfileError : public ConfigError {
 public:
  explicit ProfileError(const std::string& what) : ConfigError(what) {}
};

// Repeated measurements of one quantity, outliers already dropped.
struct Timing {
  double median = 0;   // seconds
  double min = 0, max = 0;
  double spread = 0;   // (p90 - p10) / median of the kept samples
  int samples = 0;
  bool operator==(const Timing&) const = default;
};

// Timing from raw samples: drops outliers (beyond 3 MADs of the median), keeps the rest.
Timing summarize(std::vector<double> samples);

struct PieceAtSize {  // one piece at one micro-batch size
  Timing forward;     // with autograd (activations kept)
  Timing backward;
  Timing recompute;   // forward again before the backward (Varuna schedule)
  int64_t outputBytes = 0;         // the tensor crossing the cut after this piece (0 for the loss)
  int64_t savedActivationBytes = 0;  // what autograd keeps between forward and backward
  int64_t peakBytes = 0;           // peak above the live bytes over recompute + backward (CUDA: caching
                                   // allocator statistics; CPU: a counting wrapper around the CPU allocator)
  // The backward split in two (zero-bubble schedules): the input-gradient
  // half B and the weight-gradient half W, measured on their own. Not
  // measured (samples 0, a profile from before): half of `backward` each.
  Timing backwardInput;
  Timing backwardWeight;
  // What B keeps for W beyond the saved activations (the gradients arriving
  // at the nodes where parameters branch off): held from B to W. 0 when not
  // measured (a profile from before).
  int64_t splitKeptBytes = 0;
  bool operator==(const PieceAtSize&) const = default;
};

struct PieceProfile {
  std::string name;
  int64_t paramCount = 0;
  int64_t paramBytes = 0;
  std::map<int64_t, PieceAtSize> bySize;  // micro-batch size -> figures
  bool operator==(const PieceProfile&) const = default;
};

struct P2PSample {
  int64_t bytes = 0;
  double sameHostSeconds = -1;   // one-way time of one message; -1: not measured
  double crossHostSeconds = -1;
  bool operator==(const P2PSample&) const = default;
};

struct AllReduceSample {
  int64_t bytes = 0;
  int replicas = 2;
  bool crossHost = false;
  double seconds = 0;
  bool operator==(const AllReduceSample&) const = default;
};

struct Profile {
  int version = kVersion;
  std::string modelFingerprint;  // see fingerprint(); a changed model makes the profile stale
  std::string device = "cpu";
  std::string precision = "fp32";
  std::string host;
  std::string createdAt;
  int64_t optimizerBytesPerParam = 8;  // optimizer state (Adam: two fp32 moments)
  int64_t gradientBytesPerParam = 4;
  double optimizerSecondsPerParam = 0;  // the optimizer step, per parameter of a stage
  std::vector<PieceProfile> pieces;
  std::vector<P2PSample> p2p;
  std::vector<AllReduceSample> allreduce;
  bool operator==(const Profile&) const = default;

  // Sizes profiled for every piece, ascending.
  std::vector<int64_t> microBatchSizes() const;
  // Interpolated (linear in bytes between samples, extrapolated from the two
  // nearest); 0 when nothing was measured for that kind of link.
  double p2pSeconds(int64_t bytes, bool sameHost) const;
  // Closest replica count measured, linear in bytes; scaled by 2(D-1)/D ring
  // volume when the replica count itself was not measured.
  double allreduceSeconds(int64_t bytes, int replicas, bool crossHost) const;
};

// Stable hash of the model's structure: piece names and their parameter shapes.
std::string fingerprint(const std::vector<std::pair<std::string, std::vector<std::vector<int64_t>>>>& pieces);

nlohmann::json toJson(const Profile& profile);
// Throws ProfileError naming `source` and the field.
Profile fromJson(const nlohmann::json& json, const std::string& source);

void writeProfile(const Profile& profile, const std::string& path);  // atomic
// Reads and checks version and (when given) the fingerprint of the model now.
Profile readProfile(const std::string& path, const std::string& expectedFingerprint = "");

// `added` on top of `base` (same model): its pieces' sizes and its samples win.
Profile merge(Profile base, const Profile& added);

}  // namespace varuna::profile
