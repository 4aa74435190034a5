// Varuna: trains one model as P pipeline stages x D data-parallel replicas,
// exactly as a single process would train it on the same global batches.
//
// One instance per worker process; construct it in every rank of the job with
// the same ModelSpec. It builds only this rank's stage, joins the c10d process
// groups (Gloo for CPU tensors; NCCL, or Gloo, for CUDA tensors) and runs the pipeline
// schedule. Not thread-safe: call it from the training thread only.
#pragma once

#include <torch/optim/optimizer.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "varuna/common/errors.h"
#include "varuna/common/partition.h"
#include "varuna/common/schedule.h"
#include "varuna/common/stage_map.h"
#include "varuna/worker/devices.h"
#include "varuna/worker/launch_args.h"
#include "varuna/worker/loss_scaler.h"
#include "varuna/worker/model.h"
#include "varuna/worker/stage_optimizer.h"

namespace varuna {

enum class Precision { kFp32, kBf16, kFp16 };
Precision parsePrecision(const std::string& name);  // "fp32", "bf16", "fp16"
std::string toString(Precision precision);

// Sample inputs of a given batch size on a device, as the manual's get_batch_fn.
using GetBatchFn = std::function<Batch(int64_t size, torch::Device device)>;

struct RendezvousOptions {
  std::string masterAddr = "127.0.0.1";
  int masterPort = 29500;
  bool externalStore = false;  // false: rank 0 hosts the TCPStore
  std::string bindAddr;        // this host's address for Gloo; empty: loopback or the host name's
};

// Reporting to run_varuna (see docs/protocol.md): hello, heartbeats from a
// background thread, one step report per step. Off when `address` is empty.
struct ManagerLinkOptions {
  std::string address;  // host:port
  std::string token;
  int generation = -1;
  std::string host;
  std::chrono::milliseconds heartbeatInterval{500};
  // The agent's beat socket (agent_beat.h): heartbeats go there, and the
  // agent relays them; -1 (or not a Unix datagram socket): to the manager.
  int agentBeatFd = -1;
};

// Where and how the runtime writes checkpoints it takes on its own: the
// on-demand checkpoint of exitIfCheckpointRequested() and retention after every
// completed checkpoint (docs/checkpoints.md).
struct CheckpointOptions {
  std::string globalStore;  // empty: no checkpoints (applyLaunchArgs fills run_varuna's)
  std::string tempdir;      // local folder for background copies; empty: none
  bool shard = false;       // spread a stage's piece files over its replicas
  // The newest complete checkpoints kept; older ones, and the remains of
  // interrupted ones, are removed once a newer checkpoint completes.
  // 0 keeps everything. run_varuna --keep_checkpoints sets it.
  int keepCheckpoints = 3;
};

// Where a step's job-wide exchange (the all-reduce of loss, gradient norm and
// the checkpoint request) just completed on this rank: what a fault
// injector (VarunaOptions::faults) is shown.
struct ExchangePoint {
  int stage = 0;
  int replica = 0;
  int64_t step = 0;    // the step it completes: stepsDone() once applied
  int generation = 0;  // run_varuna's launch (0: none)
};

// Faults a test program injects into the runtime (none in production): each
// hook, when set, is asked at its point and answers whether to fail there.
struct FaultInjector {
  // True: this rank acts as if the exchange had failed under it right after
  // it completed everywhere else (a PeerLostError; salvage takes it from
  // there): the split a peer dying during the exchange can leave.
  std::function<bool(const ExchangePoint&)> loseExchange;
  // True: this rank's gradients of the step become non-finite (times
  // infinity) just before the exchange, as an overflow or a divergence would
  // make them. The point's step is the one the exchange would complete.
  std::function<bool(const ExchangePoint&)> poisonGradients;
};

// What a step whose gradients are not all finite does in fp32 and bf16 (in
// fp16 such a step is always skipped on every rank and the loss scale halved).
enum class NonFiniteGradients {
  // Skipped on every rank, with a warning. The host reads the step's
  // job-wide exchange before the optimizer runs: on a GPU the optimizer's
  // kernels are launched only once the backward pass has finished.
  kSkipStep,
  // The update (clipping included, computed on the device with the same
  // result) is queued right after the exchange and the result read after it,
  // so the host launches the optimizer's kernels while the GPU still runs the
  // backward pass, as a plain PyTorch loop does: worth it where the optimizer
  // is many small kernels (torch::optim's AdamW, one parameter at a time). A
  // non-finite gradient has then been applied: step() throws
  // NonFiniteGradientsError (exit 1) and a relaunch resumes from the latest
  // checkpoint. Not with fp16, which must skip to find its loss scale.
  kStopTraining,
};

// How the C library's allocator treats large host blocks. A CPU backward pass
// frees megabyte-sized weight-gradient temporaries every micro-batch; glibc
// by default keeps them in its heap, fast to reuse, and a step's peak
// resident memory then depends on how they fragmented it. GPU tensors are
// not affected either way (CUDA's caching allocator holds them).
enum class HostMemory {
  // glibc's defaults: the fastest CPU steps.
  kFast,
  // Blocks of 4 MiB and more get their own mappings, returned when freed: a
  // rank's peak is what is live (bench/memory: 1.16-1.18x its floor, against
  // 1.18-1.39x), at a page fault per 4 KiB of each such block (about 18 % of
  // a CPU step at d_model 1024). Process-wide, set when Varuna is built; a
  // MALLOC_MMAP_THRESHOLD_ in the environment wins.
  kCompact,
};

// A step's gradients were not finite and, with NonFiniteGradients::
// kStopTraining, already applied: the parameters are no longer finite.
class NonFiniteGradientsError : public Error {
 public:
  explicit NonFiniteGradientsError(const std::string& what) : Error(what, kExitTrainingFailed) {}
};

struct VarunaOptions {
  ModelSpec model;
  std::string stageToRankMap;  // the launcher's string, e.g. "0,2;1,3;"
  int rank = 0;
  int localRank = 0;
  GetBatchFn getBatch;       // required: used to learn the shapes crossing each cut
  int64_t batchSize = 0;     // global batch size (all replicas together); 0: the launcher's
  int64_t chunkSize = 0;     // micro-batch size
  Precision precision = Precision::kFp32;
  torch::Device device = torch::kCPU;
  // How tensors travel between ranks (devices.h): auto is NCCL on CUDA, Gloo
  // on the CPU; Gloo on CUDA lets several ranks share one GPU.
  CommBackend commBackend = CommBackend::kAuto;
  ScheduleKind schedule = ScheduleKind::kVaruna;
  // Chunks (virtual stages) per rank under interleaved (2..8) and zbv (2);
  // 0 takes the kind's default (defaultChunks). Needs stages x chunks pieces.
  int scheduleChunks = 0;
  NonFiniteGradients onNonFiniteGradients = NonFiniteGradients::kSkipStep;
  HostMemory hostMemory = HostMemory::kFast;
  RendezvousOptions rendezvous;
  // A peer silent for this long (or whose connection breaks) fails the job
  // with PeerLostError naming it.
  std::chrono::milliseconds peerTimeout{std::chrono::seconds(60)};
  // Data-parallel gradient buckets, all-reduced as soon as they are complete.
  int64_t bucketBytes = 4 << 20;
  ManagerLinkOptions manager;
  CheckpointOptions checkpointing;
  // Non-empty: each rank writes what it did when in every step (tasks, waits
  // on neighbours, messages, all-reduces, update) as Chrome trace events to
  // <traceDir>/rank<r>_trace.json; scripts/pipeline_trace.py merges them and
  // splits the step into the schedule's bubble and the rest (docs/profile.md).
  std::string traceDir;
  // Set by applyLaunchArgs from run_varuna's AutoConfig; when given they
  // override `schedule`, `scheduleChunks` and `model.pieceCosts`.
  std::optional<ScheduleChoice> launcherSchedule;
  std::vector<double> launcherPieceCosts;
  // The pieces (name, parameter count) of the profile the launcher planned
  // with; a model that differs is refused at start-up (a stale profile).
  std::vector<std::pair<std::string, int64_t>> launcherProfiledPieces;
  // The global batch the launcher gave (its per-replica --batch-size x
  // replicas; 0: none): batchSize 0 takes it, another batchSize is refused.
  int64_t launcherBatchSize = 0;

  // Test programs only (e.g. train_gpt --test_lose_exchange).
  FaultInjector faults;

  // Fills rank, local rank, map and rendezvous from the launcher's arguments.
  void applyLaunchArgs(const LaunchArgs& args);
};

// One checkpoint to write (Varuna::checkpoint).
struct CheckpointRequest {
  std::string globalStore;     // the job's checkpoint root (varuna_ckpt_<step>/ under it)
  std::optional<int64_t> step; // unset: the steps taken so far
  // Local folder: tensors are snapshotted in memory, written here, then
  // copied to the store in the background while training goes on. Empty:
  // written to the store directly, before checkpoint() returns.
  std::string tempdir;
  bool shard = false;     // each stage's pieces written by all its replicas, not only replica 0
  // Written synchronously (after any background ones) and waited for until
  // complete on every rank: checkpoint-and-exit.
  bool onDemand = false;
};

struct StepResult {
  double loss = 0.0;       // mean over the global batch, identical on every rank
  bool overflow = false;   // fp16: inf/NaN gradients somewhere, step skipped everywhere
  double gradNorm = 0.0;   // global L2 norm over all stages (tied weights once), before clipping
  double lossScale = 1.0;  // the scale used for this step (1 unless fp16)
  // This rank's own timings (not reduced): forward/recompute/backward compute,
  // mean per micro-batch (what the manager compares to find slow machines),
  // and the optimizer step.
  double computeSecondsPerMicrobatch = 0.0;
  double optimizerSeconds = 0.0;
  // Time blocked on neighbour stages inside the pipeline: waiting for an
  // input to arrive, and for the step's sends to complete (bubble plus
  // transfer time).
  double waitSeconds = 0.0;
  int microbatches = 0;
  // Some rank received SIGUSR1 (see installCheckpointSignalHandler) before this
  // step's job-wide exchange: every rank sees the same value in the same step,
  // so all of them can write the on-demand checkpoint of this step and exit.
  bool checkpointRequested = false;
};

class Varuna {
 public:
  explicit Varuna(VarunaOptions options);
  ~Varuna();
  Varuna(const Varuna&) = delete;
  Varuna& operator=(const Varuna&) = delete;

  // This stage's parameters, for building the optimizer (after construction).
  std::vector<torch::Tensor> parameters() const;
  // Full names ("block3.attn.qkv.weight") and tensors of this stage.
  std::vector<std::pair<std::string, torch::Tensor>> namedParameters() const;
  // This stage's module buffers (BatchNorm running statistics, any
  // register_buffer), by full name. They are model state: checkpointed with
  // the parameters, left as one forward leaves them by Varuna's recompute, and
  // identical on every data-parallel replica after each step (replica 0's are
  // broadcast, as DDP does).
  std::vector<std::pair<std::string, torch::Tensor>> namedBuffers() const;

  // Registers the optimizer over parameters(). Loss-scale options apply to fp16.
  void setOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer, LossScaleOptions lossScale = {});
  // Any optimizer behind the StageOptimizer interface (the Python front end's).
  void setOptimizer(std::shared_ptr<StageOptimizer> optimizer, LossScaleOptions lossScale = {});

  // One training step over this replica's share of the global batch
  // (batchSize / numReplicas samples; every stage of a replica gets the same
  // inputs). Must be called on every rank. Throws PeerLostError if a peer dies.
  StepResult step(const Batch& inputs, std::optional<double> clipGradMaxNorm = std::nullopt);

  // Mean loss over every replica's inputs, no gradients. Called on every rank.
  double evaluate(const Batch& inputs);

  // Checkpoints (docs/checkpoints.md); every rank calls them with the same
  // arguments. Writes <globalStore>/varuna_ckpt_<step>/ (step: stepsDone() by
  // default), parameters and optimizer state per piece, keyed by name. shard:
  // each stage's pieces are written by all its replicas, not only replica 0.
  // tempdir: tensors are snapshotted in memory and written to this local
  // directory then copied to the global store in the background while training
  // goes on. onDemand: written synchronously (after any background ones) and
  // waited for until the checkpoint is complete, for checkpoint-and-exit.
  // A storage failure (full disk, I/O error) of a periodic checkpoint is
  // logged and reported to run_varuna and training goes on (returns false; the
  // next checkpoint tries again); an on-demand one throws CheckpointError
  // (exit code kExitStorageError). A worker whose generation was superseded
  // throws SupersededError and never completes a checkpoint.
  bool checkpoint(const CheckpointRequest& request);
  // Into `globalStore`, directly (no tempdir, no sharding).
  bool checkpoint(const std::string& globalStore, std::optional<int64_t> step = std::nullopt);
  // With VarunaOptions::checkpointing's store, tempdir and sharding.
  bool checkpoint(std::optional<int64_t> step = std::nullopt);
  // Checkpoint-and-exit, the contract run_varuna's morphing relies on: when
  // `result` says a checkpoint was requested (SIGUSR1 on any rank), writes the
  // on-demand checkpoint of the step just taken with VarunaOptions::
  // checkpointing and exits with kExitCheckpointed (75). Call it after every
  // step(); it returns only when nothing was requested.
  void exitIfCheckpointRequested(const StepResult& result);
  // Loads varuna_ckpt_<iteration> under the current partition: parameters,
  // optimizer state and settings, loss scale, generator states (when the
  // layout is unchanged), step and data position. Call after setOptimizer().
  // checkComplete: refuse a checkpoint without its marker, and files whose
  // size or checksum differs from the manifest. Returns the step.
  // Every file this rank reads is read and verified (size and crc32 against
  // the manifest) and matched against the model before any tensor changes:
  // a bad checkpoint leaves the model untouched.
  int64_t loadCheckpoint(const std::string& globalStore, int64_t iteration, bool checkComplete = true);
  // Loads the newest complete checkpoint at or below `atMost` (all when not
  // given) that every rank can verify, falling back past damaged ones (each is
  // logged and marked so run_varuna skips it too). A collective: all ranks
  // agree on the step. Returns it, or nullopt when no checkpoint loads (the
  // model is then untouched).
  std::optional<int64_t> loadLatestCheckpoint(const std::string& globalStore,
                                              std::optional<int64_t> atMost = std::nullopt);
  // Blocks until background checkpoints have landed (or failed: a failed one
  // was logged and reported; it does not throw).
  void waitForCheckpoints();
  // The program is ending after a failure of its own: when this object is
  // destroyed, leave the job at once. (Otherwise a rank that finishes cleanly
  // and hosts the job's rendezvous store, rank 0, waits on its way out for
  // the others to finish, so that it does not cut them off; destruction
  // during exception unwinding never waits.)
  void abandon();
  // Optimizer steps taken (attempted, including fp16-skipped ones), counting
  // those restored from a checkpoint.
  int64_t stepsDone() const;
  // Global index of the next sample: data position for resuming the data order.
  int64_t samplesSeen() const;

  int rank() const;
  int stage() const;
  int replica() const;
  int numStages() const;
  int numReplicas() const;
  // Whether this rank computes the loss: the last stage, or under zbv
  // (whose last chunk sits on stage 0) the first.
  bool isLastStage() const;
  // Chunks (virtual stages) this rank holds: 1 unless the schedule is chunked.
  int numChunks() const;
  // The global pieces [begin, end) of each of this rank's chunks.
  std::vector<std::pair<int, int>> ownedPieces() const;
  const Partition& partition() const;
  const StageToRankMap& stageToRankMap() const;
  torch::Device device() const;
  const LossScaler& lossScaler() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Installs a SIGUSR1 handler that only sets a flag (async-signal-safe); the
// next step() turns it into StepResult::checkpointRequested on every rank.
// Then unblocks SIGUSR1 for the calling thread (call it from the training
// thread, as early as possible): varuna_agent starts workers with it blocked,
// so a request that arrived before this is delivered now, not lost, and one
// that arrives before it never kills the process.
void installCheckpointSignalHandler();
bool checkpointSignalled();

// Exits at once with `code` after flushing output, skipping destructors that
// could wait on peers that already left (e.g. after an on-demand checkpoint).
[[noreturn]] void exitWorker(int code);

// Ends a worker after an expected failure: logs `error`, flushes, and exits at
// once with its exit code without running destructors that could wait on dead
// peers. Use it in main's catch block.
[[noreturn]] void exitAfterFailure(const std::exception& error);

}  // namespace varuna
