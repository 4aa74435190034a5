// Varuna's checkpoints: what each rank writes (its pieces' parameters,
// buffers and optimizer state, its generators, and on rank 0 meta.json), and
// how a checkpoint is read back, checked against this model and applied. The
// file layout and completion protocol are in varuna/common/checkpoint_files.h
// and checkpoint_writer.h; docs/checkpoints.md describes both.
//
// Files are per piece and optimizer state is keyed by parameter name, so a
// checkpoint loads under any partition, and loading agrees across the ranks
// which checkpoint to take, falling back past damaged ones together.
#include <torch/autograd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <random>
#include <thread>

#include "comm/blocked_on_peers.h"
#include "pipeline/varuna_impl.h"
#include "varuna/common/checkpoint_files.h"
#include "varuna/common/errors.h"
#include "varuna/common/log.h"

namespace varuna {

// --- writing ------------------------------------------------------------------

NamedTensors Varuna::Impl::pieceParams(int local) const {
  NamedTensors out;
  for (const auto& [name, t] : model_->namedParams()) {
    if (model_->localPieceOf(name) == local) out.push_back({name, t});
  }
  return out;
}

NamedTensors Varuna::Impl::pieceState(int local, bool copyChangingBuffers) const {
  NamedTensors out = pieceParams(local);
  const auto& changing = model_->changingBuffers();
  for (auto& [name, tensor] : model_->piecePersistentBuffers(local)) {
    const bool copy = copyChangingBuffers && std::find(changing.begin(), changing.end(), name) != changing.end();
    out.push_back({name, copy ? tensor.detach().clone() : tensor});
  }
  return out;
}

std::string Varuna::Impl::pieceFile(int local, const char* kind) const {
  const int global = model_->globalPiece(local);
  return strCat("piece_", global, "_", opt_.model.pieces[global].name, ".", kind, ".pt");
}

nlohmann::json Varuna::Impl::checkpointMeta(int64_t step) {
  nlohmann::json pieces = nlohmann::json::array();
  for (const auto& p : opt_.model.pieces) pieces.push_back(p.name);
  return {{"format", 2},  // 2: piece files hold persistent buffers too
          {"step", step},
          {"samples_seen", step * opt_.batchSize},
          {"global_batch", opt_.batchSize},
          {"pieces", pieces},
          {"model_seed", opt_.model.seed},
          {"stage_to_rank_map", map_.toString()},
          {"generation", opt_.manager.generation},
          {"precision", toString(opt_.precision)},
          {"loss_scale", {{"scale", scaler_.scale()}, {"clean_steps", scaler_.cleanSteps()}}},
          {"optimizer", optimizer_->settings()}};
}

// Under run_varuna the generation names the run. Without it, rank 0 draws a
// random tag and shares it through the rendezvous store, so two runs of one
// world size that reach the same step never combine their parts.
std::string Varuna::Impl::agreeOnRunTag() {
  if (opt_.manager.generation >= 0) return ckpt::runTag(opt_.manager.generation, "");
  const std::string key = "varuna/checkpoint_run_tag";
  std::string tag;
  if (opt_.rank == 0) {
    std::random_device random;
    tag = strCat(std::hex, random(), random());
    comm_->store()->set(key, std::vector<uint8_t>(tag.begin(), tag.end()));
  } else {
    BlockedOnPeers blocked(&waitingOnPeers_);  // until rank 0 has drawn it
    const auto bytes = comm_->store()->get(key);
    tag.assign(bytes.begin(), bytes.end());
  }
  return ckpt::runTag(-1, tag);
}

ckpt::WriterIdentity Varuna::Impl::writerIdentity() const {
  return {opt_.manager.generation, runTag_, opt_.rank, map_.worldSize()};
}

void Varuna::Impl::reportCheckpointFailure(int64_t step, const std::string& error) {
  log::error("checkpoint of step ", step, " failed (training goes on; the next checkpoint tries again): ", error);
  if (managerLink_) managerLink_->reportCheckpointFailure(step, error);
}

void Varuna::Impl::waitUntilIntact(const std::filesystem::path& dir, std::chrono::milliseconds timeout,
                                   const char* what, bool stopIfInterrupted) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  BlockedOnPeers blocked(&waitingOnPeers_);
  while (!ckpt::isIntact(dir)) {
    if (stopIfInterrupted && comm_->interrupted()) throw comm_->interruption(strCat("waiting for the ", what, " to complete"));
    if (std::chrono::steady_clock::now() > deadline) {
      throw ckpt::CheckpointError(strCat(what, " '", dir.string(), "' did not complete within ", timeout.count(),
                                         " ms: another writer's part is missing"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool Varuna::Impl::checkpoint(const CheckpointRequest& request) {
  const std::string& globalStore = request.globalStore;
  const bool onDemand = request.onDemand;
  if (!optimizer_) throw ConfigError("call setOptimizer() before checkpoint()");
  if (globalStore.empty()) throw ConfigError("checkpoint(): global_store is empty");
  if (!writer_) {
    CheckpointWriterOptions options;
    options.writer = writerIdentity();
    options.keepCheckpoints = opt_.checkpointing.keepCheckpoints;
    options.onFailure = [this](int64_t step, const std::string& error) { reportCheckpointFailure(step, error); };
    writer_ = std::make_unique<CheckpointWriter>(std::move(options));
  }
  const int64_t step = request.step.value_or(stepsDone_);
  if (onDemand) writer_->drain();  // earlier checkpoints land first
  // A superseded generation never writes: its successor may be loading.
  ckpt::checkNotSuperseded(globalStore, opt_.manager.generation);
  const auto dir = ckpt::checkpointDir(globalStore, step);
  if (ckpt::isIntact(dir)) {
    // Never rewrite a complete checkpoint (e.g. resuming at the final step):
    // a reader could see new files under the old marker.
    log::info("checkpoint of step ", step, " already complete in ", globalStore);
    return true;
  }
  const bool background = !request.tempdir.empty() && !onDemand;

  // Jobs hold the live tensors. A background job snapshots them on the writer
  // thread while training computes; step() waits for that snapshot before the
  // optimizer changes them.
  CheckpointParts parts;
  // Sharding spreads a stage's pieces over its replicas.
  parts.writesPiece = [&](int k) { return (request.shard ? k % D_ : 0) == replica_; };
  // A background job snapshots later, but the next step's forward changes
  // running statistics before it waits for that: copy those now (small).
  parts.copyChangingBuffers = background;
  parts.rng = true;
  if (opt_.rank == 0) parts.meta = checkpointMeta(step);
  CheckpointJob job = composeCheckpoint(globalStore, step, parts);
  job.tempdir = background ? request.tempdir : "";
  if (background) {
    writer_->enqueue(std::move(job));
    return true;
  }
  try {
    writer_->run(job);
  } catch (const ckpt::SupersededError&) {
    throw;
  } catch (const ckpt::CheckpointError& e) {
    if (onDemand) throw;
    reportCheckpointFailure(step, e.what());
    return false;
  }
  if (onDemand) {
    // Exit code kExitCheckpointed promises a complete checkpoint: wait for
    // the other ranks' parts (the last one to land completes it). A peer lost
    // meanwhile means run_varuna salvages instead (its order).
    waitUntilIntact(dir, opt_.peerTimeout, "on-demand checkpoint", /*stopIfInterrupted=*/true);
    log::info("on-demand checkpoint ", dir.string(), " complete");
  }
  return true;
}

CheckpointJob Varuna::Impl::composeCheckpoint(const std::string& globalStore, int64_t step,
                                              const CheckpointParts& parts) const {
  CheckpointJob job;
  job.globalStore = globalStore;
  job.step = step;
  for (int k = 0; k < model_->numPieces(); ++k) {
    if (parts.writesPiece && !parts.writesPiece(k)) continue;
    job.files.push_back({pieceFile(k, "params"), pieceState(k, parts.copyChangingBuffers), std::nullopt});
    job.files.push_back({pieceFile(k, "optim"), optimizer_->state(pieceParams(k)), std::nullopt});
  }
  if (parts.rng) job.files.push_back({strCat("rank_", opt_.rank, ".rng.pt"), generatorStates(opt_.device), std::nullopt});
  if (parts.meta) job.files.push_back({ckpt::kMeta, {}, parts.meta->dump(1)});
  return job;
}

// --- loading ------------------------------------------------------------------

// Everything a load changes, read, verified and matched against the model
// first: applying it cannot fail half-way.
struct Varuna::Impl::LoadedCheckpoint {
  nlohmann::json meta;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;  // live tensor <- saved value
  std::vector<std::function<void()>> optimizer;  // each applies one piece's decoded state
  std::optional<std::map<std::string, torch::Tensor>> generators;
};

Varuna::Impl::LoadedCheckpoint Varuna::Impl::readCheckpoint(const std::string& globalStore, int64_t iteration,
                                                            bool checkComplete) {
  const auto dir = ckpt::checkpointDir(globalStore, iteration);
  std::vector<ckpt::FileEntry> manifest;
  if (checkComplete) {
    ckpt::verify(dir, {}, /*checksums=*/false);  // marker, and every file's size
    manifest = ckpt::readManifest(dir);
  }
  auto read = [&](const std::string& name) {
    return checkComplete ? ckpt::readVerified(dir, manifest, name) : ckpt::readFile(dir / name);
  };
  LoadedCheckpoint loaded;
  try {
    loaded.meta = nlohmann::json::parse(read(ckpt::kMeta));
    (void)loaded.meta.at("step").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw ckpt::DamagedError(strCat("checkpoint '", dir.string(), "': meta.json is unreadable: ", e.what()));
  }
  const auto& meta = loaded.meta;
  std::vector<std::string> names;
  for (const auto& p : opt_.model.pieces) names.push_back(p.name);
  if (meta.value("pieces", nlohmann::json()) != nlohmann::json(names)) {
    throw ConfigError(strCat("checkpoint '", dir.string(), "' was written by a different model: pieces ",
                             meta.value("pieces", nlohmann::json()).dump(), " vs this model's ",
                             nlohmann::json(names).dump()));
  }
  if (meta.value("global_batch", opt_.batchSize) != opt_.batchSize) {
    log::warn("checkpoint global batch ", meta.value("global_batch", opt_.batchSize), " differs from this job's ",
              opt_.batchSize, ": the data position is kept in samples");
  }
  optimizer_->checkSettings(meta.value("optimizer", nlohmann::json()));
  const bool withBuffers = meta.value("format", 1) >= 2;
  for (int k = 0; k < model_->numPieces(); ++k) {
    const std::string paramsName = pieceFile(k, "params");
    const auto saved = unpickleTensors(read(paramsName), (dir / paramsName).string());
    const NamedTensors expected = withBuffers ? pieceState(k) : pieceParams(k);
    for (const auto& [name, tensor] : expected) {
      auto it = saved.find(name);
      if (it == saved.end() || !it->second.sizes().equals(tensor.sizes())) {
        throw ConfigError(strCat("checkpoint '", dir.string(), "': '", paramsName, "' ",
                                 it == saved.end() ? "has no tensor '" + name + "'"
                                                   : "has a different shape for '" + name + "'",
                                 ": it was written by a different model"));
      }
      loaded.copies.emplace_back(tensor, it->second);
    }
    if (saved.size() != expected.size()) {
      throw ConfigError(strCat("checkpoint '", dir.string(), "': '", paramsName, "' has ", saved.size(),
                               " tensors, this model's piece has ", expected.size(), " parameters and buffers"));
    }
    const std::string optimName = pieceFile(k, "optim");
    loaded.optimizer.push_back(optimizer_->decodeState(
        pieceParams(k), unpickleTensors(read(optimName), (dir / optimName).string()), (dir / optimName).string()));
  }
  if (!withBuffers && !model_->namedBuffers().empty()) {
    log::warn("checkpoint '", dir.string(), "' predates buffers in checkpoints: buffers keep their initial values");
  }
  if (meta.value("stage_to_rank_map", "") == map_.toString()) {
    const std::string rngName = strCat("rank_", opt_.rank, ".rng.pt");
    loaded.generators = unpickleTensors(read(rngName), (dir / rngName).string());
  }
  return loaded;
}

void Varuna::Impl::applyCheckpoint(LoadedCheckpoint loaded, int64_t iteration) {
  torch::NoGradGuard noGrad;
  // variable_data(): a load is not an in-place step autograd should see.
  for (auto& [live, saved] : loaded.copies) live.variable_data().copy_(saved);
  for (auto& apply : loaded.optimizer) apply();
  const auto& meta = loaded.meta;
  optimizer_->applySettings(meta.at("optimizer"));
  const auto& scale = meta.at("loss_scale");
  if (opt_.precision == Precision::kFp16) scaler_.restore(scale.at("scale"), scale.at("clean_steps"));
  if (loaded.generators) {
    restoreGeneratorStates(opt_.device, *loaded.generators);
  } else {
    // Another layout: no rank's stream maps onto ours; start a fresh one that
    // still depends only on (seed, step, rank).
    torch::manual_seed(opt_.model.seed * 1000003ULL + static_cast<uint64_t>(iteration) * 7919ULL +
                       static_cast<uint64_t>(opt_.rank));
  }
  stepsDone_ = meta.at("step").get<int64_t>();
  salvageState_->trajectoryChanged();
  if (opt_.rank == 0) log::info("resumed from the checkpoint of step ", iteration);
}

int64_t Varuna::Impl::loadCheckpoint(const std::string& globalStore, int64_t iteration, bool checkComplete) {
  if (!optimizer_) throw ConfigError("call setOptimizer() before loadCheckpoint(): its state is restored too");
  if (writer_) writer_->drain();
  applyCheckpoint(readCheckpoint(globalStore, iteration, checkComplete), iteration);
  return stepsDone_;
}

int64_t Varuna::Impl::allReduceMax(int64_t value, const char* during) {
  if (map_.worldSize() == 1) return value;
  auto t = torch::tensor({value}, torch::TensorOptions().dtype(torch::kLong)).to(opt_.device);
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  comm_->waitFor(comm_->world()->allreduce(tensors, options), during);
  return tensors[0].cpu().item<int64_t>();
}

std::optional<int64_t> Varuna::Impl::loadLatestCheckpoint(const std::string& globalStore,
                                                          std::optional<int64_t> atMost) {
  if (!optimizer_) throw ConfigError("call setOptimizer() before loadLatestCheckpoint(): its state is restored too");
  if (writer_) writer_->drain();
  // Verdicts of one attempt, agreed as their maximum over the ranks.
  enum Verdict : int64_t { kLoaded = 0, kDamaged = 1, kUnreadable = 2, kRefused = 3 };
  int64_t bound = atMost.value_or(std::numeric_limits<int64_t>::max());
  while (true) {
    // The newest candidate every rank can see: ranks may list a checkpoint
    // completed a moment ago differently, so they agree on the oldest view.
    std::optional<int64_t> mine;
    for (int64_t step : ckpt::completeCheckpoints(globalStore)) {
      if (step <= bound) {
        mine = step;
        break;
      }
    }
    const int64_t candidate = -allReduceMax(mine ? -*mine : 1, "agreeing on the checkpoint to load");
    if (candidate < 0) return std::nullopt;
    std::optional<LoadedCheckpoint> loaded;
    Verdict verdict = kLoaded;
    std::string why;
    try {
      loaded = readCheckpoint(globalStore, candidate, /*checkComplete=*/true);
    } catch (const ckpt::DamagedError& e) {
      verdict = kDamaged;
      why = e.what();
      ckpt::markDamaged(ckpt::checkpointDir(globalStore, candidate), why);
    } catch (const ckpt::CheckpointError& e) {
      verdict = kUnreadable;
      why = e.what();
    } catch (const ConfigError& e) {
      verdict = kRefused;
      why = e.what();
    }
    const int64_t agreed = allReduceMax(verdict, "agreeing whether the checkpoint loads");
    if (agreed == kLoaded) {
      applyCheckpoint(std::move(*loaded), candidate);
      return candidate;
    }
    if (agreed == kRefused) {
      if (verdict == kRefused) throw ConfigError(why);
      throw ConfigError(strCat("checkpoint ", candidate, " is of another model or optimizer (see the log of the ",
                               "rank that refused it)"));
    }
    if (!why.empty()) log::error("cannot load checkpoint ", candidate, ", falling back to an older one: ", why);
    bound = candidate - 1;
  }
}

// --- Varuna's checkpoint methods ---------------------------------------------

bool Varuna::checkpoint(const CheckpointRequest& request) {
  return impl_->guarded([&] { return impl_->checkpoint(request); });
}

bool Varuna::checkpoint(const std::string& globalStore, std::optional<int64_t> step) {
  return checkpoint(CheckpointRequest{globalStore, step});
}

bool Varuna::checkpoint(std::optional<int64_t> step) {
  const auto& c = impl_->options().checkpointing;
  if (c.globalStore.empty()) {
    throw ConfigError("checkpoint(): VarunaOptions::checkpointing.globalStore is empty (or pass the store)");
  }
  return checkpoint(CheckpointRequest{c.globalStore, step, c.tempdir, c.shard});
}

void Varuna::exitIfCheckpointRequested(const StepResult& result) {
  if (!result.checkpointRequested) return;
  const auto& c = impl_->options().checkpointing;
  if (c.globalStore.empty()) {
    // Exit 75 promises a checkpoint; with nowhere to write one, exiting would
    // only throw the job's progress away.
    if (impl_->options().rank == 0) {
      log::error("checkpoint requested (SIGUSR1) but no checkpoint store is configured (global_store, or "
                 "run_varuna's VARUNA_GLOBAL_STORE): training goes on without one");
    }
    return;
  }
  const int64_t step = impl_->stepsDone();
  try {
    checkpoint(CheckpointRequest{c.globalStore, step, c.tempdir, c.shard, /*onDemand=*/true});
  } catch (const PeerLostError& lost) {
    // The notice was too short: a host went before every part landed.
    if (impl_->salvageOn()) impl_->salvage(lost);
    throw;
  }
  if (impl_->options().rank == 0) log::info("checkpointed step ", step, " on demand; exiting with ", kExitCheckpointed);
  exitWorker(kExitCheckpointed);
}

int64_t Varuna::loadCheckpoint(const std::string& globalStore, int64_t iteration, bool checkComplete) {
  return impl_->guarded([&] { return impl_->loadCheckpoint(globalStore, iteration, checkComplete); });
}

std::optional<int64_t> Varuna::loadLatestCheckpoint(const std::string& globalStore, std::optional<int64_t> atMost) {
  return impl_->guarded([&] { return impl_->loadLatestCheckpoint(globalStore, atMost); });
}

void Varuna::Impl::drainCheckpoints() {
  if (writer_) writer_->drain();
}

void Varuna::waitForCheckpoints() { impl_->drainCheckpoints(); }

}  // namespace varuna
