// What the profiler measures (the run around it is in profiler.cpp): each
// piece's forward, backward and recompute time and its memory at several
// micro-batch sizes, the optimizer step, and, with two or more ranks,
// point-to-point and all-reduce times. Memory is read by swapping in a
// counting CPU allocator (or from CUDA's allocator statistics) for the
// duration of the compute measurements.
#include <c10/core/CPUAllocator.h>
#include <torch/autograd.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#ifdef VARUNA_HAVE_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "device/autocast_scope.h"
#include "profiler/profiler_impl.h"
#include "varuna/common/errors.h"
#include "varuna/common/log.h"

namespace varuna {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr int kPingTag = 7 << 24;

std::string formatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1 << 30) return strCat(b / (1 << 30), " GiB");
  if (b >= 1 << 20) return strCat(b / (1 << 20), " MiB");
  if (b >= 1 << 10) return strCat(b / (1 << 10), " KiB");
  return strCat(bytes, " B");
}

std::string formatMs(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3f ms", seconds * 1e3);
  return text;
}

std::shared_ptr<torch::optim::Optimizer> makeOptimizer(const std::string& name, std::vector<torch::Tensor> params) {
  if (name == "adam") return std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-4));
  if (name == "adamw") return std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-4));
  return std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(1e-4).momentum(0.9));
}

// --- memory -------------------------------------------------------------------

// Wraps the CPU allocator to count the bytes of live CPU tensors and their
// peak. Installed only around the compute measurements. A singleton that is
// never destroyed: tensors it allocated may be freed after it is uninstalled,
// and their deleter still decrements its counter. Each block carries its size
// in a header in front of the data, so the context stays the data pointer
// (ATen's raw_allocate/raw_deallocate users need that) and nothing is locked.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& instance() {
    static auto* allocator = new CountingCpuAllocator();
    return *allocator;
  }

  c10::DataPtr allocate(size_t bytes) override {
    void* base = underlying_.load()->raw_allocate(bytes + kHeader);
    *static_cast<int64_t*>(base) = static_cast<int64_t>(bytes);
    void* data = static_cast<char*>(base) + kHeader;
    const int64_t now = live_.fetch_add(static_cast<int64_t>(bytes)) + static_cast<int64_t>(bytes);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return c10::DataPtr(data, data, &CountingCpuAllocator::release, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingCpuAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // False if `allocator` has no raw interface to wrap (then nothing changes).
  bool setUnderlying(c10::Allocator* allocator) {
    if (allocator == this) return true;
    if (allocator == nullptr || allocator->raw_deleter() == nullptr) return false;
    underlying_.store(allocator);
    underlyingDeleter_.store(allocator->raw_deleter());
    return true;
  }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void resetPeak() { peak_.store(live_.load()); }

 private:
  static constexpr size_t kHeader = 64;  // keeps the CPU allocator's 64-byte alignment

  static void release(void* data) {
    void* base = static_cast<char*>(data) - kHeader;
    instance().live_.fetch_sub(*static_cast<int64_t*>(base));
    instance().underlyingDeleter_.load()(base);
  }

  std::atomic<c10::Allocator*> underlying_{nullptr};
  std::atomic<c10::DeleterFnPtr> underlyingDeleter_{nullptr};
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

}  // namespace

// Live and peak bytes of the device the pieces run on: the counting CPU
// allocator above, or the CUDA caching allocator's statistics. Only
// differences between readings are meaningful (both count what was allocated
// before they started differently). Outside the anonymous namespace because
// profiler_impl.h names it.
class MemoryMeter {
 public:
  explicit MemoryMeter(torch::Device device) : device_(device) {
    if (device_.is_cuda()) return;
    // Highest priority, so a custom allocator registered at start-up does not
    // keep ours out; restored with the same priority.
    previous_ = c10::GetCPUAllocator();
    auto& counting = CountingCpuAllocator::instance();
    if (counting.setUnderlying(previous_)) {
      c10::SetCPUAllocator(&counting, /*priority=*/255);
      installed_ = c10::GetCPUAllocator() == &counting;
    }
    if (!installed_) log::warn("profiler: could not install the counting CPU allocator; memory figures will be 0");
  }
  ~MemoryMeter() {
    if (installed_) c10::SetCPUAllocator(previous_, /*priority=*/255);
  }
  MemoryMeter(const MemoryMeter&) = delete;
  MemoryMeter& operator=(const MemoryMeter&) = delete;

  bool works() const { return installed_ || device_.is_cuda(); }

  int64_t live() const {
#ifdef VARUNA_HAVE_NCCL
    if (device_.is_cuda()) {
      return c10::cuda::CUDACachingAllocator::getDeviceStats(cudaIndex())
          .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
          .current;
    }
#endif
    return installed_ ? CountingCpuAllocator::instance().live() : 0;
  }
  int64_t peak() const {
#ifdef VARUNA_HAVE_NCCL
    if (device_.is_cuda()) {
      return c10::cuda::CUDACachingAllocator::getDeviceStats(cudaIndex())
          .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
          .peak;
    }
#endif
    return installed_ ? CountingCpuAllocator::instance().peak() : 0;
  }
  void resetPeak() {
#ifdef VARUNA_HAVE_NCCL
    if (device_.is_cuda()) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(cudaIndex());
      return;
    }
#endif
    if (installed_) CountingCpuAllocator::instance().resetPeak();
  }

 private:
#ifdef VARUNA_HAVE_NCCL
  c10::DeviceIndex cudaIndex() const { return device_.has_index() ? device_.index() : c10::cuda::current_device(); }
#endif

  torch::Device device_;
  c10::Allocator* previous_ = nullptr;
  bool installed_ = false;
};

// --- piece measurement ---------------------------------------------------------

void Profiler::Impl::runPiece(StageModel& piece, const torch::Tensor& input, const Batch& batch, int64_t size,
                              bool isLast, MemoryMeter& meter, bool timed, Samples& samples) {
  const bool autocast = opt_.precision != Precision::kFp32;
  auto forward = [&](MicrobatchState& state) {
    AutocastScope scope(autocast, opt_.device.type(), autocastType(opt_.precision));
    return piece.forward(state, input, batch, size, /*keepGraph=*/true, isLast);
  };
  auto seconds = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };

  torch::Tensor gradOutput;
  // Forward with autograd: what its graph keeps alive is the saved activation.
  {
    MicrobatchState state;
    sync();
    const int64_t before = meter.live();
    const auto t0 = Clock::now();
    torch::Tensor out = forward(state);
    sync();
    const auto t1 = Clock::now();
    // The output itself crosses the cut (outputBytes); everything else the
    // forward allocated and still holds belongs to the graph. (An output
    // that is a view of the input allocated nothing.)
    const bool viewOfInput = input.defined() && out.storage().data() == input.storage().data();
    const int64_t ownOutput = viewOfInput ? 0 : static_cast<int64_t>(out.storage().nbytes());
    const int64_t saved = std::max<int64_t>(0, meter.live() - before - ownOutput);
    if (timed) {
      samples.forward.push_back(seconds(t0, t1));
      samples.savedMax = std::max(samples.savedMax, saved);
    }
    samples.outputBytes = isLast ? 0 : out.numel() * static_cast<int64_t>(out.element_size());
    gradOutput = torch::ones_like(out);
  }
  // The backward split in two, as zero-bubble schedules run it: B, then W.
  // What B leaves allocated beyond the input's gradient (which crosses the
  // cut) is what it keeps for W: held from B to W on top of the activations.
  {
    MicrobatchState split;
    forward(split);
    sync();
    const int64_t beforeB = meter.live();
    const auto t0 = Clock::now();
    torch::Tensor gradInput = piece.backwardInput(split, gradOutput);
    sync();
    const auto t1 = Clock::now();
    const int64_t inputGradient = gradInput.defined() ? static_cast<int64_t>(gradInput.storage().nbytes()) : 0;
    const int64_t kept = std::max<int64_t>(0, meter.live() - beforeB - inputGradient);
    gradInput = torch::Tensor();
    piece.backwardWeight(split, nullptr);
    sync();
    const auto t2 = Clock::now();
    if (timed) {
      samples.backwardInput.push_back(seconds(t0, t1));
      samples.backwardWeight.push_back(seconds(t1, t2));
      samples.splitKeptMax = std::max(samples.splitKeptMax, kept);
    }
  }
  // Recompute then backward, back to back as the Varuna schedule runs them:
  // the peak over both is the piece's working memory beyond what was
  // resident before (parameters, gradients, the input).
  MicrobatchState state;
  sync();
  const int64_t base = meter.live();
  meter.resetPeak();
  const auto t0 = Clock::now();
  forward(state);
  sync();
  const auto t1 = Clock::now();
  piece.backward(state, gradOutput, nullptr);
  sync();
  const auto t2 = Clock::now();
  if (timed) {
    samples.recompute.push_back(seconds(t0, t1));
    samples.backward.push_back(seconds(t1, t2));
    samples.peakMax = std::max(samples.peakMax, meter.peak() - base);
  }
}

profile::PieceAtSize Profiler::Impl::Samples::summary() const {
  profile::PieceAtSize result;
  result.forward = profile::summarize(forward);
  result.backward = profile::summarize(backward);
  result.recompute = profile::summarize(recompute);
  result.backwardInput = profile::summarize(backwardInput);
  result.backwardWeight = profile::summarize(backwardWeight);
  result.outputBytes = outputBytes;
  result.savedActivationBytes = savedMax;
  result.peakBytes = peakMax;
  result.splitKeptBytes = splitKeptMax;
  return result;
}

// The sizes' repetitions are interleaved (1, 2, 4, 8, 1, 2, ...): a burst of
// interference from the rest of the machine then lands on every size alike
// instead of skewing one, which would skew AutoConfig's choice of micro-batch
// size. Warm-up runs every size first.
std::map<int64_t, profile::PieceAtSize> Profiler::Impl::measureSizes(StageModel& piece,
                                                                     const std::vector<int64_t>& sizes,
                                                                     std::map<int64_t, torch::Tensor>& inputs,
                                                                     const std::map<int64_t, Batch>& batches,
                                                                     bool isLast, MemoryMeter& meter) {
  std::map<int64_t, Samples> samples;
  for (int run = 0; run < opt_.warmup + opt_.repetitions; ++run) {
    for (int64_t size : sizes) {
      runPiece(piece, inputs[size], batches.at(size), size, isLast, meter, run >= opt_.warmup, samples[size]);
    }
  }
  std::map<int64_t, profile::PieceAtSize> out;
  for (const auto& [size, s] : samples) out[size] = s.summary();
  return out;
}

double Profiler::Impl::timeOptimizer(StageModel& piece) {
  std::vector<torch::Tensor> params = piece.pieceParams(0);
  if (params.empty()) return 0;
  for (auto& p : params) {
    if (!p.grad().defined()) p.mutable_grad() = torch::randn_like(p) * 1e-3;
  }
  auto optimizer = makeOptimizer(opt_.optimizer, params);
  std::vector<double> samples;
  for (int run = 0; run < std::max(1, opt_.warmup) + opt_.repetitions; ++run) {
    sync();
    const auto t0 = Clock::now();
    optimizer->step();
    sync();
    if (run >= std::max(1, opt_.warmup)) samples.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return profile::summarize(samples).median;
}

profile::Profile Profiler::Impl::measurePieces(const std::vector<Item>& mine, const std::set<int>& optimizerPieces,
                                               double& optimizerSeconds, int64_t& optimizerParams) {
  profile::Profile partial;
  optimizerSeconds = 0;
  optimizerParams = 0;
  if (mine.empty() && optimizerPieces.empty()) return partial;
  int lastInput = -1;  // the last piece whose input this rank needs
  for (const auto& item : mine) lastInput = std::max(lastInput, item.piece);
  int last = lastInput;
  if (!optimizerPieces.empty()) last = std::max(last, *optimizerPieces.rbegin());
  const int numPieces = static_cast<int>(model_.pieces.size());

  MemoryMeter meter(opt_.device);
  std::map<int64_t, Batch> batches;
  std::map<int64_t, torch::Tensor> activations;  // size -> input of the current piece
  for (const auto& item : mine) {
    if (!batches.count(item.size)) batches[item.size] = getBatch_(item.size, opt_.device);
  }
  const bool autocast = opt_.precision != Precision::kFp32;
  // One pass down the model: piece j is built once, measured at this rank's
  // sizes, then run without autograd to make the next piece's inputs.
  for (int j = 0; j <= last; ++j) {
    const bool measures = std::any_of(mine.begin(), mine.end(), [j](const Item& i) { return i.piece == j; });
    if (!measures && !optimizerPieces.count(j) && j >= lastInput) continue;
    StageModel piece(model_, j, j + 1, opt_.device);
    piece.train();
    const bool isLast = j == numPieces - 1;
    profile::PieceProfile record;
    record.name = model_.pieces[j].name;
    for (const auto& p : piece.pieceParams(0)) {
      record.paramCount += p.numel();
      record.paramBytes += p.numel() * static_cast<int64_t>(p.element_size());
    }
    std::vector<int64_t> sizes;
    for (const auto& item : mine) {
      if (item.piece == j) sizes.push_back(item.size);
    }
    if (!sizes.empty()) {
      const auto start = Clock::now();
      record.bySize = measureSizes(piece, sizes, activations, batches, isLast, meter);
      const std::string took = formatMs(std::chrono::duration<double>(Clock::now() - start).count());
      for (const auto& [size, figures] : record.bySize) {
        log::info("profiled ", record.name, " at micro-batch ", size, ": forward ", formatMs(figures.forward.median),
                  ", backward ", formatMs(figures.backward.median), ", recompute ",
                  formatMs(figures.recompute.median), ", output ", formatBytes(figures.outputBytes), ", saved ",
                  formatBytes(figures.savedActivationBytes), ", peak ", formatBytes(figures.peakBytes), " (", took,
                  " for all sizes)");
      }
    }
    if (optimizerPieces.count(j) && record.paramCount > 0) {
      const double seconds = timeOptimizer(piece);
      optimizerSeconds += seconds;
      optimizerParams += record.paramCount;
      log::info("profiled the ", opt_.optimizer, " step over ", record.name, " (", record.paramCount, " parameters): ",
                formatMs(seconds));
    }
    if (measures || optimizerPieces.count(j)) partial.pieces.push_back(std::move(record));
    if (j < lastInput) {
      torch::NoGradGuard noGrad;
      AutocastScope scope(autocast, opt_.device.type(), autocastType(opt_.precision));
      for (auto& [size, batch] : batches) {
        MicrobatchState state;
        activations[size] = piece.forward(state, activations[size], batch, size, /*keepGraph=*/false, false);
      }
    }
  }
  if (!meter.works()) {
    for (auto& p : partial.pieces) {
      for (auto& [size, figures] : p.bySize) figures.savedActivationBytes = figures.peakBytes = 0;
    }
  }
  return partial;
}

// --- communication -----------------------------------------------------------

json Profiler::Impl::planCommunication(const profile::Profile& merged) const {
  json plan = {{"p2p", json::array()}, {"allreduce", json::array()}};
  const int world = opt_.worldSize;
  auto cachedP2p = [&](int64_t bytes) -> const profile::P2PSample* {
    if (!opt_.reuseCached || !existing_) return nullptr;
    for (const auto& s : existing_->p2p) {
      if (s.bytes == bytes) return &s;
    }
    return nullptr;
  };
  // Point-to-point: every activation size seen, with rank 0 and each peer of a
  // kind (same host, other host) still missing for that size.
  std::set<int64_t> sizes;
  for (const auto& piece : merged.pieces) {
    for (const auto& [b, figures] : piece.bySize) {
      if (figures.outputBytes > 0) sizes.insert(std::min(figures.outputBytes, opt_.maxCommBytes));
    }
  }
  for (int64_t bytes : sizes) {
    const auto* cached = cachedP2p(bytes);
    for (int peer = 1; peer < world; ++peer) {
      const bool same = hosts_[peer] == hosts_[0];
      if (cached && (same ? cached->sameHostSeconds : cached->crossHostSeconds) >= 0) continue;
      plan["p2p"].push_back({{"peer", peer}, {"bytes", bytes}, {"same_host", same}});
    }
  }
  // All-reduce: a geometric set from the smallest piece's gradients to the
  // whole model's (a stage's gradients lie in between), over the first k ranks.
  int64_t smallest = 0, total = 0;
  for (const auto& piece : merged.pieces) {
    if (piece.paramBytes <= 0) continue;
    smallest = smallest == 0 ? piece.paramBytes : std::min(smallest, piece.paramBytes);
    total += piece.paramBytes;
  }
  total = std::min(total, opt_.maxCommBytes);
  smallest = std::min(smallest, total);
  std::set<int64_t> buffers;
  if (total > 0) {
    constexpr int kPoints = 5;
    const double ratio = std::pow(static_cast<double>(total) / static_cast<double>(smallest), 1.0 / (kPoints - 1));
    for (int i = 0; i < kPoints; ++i) {
      const auto bytes = static_cast<int64_t>(std::llround(static_cast<double>(smallest) * std::pow(ratio, i)));
      buffers.insert(std::max<int64_t>(4, bytes / 4 * 4));
    }
  }
  for (int k = 2; k <= world; ++k) {
    bool crossHost = false;
    for (int r = 1; r < k; ++r) crossHost = crossHost || hosts_[r] != hosts_[0];
    for (int64_t bytes : buffers) {
      if (opt_.reuseCached && existing_ &&
          std::any_of(existing_->allreduce.begin(), existing_->allreduce.end(), [&](const profile::AllReduceSample& s) {
            return s.bytes == bytes && s.replicas == k && s.crossHost == crossHost;
          })) {
        continue;
      }
      plan["allreduce"].push_back({{"replicas", k}, {"bytes", bytes}, {"cross_host", crossHost}});
    }
  }
  return plan;
}

double Profiler::Impl::pingPong(int peer, int64_t bytes) {
  const bool initiator = isRank0();
  const int other = initiator ? peer : 0;
  auto buffer = torch::zeros({std::max<int64_t>(1, bytes / 4)},
                             torch::TensorOptions().dtype(torch::kFloat).device(opt_.device));
  std::vector<double> samples;
  for (int run = 0; run < opt_.warmup + opt_.commRepetitions; ++run) {
    const auto t0 = Clock::now();
    if (initiator) {
      comm_->waitFor(comm_->send(buffer, other, kPingTag), "profiling point-to-point sends");
      comm_->waitFor(comm_->recv(buffer, other, kPingTag), "profiling point-to-point sends");
    } else {
      comm_->waitFor(comm_->recv(buffer, other, kPingTag), "profiling point-to-point sends");
      comm_->waitFor(comm_->send(buffer, other, kPingTag), "profiling point-to-point sends");
    }
    sync();
    if (run >= opt_.warmup) samples.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / 2);
  }
  return profile::summarize(samples).median;
}

double Profiler::Impl::allreduceOnce(const c10::intrusive_ptr<c10d::Backend>& group, torch::Tensor& buffer) {
  std::vector<at::Tensor> tensors{buffer};
  const auto t0 = Clock::now();
  comm_->waitFor(group->allreduce(tensors), "profiling all-reduce");
  sync();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void Profiler::Impl::measureCommunication(const json& plan, profile::Profile& result) {
  // Point-to-point. A peer waits in the store (not in Gloo, whose waits time
  // out) until rank 0 is ready for it.
  std::map<std::pair<int64_t, bool>, std::vector<double>> p2p;  // (bytes, same host) -> per-peer medians
  for (int peer = 1; peer < opt_.worldSize; ++peer) {
    std::vector<json> mine;
    for (const auto& entry : plan.at("p2p")) {
      if (entry.at("peer").get<int>() == peer) mine.push_back(entry);
    }
    if (mine.empty() || (!isRank0() && opt_.rank != peer)) continue;
    if (isRank0()) {
      comm_->store()->set(key(strCat("p2p_go/", peer)), toBytes("1"));
    } else {
      awaitKey(key(strCat("p2p_go/", peer)), "waiting for rank 0 to measure point-to-point links");
    }
    for (const auto& entry : mine) {
      const int64_t bytes = entry.at("bytes");
      const double seconds = pingPong(peer, bytes);
      if (isRank0()) {
        p2p[{bytes, entry.at("same_host").get<bool>()}].push_back(seconds);
        log::info("profiled point-to-point to rank ", peer, " (", entry.at("same_host").get<bool>() ? "same" : "other",
                  " host), ", formatBytes(bytes), ": ", formatMs(seconds), " one way");
      }
    }
  }
  for (const auto& [what, medians] : p2p) {
    const double seconds = profile::summarize(medians).median;
    auto it = std::find_if(result.p2p.begin(), result.p2p.end(),
                           [&](const profile::P2PSample& s) { return s.bytes == what.first; });
    if (it == result.p2p.end()) it = result.p2p.insert(result.p2p.end(), profile::P2PSample{what.first, -1, -1});
    (what.second ? it->sameHostSeconds : it->crossHostSeconds) = seconds;
  }

  // All-reduce over the first k ranks, k = 2..world. Groups are created by
  // their members in ascending k once rank 0 is done with point-to-point.
  const auto& entries = plan.at("allreduce");
  std::set<int> counts;
  for (const auto& e : entries) counts.insert(e.at("replicas").get<int>());
  if (counts.empty()) return;
  if (isRank0()) {
    comm_->store()->set(key("allreduce_go"), toBytes("1"));
  } else {
    awaitKey(key("allreduce_go"), "waiting for rank 0 to finish point-to-point measurements");
  }
  std::map<int, c10::intrusive_ptr<c10d::Backend>> groups;
  for (int k : counts) {
    if (opt_.rank >= k) continue;
    std::vector<int> ranks(k);
    for (int r = 0; r < k; ++r) ranks[r] = r;
    groups[k] = k == opt_.worldSize ? comm_->world() : comm_->group(strCat("profiler_allreduce", k), ranks);
  }
  for (int k : counts) {
    if (opt_.rank >= k) continue;
    if (isRank0()) {
      comm_->store()->set(key(strCat("allreduce_go/", k)), toBytes("1"));
    } else {
      awaitKey(key(strCat("allreduce_go/", k)), "waiting for rank 0 to measure all-reduce");
    }
    for (const auto& e : entries) {
      if (e.at("replicas").get<int>() != k) continue;
      const int64_t bytes = e.at("bytes");
      auto buffer = torch::zeros({bytes / 4}, torch::TensorOptions().dtype(torch::kFloat).device(opt_.device));
      std::vector<double> samples;
      for (int run = 0; run < opt_.warmup + opt_.commRepetitions; ++run) {
        const double seconds = allreduceOnce(groups.at(k), buffer);
        if (run >= opt_.warmup) samples.push_back(seconds);
      }
      if (!isRank0()) continue;
      const double median = profile::summarize(samples).median;
      const bool crossHost = e.at("cross_host");
      log::info("profiled all-reduce over ", k, " replicas (", crossHost ? "across hosts" : "one host", "), ",
                formatBytes(bytes), ": ", formatMs(median));
      const profile::AllReduceSample sample{bytes, k, crossHost, median};
      auto it = std::find_if(result.allreduce.begin(), result.allreduce.end(), [&](const profile::AllReduceSample& s) {
        return s.bytes == bytes && s.replicas == k && s.crossHost == crossHost;
      });
      if (it == result.allreduce.end()) {
        result.allreduce.push_back(sample);
      } else {
        *it = sample;  // re-measured on top of an existing profile
      }
    }
  }
}

}  // namespace varuna
