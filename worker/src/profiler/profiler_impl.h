// Profiler::Impl, shared by the two files that implement it; private to the
// worker library. profiler.cpp runs the profile on every rank: it checks the
// options, loads an existing profile, agrees with the other ranks through the
// rendezvous store, hands out the work, gathers the results on rank 0 and
// writes profile.json. profiler_measure.cpp takes the measurements: pieces'
// compute time and memory, the optimizer step, point-to-point and all-reduce.
// One file holding both was too long to read. Impl runs on the thread that
// calls Profiler::run().
#pragma once

#include <torch/cuda.h>

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "pipeline/stage_model.h"
#include "varuna/common/profile.h"
#include "varuna/worker/profiler.h"

namespace varuna {

class MemoryMeter;  // live and peak bytes of the device; profiler_measure.cpp

class Profiler::Impl {
 public:
  Impl(ModelSpec model, GetBatchFn getBatch, ProfilerOptions options)
      : model_(std::move(model)), getBatch_(std::move(getBatch)), opt_(std::move(options)) {}

  profile::Profile run();

 private:
  profile::Profile runConnected();
  // Setup: options, the pieces selected, and (rank 0) the existing profile.
  std::string checkOptions();
  std::string loadExisting();
  void connect();
  void agree(const std::string& name, const std::string& myError);
  // Blocks until `name` is in the store. A peer that is merely busy (still
  // heartbeating) is waited for indefinitely; a lost or failed one ends it.
  void awaitKey(const std::string& name, const std::string& during);

  // One measurement to take: a piece at a micro-batch size.
  struct Item {
    int piece;
    int64_t size;
  };
  std::vector<Item> pendingItems() const;
  profile::Profile gather(const profile::Profile& mine, double optimizerSeconds, int64_t optimizerParams);

  // Measuring (profiler_measure.cpp).
  profile::Profile measurePieces(const std::vector<Item>& mine, const std::set<int>& optimizerPieces,
                                 double& optimizerSeconds, int64_t& optimizerParams);
  // Raw samples of one piece at one micro-batch size, gathered over several
  // calls of runPiece so the sizes' repetitions can be interleaved.
  struct Samples {
    std::vector<double> forward, backward, recompute;
    std::vector<double> backwardInput, backwardWeight;  // a split backward's halves (zero-bubble schedules)
    int64_t outputBytes = 0, savedMax = 0, peakMax = 0, splitKeptMax = 0;
    profile::PieceAtSize summary() const;
  };
  void runPiece(StageModel& piece, const torch::Tensor& input, const Batch& batch, int64_t size, bool isLast,
                MemoryMeter& meter, bool timed, Samples& samples);
  std::map<int64_t, profile::PieceAtSize> measureSizes(StageModel& piece, const std::vector<int64_t>& sizes,
                                                       std::map<int64_t, torch::Tensor>& inputs,
                                                       const std::map<int64_t, Batch>& batches, bool isLast,
                                                       MemoryMeter& meter);
  double timeOptimizer(StageModel& piece);

  nlohmann::json planCommunication(const profile::Profile& merged) const;
  void measureCommunication(const nlohmann::json& plan, profile::Profile& result);
  double pingPong(int peer, int64_t bytes);
  double allreduceOnce(const c10::intrusive_ptr<c10d::Backend>& group, torch::Tensor& buffer);

  void sync() const {
    if (opt_.device.is_cuda()) torch::cuda::synchronize(opt_.device.index());
  }
  bool isRank0() const { return opt_.rank == 0; }

  // The ranks meet through the rendezvous store under these keys.
  static constexpr const char* kKeyPrefix = "varuna/profiler/";
  static std::string key(const std::string& name) { return kKeyPrefix + name; }
  static std::string toText(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
  static std::vector<uint8_t> toBytes(const std::string& text) {
    return std::vector<uint8_t>(text.begin(), text.end());
  }

  ModelSpec model_;
  GetBatchFn getBatch_;
  ProfilerOptions opt_;
  std::unique_ptr<Communicator> comm_;  // null when worldSize == 1
  std::vector<int> selected_;           // piece indices to profile
  std::vector<std::string> hosts_;      // per rank
  std::optional<profile::Profile> existing_;
  std::string fingerprint_;             // rank 0
};

}  // namespace varuna
