// Varuna::Impl: the state and steps behind the public Varuna class, shared by
// the files that implement it. Private to the worker library: include it
// only from pipeline/varuna.cpp, pipeline/varuna_step.cpp,
// pipeline/varuna_update.cpp, checkpoint/varuna_checkpoint.cpp and
// salvage/varuna_salvage.cpp.
//
// varuna.cpp builds the stage and wires gradients and ties; varuna_step.cpp
// runs step() and evaluate(); varuna_update.cpp applies a step once its exchange is done;
// varuna_checkpoint.cpp writes and loads checkpoints; varuna_salvage.cpp
// takes part in a salvage, reading what SalvageState (salvage/salvage_state.h),
// which step() notifies, says this rank holds. They work on the same state
// (model, optimizer, loss scale, step count), but each is a concern of its
// own and one file holding all was too long to read.
//
// Like Varuna, Impl runs on the training thread, with one exception: the
// checkpoint writer's thread calls reportCheckpointFailure() (through
// CheckpointWriterOptions::onFailure).
#pragma once

#include <torch/optim/optimizer.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint/checkpoint_writer.h"
#include "comm/comm.h"
#include "comm/grad_buckets.h"
#include "link/manager_link.h"
#include "pipeline/stage_model.h"
#include "pipeline/step_timeline.h"
#include "pipeline/step_traffic.h"
#include "pipeline/step_exchange.h"
#include "salvage/salvage_state.h"
#include "varuna/common/checkpoint_files.h"
#include "varuna/common/errors.h"
#include "varuna/worker/varuna.h"

namespace varuna {

// The SIGUSR1 request is carried by a step (varuna.cpp keeps the flag).
void clearCheckpointSignal();

class Varuna::Impl {
 public:
  explicit Impl(VarunaOptions options);
  ~Impl();

  StepResult step(const Batch& inputs, std::optional<double> clip);
  double evaluate(const Batch& inputs);
  void setOptimizer(std::shared_ptr<StageOptimizer> optimizer, LossScaleOptions lossScale);
  void synchroniseReplicaBuffers();
  // In varuna_checkpoint.cpp.
  bool checkpoint(const CheckpointRequest& request);
  int64_t loadCheckpoint(const std::string& globalStore, int64_t iteration, bool checkComplete);
  std::optional<int64_t> loadLatestCheckpoint(const std::string& globalStore, std::optional<int64_t> atMost);

  // Salvage (varuna_salvage.cpp, docs/salvage.md). On under run_varuna when
  // its Welcome said so, with a checkpoint store and an optimizer.
  bool salvageOn() const;
  bool salvageCapable() const;
  // This rank lost a peer: report the step held to run_varuna, write this
  // stage's share if ordered to, and exit (kExitSalvaged, or kExitPeerLost
  // without an order). Never returns.
  [[noreturn]] void salvage(const PeerLostError& lost);

  // Runs `body`; a local failure is recorded for the peers before it propagates.
  template <typename F>
  auto guarded(F&& body) -> decltype(body()) {
    try {
      return body();
    } catch (const PeerLostError&) {
      throw;
    } catch (const std::exception& e) {
      if (comm_) comm_->recordFailure(e.what());
      throw;
    }
  }

  // What the Varuna facade reads and asks (varuna.cpp, varuna_checkpoint.cpp).
  const VarunaOptions& options() const { return opt_; }
  int stage() const { return stage_; }
  int replica() const { return replica_; }
  int numStages() const { return P_; }
  int numReplicas() const { return D_; }
  int numChunks() const { return layout_.chunks; }
  // The partition into virtual stages (stages x chunks; ChunkLayout places them).
  const Partition& partition() const { return partition_; }
  const ChunkLayout& layout() const { return layout_; }
  // Whether this rank's chunks include the one computing the loss.
  bool holdsLoss() const { return layout_.stageOf(layout_.virtualStages() - 1) == stage_; }
  const StageToRankMap& map() const { return map_; }
  const LossScaler& scaler() const { return scaler_; }
  int64_t stepsDone() const { return stepsDone_; }
  const StageModel& model() const { return *model_; }
  // The step just taken, to run_varuna (nothing without a manager).
  void reportStep(const StepResult& result, double seconds);
  // The process ends: cleanly (peers may exit as well), or leaving its peers.
  void finishedCleanly();
  void abandon();
  // Background checkpoints land (or fail) before this returns.
  void drainCheckpoints();

 private:
  VarunaOptions opt_;
  StageToRankMap map_;
  int stage_ = 0, replica_ = 0, P_ = 1, D_ = 1;
  ChunkLayout layout_;
  Partition partition_;
  // The training thread waits on peers (BlockedOnPeers); the link's
  // heartbeats carry it. Declared before the link and comm_, which point at it.
  std::atomic<bool> waitingOnPeers_{false};
  // Declared before comm_ so it is destroyed after it: c10d's teardown can take
  // seconds, and the link's heartbeats must cover them (a silent exiting rank
  // would look hung to run_varuna).
  std::unique_ptr<ManagerLink> managerLink_;  // run_varuna reporting (null without a manager)
  std::unique_ptr<Communicator> comm_;
  std::shared_ptr<StageModel> model_;
  GradBuckets buckets_;
  std::shared_ptr<StageOptimizer> optimizer_;
  LossScaler scaler_;
  std::vector<CutShape> inShape_, outShape_;  // per chunk
  std::map<int, Schedule> schedules_;
  // By number of micro-batches: this stage's message plans (step_messages.h)
  // of the schedule and of evaluate()'s order, and that order.
  std::map<int, StageMessagePlan> stepPlans_, evalPlans_;
  std::map<int, StageSchedule> evalOrders_;
  std::unique_ptr<CheckpointWriter> writer_;
  std::string runTag_;  // names this run's partial checkpoint folders (ckpt::runTag)
  int64_t stepsDone_ = 0;
  // Each step's tasks and waits, to VarunaOptions::traceDir (off without
  // one). Made with the stage, so that all ranks agree on a folder refused.
  std::optional<StepTimeline> timeline_;
  // What this rank holds if a peer is lost now; step() notifies it. Made
  // once the stage is built.
  std::optional<SalvageState> salvageState_;

  // Chunk c of this rank is virtual stage virtualStage(c) of the model. Its
  // input comes from the previous virtual stage's rank (or, on the same
  // rank, straight from chunk c-1: inFromChunkBefore), its output goes to
  // the next one's.
  int virtualStage(int chunk) const { return layout_.virtualStage(stage_, chunk); }
  bool first(int chunk) const { return virtualStage(chunk) == 0; }
  bool last(int chunk) const { return virtualStage(chunk) == layout_.virtualStages() - 1; }
  bool inFromChunkBefore(int chunk) const { return !first(chunk) && layout_.stageOf(virtualStage(chunk) - 1) == stage_; }
  bool outToChunkAfter(int chunk) const { return !last(chunk) && layout_.stageOf(virtualStage(chunk) + 1) == stage_; }
  int prevRank(int chunk) const { return map_.rankOf(layout_.stageOf(virtualStage(chunk) - 1), replica_); }
  int nextRank(int chunk) const { return map_.rankOf(layout_.stageOf(virtualStage(chunk) + 1), replica_); }
  int64_t localBatch() const { return opt_.batchSize / D_; }

  std::vector<double> pieceCosts() const;
  void checkBatchSize();
  std::string checkSharedWeights() const;
  std::string checkOneTensorUnderTwoNames() const;
  void setUpGradients();
  void synchroniseTiedWeights();
  void resolveSchedule();
  std::string describeChunks() const;
  // Throws ConfigError where message tags cannot name every cut or micro-batch.
  void checkMessageLimits(int microbatches) const;
  void learnCutShapes();
  std::vector<Batch> splitMicrobatches(const Batch& inputs, int64_t expected, const char* what) const;
  const StageSchedule& scheduleFor(int microbatches);
  const StageMessagePlan& stepPlanFor(int microbatches);
  // A plan as this rank's transport issues it best (receivesFirst or as is).
  StageMessagePlan forThisTransport(StageMessagePlan plan) const;
  bool postsReceivesFirst() const;
  // evaluate()'s order on this stage, and its plan.
  std::pair<const StageSchedule&, const StageMessagePlan&> evalPlanFor(int microbatches);
  StepTraffic::Setup trafficSetup(const std::vector<Batch>& micro, TagKind activationTag);
  torch::Tensor runForward(MicrobatchState& state, const torch::Tensor& input, const Batch& batch, bool keep);
  void checkOutgoing(const torch::Tensor& out, int64_t b, int chunk) const;
  std::string checkAgainstProfile() const;
  StepResult applyStep(const StepExchange& exchange, const PendingUpdate& pending);
  // varuna_update.cpp: the update queued first, the exchange read after
  // (NonFiniteGradients::kStopTraining); the step's bookkeeping; the optimizer.
  StepResult queueUpdateThenRead(const torch::Tensor& summed, const PendingUpdate& pending);
  StepResult recordStep(const StepExchange& exchange, const PendingUpdate& pending);
  double runOptimizer();  // seconds the host spent in it

  // Tied pairs whose two parameters live on different stages, and this
  // rank's role: the stage holding the first name counts it in the norm.
  struct CrossStageTie {
    std::string localName;
    bool primary;
    std::string groupName;
    std::vector<int> groupRanks;
    int rootRank;
  };
  std::vector<CrossStageTie> crossTies_;
  std::vector<SharedWeight> localTies_;  // both names on this stage

  // Salvage (varuna_salvage.cpp).
  void armSalvage();
  void finishStep(const StepExchange& exchange);
  void writeSalvageShare(const proto::SalvageWrite& order);
  std::atomic<bool> optimizerSet_{false};        // read by the link thread (salvage_stop)

  // Writing and loading checkpoints (varuna_checkpoint.cpp).
  NamedTensors pieceParams(int local) const;
  // Parameters and persistent buffers (live, or the changing buffers copied).
  NamedTensors pieceState(int local, bool copyChangingBuffers = false) const;
  std::string pieceFile(int local, const char* kind) const;
  nlohmann::json checkpointMeta(int64_t step);
  std::string agreeOnRunTag();
  ckpt::WriterIdentity writerIdentity() const;
  void reportCheckpointFailure(int64_t step, const std::string& error);
  // What a checkpoint part holds: the pieces this rank writes (none given:
  // all of its stage's), its RNG state, the metadata (rank 0, or the first
  // salvage writer). The one composer of the periodic, on-demand and salvage paths.
  struct CheckpointParts {
    std::function<bool(int piece)> writesPiece;
    bool copyChangingBuffers = false;  // copy running statistics now (a background job snapshots later)
    bool rng = false;
    std::optional<nlohmann::json> meta;
  };
  CheckpointJob composeCheckpoint(const std::string& globalStore, int64_t step, const CheckpointParts& parts) const;
  // Waits until `dir` is complete (every writer's part landed): the one wait
  // of the on-demand and salvage paths. Throws CheckpointError after
  // `timeout`; with stopIfInterrupted, PeerLostError once a peer is lost.
  void waitUntilIntact(const std::filesystem::path& dir, std::chrono::milliseconds timeout, const char* what,
                       bool stopIfInterrupted);
  struct LoadedCheckpoint;
  LoadedCheckpoint readCheckpoint(const std::string& globalStore, int64_t iteration, bool checkComplete);
  void applyCheckpoint(LoadedCheckpoint loaded, int64_t iteration);
  int64_t allReduceMax(int64_t value, const char* during);
};

}  // namespace varuna
