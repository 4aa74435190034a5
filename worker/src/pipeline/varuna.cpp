// Varuna's training side: builds this rank's stage (its chunks) from the
// partition and wires gradient buckets and tied weights; varuna_step.cpp
// then runs step() and evaluate() over the pipeline schedule. Also the
// SIGUSR1 checkpoint request (step() agrees on it job-wide) and the exits a
// worker takes. Writing and loading checkpoints is in varuna_checkpoint.cpp; the
// Impl both files share is declared in varuna_impl.h.
#include "varuna/worker/varuna.h"

#include <torch/autograd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <numeric>

#include "device/autocast_scope.h"
#include "device/host_memory.h"
#include "pipeline/varuna_impl.h"
#include "varuna/common/errors.h"
#include "varuna/common/log.h"
#include "varuna/common/secrets.h"

#include <signal.h>

#include <atomic>

namespace varuna {

namespace {
std::atomic<bool> gCheckpointSignal{false};
static_assert(std::atomic<bool>::is_always_lock_free, "the signal handler needs a lock-free flag");
void onCheckpointSignal(int) { gCheckpointSignal.store(true); }
}  // namespace

void installCheckpointSignalHandler() {
  struct sigaction action {};
  action.sa_handler = onCheckpointSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &action, nullptr);
  // varuna_agent starts workers with SIGUSR1 blocked, so a request that came
  // during start-up is pending rather than fatal: unblocking it now, with the
  // handler in place, delivers it (the flag is set before this returns) and
  // the first step honours it. Threads started before this keep it blocked;
  // this one takes the signal.
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  pthread_sigmask(SIG_UNBLOCK, &usr1, nullptr);
}

bool checkpointSignalled() { return gCheckpointSignal.load(); }

void clearCheckpointSignal() { gCheckpointSignal.store(false); }

Precision parsePrecision(const std::string& name) {
  if (name == "fp32") return Precision::kFp32;
  if (name == "bf16") return Precision::kBf16;
  if (name == "fp16") return Precision::kFp16;
  throw ConfigError(strCat("unknown precision '", name, "': use fp32, bf16 or fp16"));
}

std::string toString(Precision precision) {
  switch (precision) {
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
  }
  return "?";
}

void VarunaOptions::applyLaunchArgs(const LaunchArgs& args) {
  rank = args.rank;
  localRank = args.localRank;
  stageToRankMap = args.stageToRankMap.empty() ? StageToRankMap::clustered(1, args.worldSize).toString()
                                               : args.stageToRankMap;
  rendezvous.masterAddr = args.masterAddr;
  rendezvous.masterPort = args.masterPort;
  rendezvous.externalStore = args.externalStore;
  rendezvous.bindAddr = args.hostAddr;
  manager.address = args.managerAddr;
  manager.token = args.jobToken;
  manager.generation = args.generation;
  if (checkpointing.globalStore.empty()) checkpointing.globalStore = args.globalStore;
  if (args.keepCheckpoints >= 0) checkpointing.keepCheckpoints = args.keepCheckpoints;
  manager.host = args.hostAddr;
  manager.agentBeatFd = args.agentBeatFd;
  if (!args.schedule.empty()) launcherSchedule = parseScheduleChoice(args.schedule);
  launcherPieceCosts = args.pieceCosts;
  launcherProfiledPieces = args.profiledPieces;
  launcherBatchSize = args.globalBatchSize();
}


Varuna::Impl::Impl(VarunaOptions options) : opt_(std::move(options)), map_(StageToRankMap::parse(opt_.stageToRankMap)) {
  // The job token is in the options now: out of the environment, where the
  // training program, everything it starts and /proc/<pid>/environ would
  // show it. First, before this runtime starts threads.
  if (!opt_.manager.token.empty()) scrubEnvironmentVariable(contract::kJobTokenEnv);
  ::unsetenv(contract::kJobTokenFdEnv);  // the descriptor is read and closed: not for the program's children
  // A write to a peer that just died (Gloo, the store, the manager link)
  // must fail with EPIPE and become a PeerLostError the salvage handles, not
  // kill this rank with SIGPIPE (a C++ program inherits the default action
  // from its agent; Python ignores it already). Seen in salvage_test.
  ::signal(SIGPIPE, SIG_IGN);
  if (!opt_.launcherPieceCosts.empty()) {
    if (opt_.launcherPieceCosts.size() != opt_.model.pieces.size()) {
      throw ConfigError(strCat("the launcher's piece costs (VARUNA_PIECE_COSTS) name ", opt_.launcherPieceCosts.size(),
                               " pieces but the model has ", opt_.model.pieces.size(),
                               ": the profile run_varuna planned with is of another model"));
    }
    opt_.model.pieceCosts = opt_.launcherPieceCosts;
  }
  validateModelSpec(opt_.model);
  if (!opt_.getBatch) throw ConfigError("VarunaOptions.getBatch is required: it provides sample inputs of a given size");
  if (opt_.onNonFiniteGradients == NonFiniteGradients::kStopTraining && opt_.precision == Precision::kFp16) {
    throw ConfigError("onNonFiniteGradients = kStopTraining (--nonfinite stop) needs fp32 or bf16: fp16 skips the "
                      "steps that overflow to find its loss scale; use kSkipStep (--nonfinite skip) with fp16");
  }
  if (opt_.chunkSize < 1) throw ConfigError(strCat("chunk size (micro-batch size) must be >= 1, got ", opt_.chunkSize));
  P_ = map_.numStages();
  D_ = map_.numReplicas();
  checkBatchSize();
  stage_ = map_.stageOf(opt_.rank);
  replica_ = map_.replicaOf(opt_.rank);
  if (opt_.batchSize % D_ != 0) {
    throw ConfigError(strCat("global batch size ", opt_.batchSize, " is not divisible by the ", D_,
                             " data-parallel replicas of stage_to_rank_map '", map_.toString(), "'"));
  }
  log::setStage(stage_);
  // Before the stage's tensors are allocated; process-wide.
  if (opt_.hostMemory != HostMemory::kFast) log::info(applyHostMemory(opt_.hostMemory));
  resolveSchedule();
  partition_ = partitionPieces(pieceCosts(), layout_.virtualStages());
  if (!opt_.manager.address.empty()) {
    managerLink_ = std::make_unique<ManagerLink>(opt_.manager, opt_.rank, ManagerLinkTimings{}, &waitingOnPeers_);
  }

  CommOptions comm;
  comm.masterAddr = opt_.rendezvous.masterAddr;
  comm.masterPort = opt_.rendezvous.masterPort;
  comm.bindAddr = opt_.rendezvous.bindAddr;
  comm.hostStore = opt_.rank == 0 && !opt_.rendezvous.externalStore;
  comm.rank = opt_.rank;
  comm.worldSize = map_.worldSize();
  comm.device = opt_.device;
  comm.backend = opt_.commBackend;
  comm.timeout = opt_.peerTimeout;
  comm.waitingOnPeers = &waitingOnPeers_;
  comm_ = std::make_unique<Communicator>(comm, map_);

  std::string error;
  try {
    std::vector<PieceRange> chunks;
    for (int c = 0; c < layout_.chunks; ++c) chunks.push_back({partition_.begin(virtualStage(c)), partition_.end(virtualStage(c))});
    model_ = std::make_shared<StageModel>(opt_.model, chunks, opt_.device);
    timeline_.emplace(opt_.traceDir, StepTimeline::Identity{.rank = opt_.rank, .stage = stage_, .replica = replica_,
                                                            .generation = std::max(0, opt_.manager.generation), .layout = layout_});
    error = checkAgainstProfile();
    if (error.empty()) error = checkSharedWeights();
  } catch (const std::exception& e) {
    error = e.what();
  }
  comm_->agreeOnStartup("model", error);
  salvageState_.emplace(model_.get(), replica_ == 0, /*keepBuffers=*/managerLink_ != nullptr);
  if (opt_.rank == 0) {
    std::vector<std::string> names;
    for (const auto& p : opt_.model.pieces) names.push_back(p.name);
    log::info("plan: ", P_, " stages x ", D_, " replicas, schedule ",
              toString(ScheduleChoice{opt_.schedule, layout_.chunks}), ", precision ",
              toString(opt_.precision), ", micro-batch ", opt_.chunkSize, "; ", partition_.describe(names),
              describeChunks(), postsReceivesFirst() ? "; receives posted at each step's start (Gloo by tag)" : "");
  }
  setUpGradients();
  synchroniseTiedWeights();
  guarded([this] { learnCutShapes(); });
  runTag_ = agreeOnRunTag();
  armSalvage();
}

// The schedule and its chunks: the launcher's (AutoConfig) over the
// program's; a chunked schedule cuts the model into stages x chunks virtual
// stages, so it needs that many pieces.
void Varuna::Impl::resolveSchedule() {
  if (opt_.launcherSchedule) {
    opt_.schedule = opt_.launcherSchedule->kind;
    opt_.scheduleChunks = opt_.launcherSchedule->chunks;
  }
  if (opt_.scheduleChunks < 1) opt_.scheduleChunks = defaultChunks(opt_.schedule);
  checkChunks(opt_.schedule, opt_.scheduleChunks);
  layout_ = ChunkLayout::of(opt_.schedule, P_, opt_.scheduleChunks);
  const int pieces = static_cast<int>(opt_.model.pieces.size());
  const std::string name = toString(ScheduleChoice{opt_.schedule, layout_.chunks});
  if (layout_.chunks > 1 && pieces < layout_.virtualStages()) {
    throw ConfigError(strCat("schedule ", name, " on ", P_, " stages needs ", layout_.virtualStages(),
                             " pieces (stages x chunks) but the model has ", pieces,
                             ": add CutPoints, use fewer stages or chunks, or a schedule without chunks"));
  }
  // A micro-batch count the schedule cannot take fails now, before the rendezvous.
  scheduleFor(static_cast<int>((localBatch() + opt_.chunkSize - 1) / opt_.chunkSize));
}

// "; virtual stages per stage: 0: 0,3; 1: 1,2" under a chunked schedule (the
// partition above is into virtual stages), "" otherwise.
std::string Varuna::Impl::describeChunks() const {
  if (layout_.chunks == 1) return "";
  std::string out = "; virtual stages per stage:";
  for (int s = 0; s < P_; ++s) {
    out += strCat(s ? "; " : " ", s, ":");
    for (int c = 0; c < layout_.chunks; ++c) out += strCat(c ? "," : " ", layout_.virtualStage(s, c));
  }
  return out;
}

// One meaning of the batch size: the global batch, whoever gives it (the
// program, or the launcher as its per-replica --batch-size x replicas).
void Varuna::Impl::checkBatchSize() {
  const int64_t launcher = opt_.launcherBatchSize;
  if (opt_.batchSize == 0 && launcher > 0) opt_.batchSize = launcher;
  if (opt_.batchSize < 1) {
    throw ConfigError(strCat("the global batch size is not set (got ", opt_.batchSize, "): give it to Varuna "
                             "(batch_size / VarunaOptions::batchSize), or launch with --batch_size"));
  }
  if (launcher > 0 && opt_.batchSize != launcher) {
    throw ConfigError(strCat("the global batch size is ", opt_.batchSize, " here (batch_size / VarunaOptions::",
                             "batchSize) but ", launcher, " by the launcher (its --batch-size ", launcher / D_,
                             " per replica x ", D_, " replicas): give the same global batch to both, or leave it "
                             "unset here to take the launcher's"));
  }
}

std::vector<double> Varuna::Impl::pieceCosts() const {
  const auto& pieces = opt_.model.pieces;
  if (!opt_.model.pieceCosts.empty()) return opt_.model.pieceCosts;
  std::vector<double> costs;
  for (size_t i = 0; i < pieces.size(); ++i) {
    int64_t count = pieces[i].paramCount;
    if (count < 0) {
      // Unknown size: build the piece alone, count, and free it. Give
      // PieceSpec::paramCount to avoid this.
      auto piece = buildPiece(opt_.model, static_cast<int>(i));
      count = 0;
      for (const auto& p : piece->parameters()) count += p.numel();
    }
    costs.push_back(static_cast<double>(std::max<int64_t>(count, 1)));
  }
  return costs;
}

std::string Varuna::Impl::checkSharedWeights() const {
  const auto& params = model_->namedParams();
  for (const auto& [a, b] : opt_.model.sharedWeights) {
    for (const auto& name : {a, b}) {
      const int piece = pieceOfParameter(opt_.model, name);
      if (model_->ownsPiece(piece) && !params.count(name)) {
        std::string known;
        for (const auto& [n, t] : params) {
          if (n.rfind(opt_.model.pieces[piece].name + ".", 0) == 0) known += (known.empty() ? "" : ", ") + n;
        }
        return strCat("shared weight '", name, "' does not exist; piece '", opt_.model.pieces[piece].name,
                      "' has: ", known);
      }
    }
    const int pa = pieceOfParameter(opt_.model, a), pb = pieceOfParameter(opt_.model, b);
    if (model_->ownsPiece(pa) && model_->ownsPiece(pb) && !params.at(a).sizes().equals(params.at(b).sizes())) {
      return strCat("shared weights '", a, "' ", params.at(a).sizes(), " and '", b, "' ", params.at(b).sizes(),
                    " have different shapes");
    }
  }
  return checkOneTensorUnderTwoNames();
}

// One tensor reached under two names (a Python model whose pieces hold the same
// Parameter, e.g. an embedding tied to its LM head the usual PyTorch way): on
// this stage it is one parameter, but a layout that puts the two pieces on
// different stages gives each its own copy, and only a declared pair keeps the
// copies equal. Undeclared, the job would train differently per layout.
std::string Varuna::Impl::checkOneTensorUnderTwoNames() const {
  std::set<std::pair<std::string, std::string>> declared;
  for (const auto& [a, b] : opt_.model.sharedWeights) {
    declared.insert({a, b});
    declared.insert({b, a});
  }
  std::map<const void*, std::string> firstName;
  for (const auto& [name, tensor] : model_->namedParams()) {
    auto [it, inserted] = firstName.emplace(tensor.unsafeGetTensorImpl(), name);
    if (!inserted && !declared.count({it->second, name})) {
      return strCat("parameters '", it->second, "' and '", name, "' are one tensor (two pieces hold the same "
                    "Parameter): declare the pair in shared_weights so that it stays one weight when the pieces "
                    "land on different stages, or give each piece its own");
    }
  }
  return "";
}

// The launcher planned with a profile (run_varuna --profile): every rank
// checks the piece names, and the parameter counts of its own pieces, so that
// between them the ranks check the whole model.
std::string Varuna::Impl::checkAgainstProfile() const {
  const auto& profiled = opt_.launcherProfiledPieces;
  if (profiled.empty()) return "";
  const std::string fix = "the model changed since it was profiled: profile it again and restart run_varuna";
  if (profiled.size() != opt_.model.pieces.size()) {
    return strCat("the profile run_varuna planned with has ", profiled.size(), " pieces but the model has ",
                  opt_.model.pieces.size(), "; ", fix);
  }
  for (size_t i = 0; i < profiled.size(); ++i) {
    if (profiled[i].first != opt_.model.pieces[i].name) {
      return strCat("piece ", i, " of the profile run_varuna planned with is '", profiled[i].first,
                    "' but the model's is '", opt_.model.pieces[i].name, "'; ", fix);
    }
  }
  for (int k = 0; k < model_->numPieces(); ++k) {
    const int global = model_->globalPiece(k);
    int64_t params = 0;
    for (const auto& p : model_->pieceParams(k)) params += p.numel();
    if (params != profiled[global].second) {
      return strCat("piece '", profiled[global].first, "' has ", params, " parameters but ", profiled[global].second,
                    " in the profile run_varuna planned with; ", fix);
    }
  }
  return "";
}

void Varuna::Impl::setUpGradients() {
  // Classify tied parameters: a same-stage duplicate shares its twin's
  // gradient storage; a cross-stage one is reduced over both stages instead of
  // the data-parallel group. Neither goes into the data-parallel buckets.
  std::set<const void*> notDataParallel;
  // A chunked rank holds several virtual stages: stages, here, are ranks'.
  auto stageOfPiece = [&](int piece) { return layout_.stageOf(partition_.stageOfPiece(piece)); };
  for (const auto& [a, b] : opt_.model.sharedWeights) {
    const int sa = stageOfPiece(pieceOfParameter(opt_.model, a));
    const int sb = stageOfPiece(pieceOfParameter(opt_.model, b));
    if (sa == sb) {
      const auto& params = model_->namedParams();
      if (sa == stage_ && !params.at(a).is_same(params.at(b))) {  // one tensor already: nothing to tie
        localTies_.push_back({a, b});
        notDataParallel.insert(model_->namedParams().at(b).unsafeGetTensorImpl());
      }
      continue;
    }
    if (sa != stage_ && sb != stage_) continue;
    const int lo = std::min(sa, sb), hi = std::max(sa, sb);
    CrossStageTie tie;
    tie.localName = sa == stage_ ? a : b;
    tie.primary = sa == stage_;
    tie.groupName = strCat("tie", lo, "_", hi);
    for (int s : {lo, hi}) {
      for (int r : map_.ranksOfStage(s)) tie.groupRanks.push_back(r);
    }
    std::sort(tie.groupRanks.begin(), tie.groupRanks.end());
    tie.rootRank = map_.rankOf(sa, 0);
    notDataParallel.insert(model_->namedParams().at(tie.localName).unsafeGetTensorImpl());
    crossTies_.push_back(tie);
  }
  // Groups are created in one global order (data-parallel, then ties sorted by
  // name) so that no two ranks wait on each other's creation. The sort is
  // stable: within a group, pairs keep their declaration order, which is the
  // order of their gradients in the group's bucket on both stages.
  c10::intrusive_ptr<c10d::Backend> dp;
  if (D_ > 1) dp = comm_->group(strCat("dp", stage_), map_.ranksOfStage(stage_));
  std::stable_sort(crossTies_.begin(), crossTies_.end(),
                   [](const CrossStageTie& x, const CrossStageTie& y) { return x.groupName < y.groupName; });

  // Data-parallel buckets: pieces last-first, as the backward finalises them
  // (local pieces finish in descending order, chunks included). A gradient
  // is complete once the lowest local piece that adds to it is done: a
  // tensor two pieces hold (a declared same-tensor pair) goes in once, with
  // the first of them, and a same-stage tied pair's twin adds into it too,
  // whichever of the two was declared first (zbv puts an embedding and its
  // head on one stage).
  std::map<const void*, int> finalPiece;
  for (int k = model_->numPieces() - 1; k >= 0; --k) {
    for (const auto& p : model_->pieceParams(k)) finalPiece[p.unsafeGetTensorImpl()] = k;
  }
  for (const auto& [a, b] : localTies_) {
    int& piece = finalPiece.at(model_->namedParams().at(a).unsafeGetTensorImpl());
    piece = std::min(piece, model_->localPieceOf(b));
  }
  std::vector<BucketedParam> ordered;
  std::set<const void*> bucketed;
  for (int k = model_->numPieces() - 1; k >= 0; --k) {
    auto params = model_->pieceParams(k);
    for (auto it = params.rbegin(); it != params.rend(); ++it) {
      const void* impl = it->unsafeGetTensorImpl();
      if (notDataParallel.count(impl) || !bucketed.insert(impl).second) continue;
      ordered.push_back({*it, finalPiece.at(impl), true});
    }
  }
  buckets_.add(ordered, dp, opt_.bucketBytes);
  // One bucket per tie group, reduced over both stages' replicas at once. Each
  // tied weight counts in the gradient norm on its first name's stage only.
  for (size_t i = 0; i < crossTies_.size();) {
    const CrossStageTie& first = crossTies_[i];
    std::vector<BucketedParam> params;
    for (; i < crossTies_.size() && crossTies_[i].groupName == first.groupName; ++i) {
      const auto& tie = crossTies_[i];
      params.push_back({model_->namedParams().at(tie.localName), model_->localPieceOf(tie.localName), tie.primary});
    }
    buckets_.add(params, comm_->group(first.groupName, first.groupRanks), opt_.bucketBytes);
  }
  // A tied duplicate on the same stage accumulates into its twin's storage.
  for (const auto& [a, b] : localTies_) {
    model_->namedParams().at(b).mutable_grad() = model_->namedParams().at(a).grad();
  }
}

void Varuna::Impl::synchroniseTiedWeights() {
  torch::NoGradGuard noGrad;
  for (const auto& [a, b] : localTies_) model_->namedParams().at(b).copy_(model_->namedParams().at(a));
  for (const auto& tie : crossTies_) {
    auto tensor = model_->namedParams().at(tie.localName).detach();
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions bopts;
    bopts.rootRank = static_cast<int64_t>(
        std::find(tie.groupRanks.begin(), tie.groupRanks.end(), tie.rootRank) - tie.groupRanks.begin());
    comm_->waitFor(comm_->group(tie.groupName, tie.groupRanks)->broadcast(tensors, bopts),
                   "broadcasting tied weights");
  }
}

void Varuna::Impl::setOptimizer(std::shared_ptr<StageOptimizer> optimizer, LossScaleOptions lossScale) {
  if (!optimizer) throw ConfigError("setOptimizer: the optimizer is null");
  optimizer_ = std::move(optimizer);
  optimizerSet_ = true;
  if (opt_.precision != Precision::kFp16) lossScale = LossScaleOptions{.dynamic = false, .initialScale = 1.0};
  scaler_ = LossScaler(lossScale);
}

// ---------------------------------------------------------------------------

void Varuna::Impl::reportStep(const StepResult& result, double seconds) {
  if (!managerLink_) return;
  managerLink_->reportStep(proto::StepReport{opt_.rank, stage_, replica_, stepsDone_, result.loss, seconds,
                                             result.computeSecondsPerMicrobatch});
}

void Varuna::Impl::finishedCleanly() {
  if (comm_) comm_->finishedCleanly();
}

void Varuna::Impl::abandon() {
  if (comm_) comm_->abandon();
}

// ---------------------------------------------------------------------------

Varuna::Varuna(VarunaOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Varuna::~Varuna() {
  if (std::uncaught_exceptions() == 0) impl_->finishedCleanly();
}

void Varuna::abandon() { impl_->abandon(); }

std::vector<torch::Tensor> Varuna::parameters() const {
  // Each tensor once: the optimizer must not step a tied weight twice.
  std::vector<torch::Tensor> out;
  std::set<const void*> seen;
  for (const auto& p : impl_->model().parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> Varuna::namedParameters() const {
  return {impl_->model().namedParams().begin(), impl_->model().namedParams().end()};
}

std::vector<std::pair<std::string, torch::Tensor>> Varuna::namedBuffers() const {
  return {impl_->model().namedBuffers().begin(), impl_->model().namedBuffers().end()};
}

void Varuna::setOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer, LossScaleOptions lossScale) {
  impl_->setOptimizer(wrapTorchOptimizer(std::move(optimizer)), lossScale);
}

void Varuna::setOptimizer(std::shared_ptr<StageOptimizer> optimizer, LossScaleOptions lossScale) {
  impl_->setOptimizer(std::move(optimizer), lossScale);
}

StepResult Varuna::step(const Batch& inputs, std::optional<double> clipGradMaxNorm) {
  const auto start = std::chrono::steady_clock::now();
  StepResult result;
  try {
    result = impl_->guarded([&] { return impl_->step(inputs, clipGradMaxNorm); });
  } catch (const PeerLostError& lost) {
    if (impl_->salvageOn()) impl_->salvage(lost);
    throw;
  }
  impl_->reportStep(result, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return result;
}

double Varuna::evaluate(const Batch& inputs) {
  try {
    return impl_->guarded([&] { return impl_->evaluate(inputs); });
  } catch (const PeerLostError& lost) {
    if (impl_->salvageOn()) impl_->salvage(lost);
    throw;
  }
}

int64_t Varuna::stepsDone() const { return impl_->stepsDone(); }
int64_t Varuna::samplesSeen() const { return impl_->stepsDone() * impl_->options().batchSize; }

int Varuna::rank() const { return impl_->options().rank; }
int Varuna::stage() const { return impl_->stage(); }
int Varuna::replica() const { return impl_->replica(); }
int Varuna::numStages() const { return impl_->numStages(); }
int Varuna::numChunks() const { return impl_->numChunks(); }
bool Varuna::isLastStage() const { return impl_->holdsLoss(); }
std::vector<std::pair<int, int>> Varuna::ownedPieces() const {
  std::vector<std::pair<int, int>> ranges;
  for (int c = 0; c < impl_->numChunks(); ++c) {
    const int vs = impl_->layout().virtualStage(impl_->stage(), c);
    ranges.emplace_back(impl_->partition().begin(vs), impl_->partition().end(vs));
  }
  return ranges;
}
int Varuna::numReplicas() const { return impl_->numReplicas(); }
const Partition& Varuna::partition() const { return impl_->partition(); }
const StageToRankMap& Varuna::stageToRankMap() const { return impl_->map(); }
torch::Device Varuna::device() const { return impl_->options().device; }
const LossScaler& Varuna::lossScaler() const { return impl_->scaler(); }

void exitWorker(int code) {
  log::flush();
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

void exitAfterFailure(const std::exception& error) {
  const auto* known = dynamic_cast<const Error*>(&error);
  log::error(error.what());
  log::flush();
  std::fflush(stdout);
  std::fflush(stderr);
  // _Exit: c10d's threads may still be blocked on dead peers; destructors
  // would wait for them.
  std::_Exit(known ? known->exitCode() : 1);
}

}  // namespace varuna
