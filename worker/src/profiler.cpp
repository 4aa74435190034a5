#include "varuna/worker/profiler.h"

#include <c10/core/CPUAllocator.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#ifdef VARUNA_HAVE_NCCL
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "autocast_scope.h"
#include "comm.h"
#include "stage_model.h"
#include "varuna/common/errors.h"
#include "varuna/common/log.h"

namespace varuna {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr const char* kKeyPrefix = "varuna/profiler/";
constexpr int kPingTag = 7 << 24;

std::string key(const std::string& name) { return kKeyPrefix + name; }

std::string toText(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> toBytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

std::string firstLine(std::string text) {
  if (auto nl = text.find('\n'); nl != std::string::npos) text.resize(nl);  // c10 appends backtraces
  return text;
}

std::string localHostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

std::string utcNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

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

at::ScalarType autocastType(Precision p) { return p == Precision::kBf16 ? at::kBFloat16 : at::kHalf; }

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

// Live and peak bytes of the device the pieces run on: the counting CPU
// allocator above, or the CUDA caching allocator's statistics. Only
// differences between readings are meaningful (both count what was allocated
// before they started differently).
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

struct Item {
  int piece;
  int64_t size;
};

std::shared_ptr<torch::optim::Optimizer> makeOptimizer(const std::string& name, std::vector<torch::Tensor> params) {
  if (name == "adam") return std::make_shared<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-4));
  if (name == "adamw") return std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-4));
  return std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(1e-4).momentum(0.9));
}

int64_t optimizerBytesPerParam(const std::string& name) { return name == "sgd" ? 4 : 8; }

}  // namespace

void ProfilerOptions::applyLaunchArgs(const LaunchArgs& args) {
  rank = args.rank;
  worldSize = args.stageToRankMap.empty() ? args.worldSize : StageToRankMap::parse(args.stageToRankMap).worldSize();
  rendezvous.masterAddr = args.masterAddr;
  rendezvous.masterPort = args.masterPort;
  rendezvous.externalStore = args.externalStore;
  rendezvous.bindAddr = args.hostAddr;
  host = args.hostAddr;
}

std::string profilePath(const std::string& outputDir) {
  return (std::filesystem::path(outputDir) / "profile.json").string();
}

std::string modelFingerprint(const ModelSpec& model) {
  std::vector<std::pair<std::string, std::vector<std::vector<int64_t>>>> pieces;
  for (int i = 0; i < static_cast<int>(model.pieces.size()); ++i) {
    auto piece = buildPiece(model, i);  // one at a time: freed before the next is built
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& p : piece->named_parameters(/*recurse=*/true)) shapes.push_back(p.value().sizes().vec());
    pieces.emplace_back(model.pieces[i].name, std::move(shapes));
  }
  return profile::fingerprint(pieces);
}

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

  std::vector<Item> pendingItems() const;
  profile::Profile measurePieces(const std::vector<Item>& mine, const std::set<int>& optimizerPieces,
                                 double& optimizerSeconds, int64_t& optimizerParams);
  // Raw samples of one piece at one micro-batch size, gathered over several
  // calls of runPiece so the sizes' repetitions can be interleaved.
  struct Samples {
    std::vector<double> forward, backward, recompute;
    int64_t outputBytes = 0, savedMax = 0, peakMax = 0;
    profile::PieceAtSize summary() const;
  };
  void runPiece(StageModel& piece, const torch::Tensor& input, const Batch& batch, int64_t size, bool isLast,
                MemoryMeter& meter, bool timed, Samples& samples);
  std::map<int64_t, profile::PieceAtSize> measureSizes(StageModel& piece, const std::vector<int64_t>& sizes,
                                                       std::map<int64_t, torch::Tensor>& inputs,
                                                       const std::map<int64_t, Batch>& batches, bool isLast,
                                                       MemoryMeter& meter);
  double timeOptimizer(StageModel& piece);
  profile::Profile gather(const profile::Profile& mine, double optimizerSeconds, int64_t optimizerParams);

  json planCommunication(const profile::Profile& merged) const;
  void measureCommunication(const json& plan, profile::Profile& result);
  double pingPong(int peer, int64_t bytes);
  double allreduceOnce(const c10::intrusive_ptr<c10d::Backend>& group, torch::Tensor& buffer);

  void sync() const {
    if (opt_.device.is_cuda()) torch::cuda::synchronize(opt_.device.index());
  }
  bool isRank0() const { return opt_.rank == 0; }

  ModelSpec model_;
  GetBatchFn getBatch_;
  ProfilerOptions opt_;
  std::unique_ptr<Communicator> comm_;  // null when worldSize == 1
  std::vector<int> selected_;           // piece indices to profile
  std::vector<std::string> hosts_;      // per rank
  std::optional<profile::Profile> existing_;
  std::string fingerprint_;             // rank 0
};

std::string Profiler::Impl::checkOptions() {
  try {
    validateModelSpec(model_);
  } catch (const std::exception& e) {
    return e.what();
  }
  if (!getBatch_) return "profiler: getBatch is required (sample inputs of a given micro-batch size)";
  if (opt_.microBatchSizes.empty()) return "profiler: give at least one micro-batch size (--micro_batch_sizes)";
  for (int64_t b : opt_.microBatchSizes) {
    if (b < 1) return strCat("profiler: micro-batch size ", b, " is not positive (--micro_batch_sizes)");
  }
  std::sort(opt_.microBatchSizes.begin(), opt_.microBatchSizes.end());
  opt_.microBatchSizes.erase(std::unique(opt_.microBatchSizes.begin(), opt_.microBatchSizes.end()),
                             opt_.microBatchSizes.end());
  if (opt_.warmup < 0) return strCat("profiler: warmup ", opt_.warmup, " is negative (--warmup)");
  if (opt_.repetitions < 1) {
    return strCat("profiler: repetitions must be >= 1, got ", opt_.repetitions, " (--repetitions)");
  }
  if (opt_.commRepetitions < 1) {
    return strCat("profiler: communication repetitions must be >= 1, got ", opt_.commRepetitions,
                  " (--comm_repetitions)");
  }
  if (opt_.optimizer != "adam" && opt_.optimizer != "adamw" && opt_.optimizer != "sgd") {
    return strCat("profiler: unknown optimizer '", opt_.optimizer, "': use adam, adamw or sgd");
  }
  if (isRank0() && opt_.outputDir.empty()) return "profiler: the output folder is required (--profile_dir)";
  if (opt_.reuseCached) opt_.addToExisting = true;

  // Pieces by name, or by index as the original's pstages_to_profile.
  std::set<int> chosen;
  for (const auto& entry : opt_.pieces) {
    int index = -1;
    for (size_t i = 0; i < model_.pieces.size(); ++i) {
      if (model_.pieces[i].name == entry) index = static_cast<int>(i);
    }
    const bool number = !entry.empty() && entry.size() < 10 &&
                        std::all_of(entry.begin(), entry.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
    if (index < 0 && number) {
      const long long n = std::stoll(entry);
      if (n < static_cast<long long>(model_.pieces.size())) index = static_cast<int>(n);
    }
    if (index < 0) {
      std::string names;
      for (const auto& p : model_.pieces) names += (names.empty() ? "" : ", ") + p.name;
      return strCat("profiler: '", entry, "' is neither the name nor the index of a piece (--pieces); the pieces are: ",
                    names);
    }
    chosen.insert(index);
  }
  if (opt_.pieces.empty()) {
    for (int i = 0; i < static_cast<int>(model_.pieces.size()); ++i) chosen.insert(i);
  }
  selected_.assign(chosen.begin(), chosen.end());
  return "";
}

std::string Profiler::Impl::loadExisting() {
  try {
    fingerprint_ = modelFingerprint(model_);
    const std::string path = profilePath(opt_.outputDir);
    if (!opt_.addToExisting) return "";
    if (!std::filesystem::exists(path)) {
      log::info("profiler: no profile in ", opt_.outputDir, " yet: starting a new one");
      return "";
    }
    profile::Profile p = profile::readProfile(path, fingerprint_);
    const std::string device = opt_.device.is_cuda() ? "cuda" : "cpu";
    if (p.device != device || p.precision != toString(opt_.precision)) {
      return strCat("profile ", path, " was measured on ", p.device, " in ", p.precision, ", this run is on ", device,
                    " in ", toString(opt_.precision), ": use another --profile_dir or profile without --add");
    }
    existing_ = std::move(p);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

void Profiler::Impl::connect() {
  if (opt_.worldSize < 2) return;
  CommOptions comm;
  comm.masterAddr = opt_.rendezvous.masterAddr;
  comm.masterPort = opt_.rendezvous.masterPort;
  comm.bindAddr = opt_.rendezvous.bindAddr;
  comm.hostStore = isRank0() && !opt_.rendezvous.externalStore;
  comm.rank = opt_.rank;
  comm.worldSize = opt_.worldSize;
  comm.device = opt_.device;
  comm.timeout = opt_.peerTimeout;
  // A one-stage map: in errors, rank r reads as "stage 0, replica r".
  comm_ = std::make_unique<Communicator>(comm, StageToRankMap::clustered(1, opt_.worldSize));
}

void Profiler::Impl::agree(const std::string& name, const std::string& myError) {
  if (!comm_) {
    if (!myError.empty()) throw ConfigError(myError);
    return;
  }
  try {
    comm_->agreeOnStartup("profiler_" + name, myError);
  } catch (const ConfigError&) {
    // Everyone stops with the same message. Rank 0 may host the store: it
    // stays until the others have read its verdict (bounded: a rank may be gone).
    comm_->store()->set(key(strCat(name, "_seen/", opt_.rank)), toBytes("1"));
    if (isRank0()) {
      std::vector<std::string> keys;
      for (int r = 1; r < opt_.worldSize; ++r) keys.push_back(key(strCat(name, "_seen/", r)));
      try {
        comm_->store()->wait(keys, std::chrono::seconds(5));
      } catch (const std::exception&) {
        // Someone did not answer in time; it will find out on its own.
      }
    }
    throw;
  }
}

void Profiler::Impl::awaitKey(const std::string& name, const std::string& during) {
  const auto& store = comm_->store();
  PeerMonitor& monitor = comm_->monitor();
  // A peer computing a large piece may be silent in the store for minutes but
  // its heartbeat thread keeps beating; one silent for this long is gone.
  const auto silence = std::min<std::chrono::milliseconds>(opt_.peerTimeout, std::chrono::seconds(10));
  std::vector<int64_t> beats;
  std::vector<Clock::time_point> lastBeat(opt_.worldSize, Clock::now());
  auto nextCheck = Clock::now();
  // check() rather than wait(): a wait that times out logs a c10d warning,
  // and these waits may last as long as a peer's measurements. Polling every
  // 50 ms costs one store round trip each and bounds the added latency.
  for (;;) {
    std::vector<int64_t> now;
    try {
      if (store->check({name})) return;
      if (Clock::now() < nextCheck) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      nextCheck = Clock::now() + std::chrono::milliseconds(500);
      if (monitor.failureRecorded()) throw monitor.diagnose(during, "a rank reported a failure");
      now = monitor.readHeartbeats();
    } catch (const PeerLostError&) {
      throw;
    } catch (const std::exception& e) {
      throw monitor.diagnose(during, firstLine(e.what()));  // the store is unreachable
    }
    for (int r = 0; r < opt_.worldSize; ++r) {
      if (beats.empty() || now[r] != beats[r]) {
        lastBeat[r] = Clock::now();
      } else if (r != opt_.rank && Clock::now() - lastBeat[r] > silence) {
        PeerLostError lost = monitor.diagnose(
            during, strCat("rank ", r, " sent no heartbeat for ",
                           std::chrono::duration_cast<std::chrono::milliseconds>(silence).count(), " ms"));
        if (lost.lostRank() >= 0) throw lost;
        lastBeat[r] = Clock::now();  // it beat again meanwhile
      }
    }
    beats = std::move(now);
  }
}

std::vector<Item> Profiler::Impl::pendingItems() const {
  std::vector<Item> items;
  for (int piece : selected_) {
    const profile::PieceProfile* cached = nullptr;
    if (opt_.reuseCached && existing_) {
      for (const auto& p : existing_->pieces) {
        if (p.name == model_.pieces[piece].name) cached = &p;
      }
    }
    for (int64_t b : opt_.microBatchSizes) {
      if (cached && cached->bySize.count(b)) continue;
      items.push_back({piece, b});
    }
  }
  return items;
}

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
  result.outputBytes = outputBytes;
  result.savedActivationBytes = savedMax;
  result.peakBytes = peakMax;
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

profile::Profile Profiler::Impl::gather(const profile::Profile& mine, double optimizerSeconds,
                                        int64_t optimizerParams) {
  std::vector<json> parts;
  const json own = {{"profile", profile::toJson(mine)},
                    {"optimizer_s", optimizerSeconds},
                    {"optimizer_params", optimizerParams}};
  if (comm_) {
    comm_->store()->set(key(strCat("result/", opt_.rank)), toBytes(own.dump()));
    if (!isRank0()) return mine;
    for (int r = 0; r < opt_.worldSize; ++r) {
      const std::string k = key(strCat("result/", r));
      awaitKey(k, strCat("waiting for rank ", r, "'s measurements"));
      parts.push_back(json::parse(toText(comm_->store()->get(k))));
    }
  } else {
    parts.push_back(own);
  }
  profile::Profile merged;
  double seconds = 0;
  int64_t params = 0;
  for (const auto& part : parts) {
    merged = profile::merge(merged, profile::fromJson(part.at("profile"), "a rank's measurements"));
    seconds += part.at("optimizer_s").get<double>();
    params += part.at("optimizer_params").get<int64_t>();
  }
  merged.optimizerSecondsPerParam = params > 0 ? seconds / static_cast<double>(params) : 0;
  return merged;
}

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

profile::Profile Profiler::Impl::run() {
  if (opt_.worldSize < 1 || opt_.rank < 0 || opt_.rank >= opt_.worldSize) {
    throw ConfigError(strCat("profiler: rank ", opt_.rank, " is not within world size ", opt_.worldSize));
  }
  connect();
  try {
    return runConnected();
  } catch (const PeerLostError&) {
    throw;
  } catch (const std::exception& e) {
    if (comm_) comm_->recordFailure(e.what());  // peers waiting on this rank name it
    throw;
  }
}

profile::Profile Profiler::Impl::runConnected() {
  std::string error = checkOptions();
  if (error.empty() && isRank0()) error = loadExisting();
  const std::string host = opt_.host.empty() ? localHostName() : opt_.host;
  if (comm_) {
    comm_->store()->set(key(strCat("host/", opt_.rank)), toBytes(host));
    if (isRank0()) comm_->store()->set(key("existing"), toBytes(existing_ ? profile::toJson(*existing_).dump() : ""));
  }
  // A bad option or a stale profile stops every rank with the same message.
  agree("setup", error);
  hosts_.assign(opt_.worldSize, host);
  if (comm_) {
    for (int r = 0; r < opt_.worldSize; ++r) hosts_[r] = toText(comm_->store()->get(key(strCat("host/", r))));
    if (!isRank0()) {
      const std::string text = toText(comm_->store()->get(key("existing")));
      if (!text.empty()) existing_ = profile::fromJson(json::parse(text), "rank 0's existing profile");
    }
  }

  // Spread the (piece, size) measurements still to do round-robin over the ranks.
  const auto pending = pendingItems();
  const int cached = static_cast<int>(selected_.size() * opt_.microBatchSizes.size() - pending.size());
  if (isRank0()) {
    log::info("profiling ", selected_.size(), " pieces at micro-batch sizes ", json(opt_.microBatchSizes).dump(), ": ",
              pending.size(), " measurements over ", opt_.worldSize, " ranks, reused ", cached, " cached");
  }
  std::vector<Item> mine;
  std::set<int> optimizerPieces;  // timed by the rank that measures the piece's first pending size
  std::set<int> seen;
  for (size_t k = 0; k < pending.size(); ++k) {
    const int owner = static_cast<int>(k % opt_.worldSize);
    if (owner == opt_.rank) mine.push_back(pending[k]);
    if (seen.insert(pending[k].piece).second && owner == opt_.rank) optimizerPieces.insert(pending[k].piece);
  }
  const bool haveOptimizerTime = existing_ && existing_->optimizerSecondsPerParam > 0;
  if (pending.empty() && !haveOptimizerTime) {
    for (size_t k = 0; k < selected_.size(); ++k) {
      if (static_cast<int>(k % opt_.worldSize) == opt_.rank) optimizerPieces.insert(selected_[k]);
    }
  }

  double optimizerSeconds = 0;
  int64_t optimizerParams = 0;
  const auto measured = measurePieces(mine, optimizerPieces, optimizerSeconds, optimizerParams);
  profile::Profile result = gather(measured, optimizerSeconds, optimizerParams);

  // Rank 0: the new measurements on top of the existing profile (if any).
  if (isRank0()) {
    result.modelFingerprint = fingerprint_;
    result.device = opt_.device.is_cuda() ? "cuda" : "cpu";
    result.precision = toString(opt_.precision);
    result.host = host;
    result.createdAt = utcNow();
    result.optimizerBytesPerParam = optimizerBytesPerParam(opt_.optimizer);
    if (!result.pieces.empty() && result.pieces.front().paramCount > 0) {
      result.gradientBytesPerParam = result.pieces.front().paramBytes / result.pieces.front().paramCount;
    }
    if (existing_) {
      const bool timedOptimizer = result.optimizerSecondsPerParam > 0;
      result = profile::merge(*existing_, result);
      // The step time and the state size describe the same optimizer.
      if (timedOptimizer) result.optimizerBytesPerParam = optimizerBytesPerParam(opt_.optimizer);
    }
    // Pieces in model order (the simulator reads them as a sequence).
    std::map<std::string, int> order;
    for (size_t i = 0; i < model_.pieces.size(); ++i) order[model_.pieces[i].name] = static_cast<int>(i);
    std::stable_sort(result.pieces.begin(), result.pieces.end(),
                     [&](const profile::PieceProfile& a, const profile::PieceProfile& b) {
                       return order[a.name] < order[b.name];
                     });
  }

  if (comm_ && opt_.profileCommunication) {
    if (isRank0()) comm_->store()->set(key("comm_plan"), toBytes(planCommunication(result).dump()));
    awaitKey(key("comm_plan"), "waiting for rank 0's communication plan");
    measureCommunication(json::parse(toText(comm_->store()->get(key("comm_plan")))), result);
  }

  if (!isRank0()) {
    // Stay alive (heartbeating) until rank 0 is done: a rank that left early
    // would look lost to rank 0's waits. Rank 0's failure reaches us here.
    awaitKey(key("done"), "waiting for rank 0 to write the profile");
    const std::string failure = toText(comm_->store()->get(key("done")));
    // add() has a reply: once it returns the store has everything we sent.
    comm_->store()->add(key(strCat("ack/", opt_.rank)), 1);
    if (!failure.empty()) throw ConfigError(strCat("rank 0 could not write the profile: ", failure));
    return result;
  }
  std::string failure;
  try {
    profile::writeProfile(result, profilePath(opt_.outputDir));
    log::info("wrote ", profilePath(opt_.outputDir), " (", result.pieces.size(), " pieces, sizes ",
              json(result.microBatchSizes()).dump(), ", ", result.p2p.size(), " point-to-point and ",
              result.allreduce.size(), " all-reduce samples)");
  } catch (const std::exception& e) {
    failure = strCat("cannot write the profile to ", opt_.outputDir, ": ", e.what());
  }
  if (comm_) {
    comm_->store()->set(key("done"), toBytes(failure));
    // Rank 0 may host the store: keep it up until every rank has read "done".
    for (int r = 1; r < opt_.worldSize; ++r) {
      awaitKey(key(strCat("ack/", r)), strCat("waiting for rank ", r, " to finish"));
    }
  }
  if (!failure.empty()) throw ConfigError(failure);
  return result;
}

Profiler::Profiler(ModelSpec model, GetBatchFn getBatch, ProfilerOptions options)
    : impl_(std::make_unique<Impl>(std::move(model), std::move(getBatch), std::move(options))) {}

Profiler::~Profiler() = default;

profile::Profile Profiler::run() { return impl_->run(); }

}  // namespace varuna
