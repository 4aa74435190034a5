// Salvage (docs/salvage.md): when a peer is lost without notice, the
// survivors still hold the state of the last step they finished. Each one
// reports that step to run_varuna and waits; the manager picks a step that
// some survivor of every stage holds and orders one survivor per stage to
// write its stage's share of that step's checkpoint, a normal, fenced and
// complete checkpoint the next generation resumes from.
//
// Which step a rank holds: a step counts once the rank has finished the
// step's job-wide exchange (the all-reduce of loss and gradient norm), after
// which it applies the update without waiting on anyone. A rank whose
// exchange failed has done everything else of the step and reports it as
// finishable. Until it applies that step, its parameters, optimizer state
// and loss scale are still those of the step before; only the running
// statistics a forward changed (BatchNorm) moved, and they are put back from
// the copy step() takes when it starts. To finish the step it needs the
// exchange's result from a rank that completed the exchange: run_varuna
// relays that result in the write order and the rank applies the step. After
// the update only replica 0's buffers are sure (the others wait for its
// broadcast): a rank of another replica that loses a peer there holds no
// whole step (-1), but still reports the exchange result it finished, with
// that step's number, for a rank that can finish the step. The rank's own
// generators are not kept: a salvaged checkpoint has no layout
// (stage_to_rank_map), so the next generation seeds fresh streams, as after
// any morph to another layout.
#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>

#include "comm/blocked_on_peers.h"
#include "varuna/common/log.h"
#include "pipeline/varuna_impl.h"

namespace varuna {

Varuna::Impl::~Impl() {
  // The link thread calls the handler, which reaches comm_: unhook it first.
  if (managerLink_) managerLink_->setSalvageStopHandler(nullptr);
}

// Whether this worker can write a salvaged share at all. Not over NCCL yet:
// a NCCL wait cannot be interrupted (its future completes when the work is
// queued), so such a worker leaves instead of keeping the manager waiting.
// Gloo's waits can, on CUDA tensors too.
bool Varuna::Impl::salvageCapable() const {
  return comm_ && comm_->backend() == CommBackend::kGloo && !opt_.checkpointing.globalStore.empty() &&
         optimizerSet_.load();
}

bool Varuna::Impl::salvageOn() const {
  return managerLink_ && comm_ && salvageCapable() && managerLink_->salvageTimeout().count() > 0;
}

void Varuna::Impl::armSalvage() {
  if (!managerLink_) return;
  managerLink_->setSalvageStopHandler([this](const std::string& reason) {
    if (!salvageCapable()) {
      log::error("run_varuna stopped the generation for a salvage (", reason, "), which this worker cannot take ",
                 "part in (", comm_ && comm_->backend() == CommBackend::kNccl ? "NCCL" : "no checkpoint store or no optimizer",
                 "); exiting with ", kExitPeerLost);
      exitWorker(kExitPeerLost);
    }
    comm_->interrupt("run_varuna stopped the generation for a salvage: " + reason);
  });
}

void Varuna::Impl::finishStep(const StepExchange& exchange) {
  salvageState_->restoreExchangingBuffers();
  const auto result = applyStep(exchange, salvageState_->pendingUpdate());
  log::info("finished step ", stepsDone_, " from the exchange result run_varuna relayed (loss ", result.loss,
            result.overflow ? ", overflow: update skipped" : "", ")");
}

void Varuna::Impl::salvage(const PeerLostError& lost) {
  comm_->interrupt("this rank is salvaging");  // no wait on a peer from here on
  const SalvageState::Held held = salvageState_->held(stepsDone_);
  const int64_t step = held.step;
  const auto timeout = 2 * managerLink_->salvageTimeout();  // the manager's two rounds
  log::warn("rank ", opt_.rank, " lost a peer (", lost.what(), "); salvage: it holds ",
            step >= 0 ? strCat("step ", step) : std::string("no whole step"),
            held.finishableStep >= 0 ? strCat(" and can finish step ", held.finishableStep) : std::string(),
            ", waiting up to ", timeout.count() / 1000.0, " s for run_varuna's order");
  managerLink_->reportSalvageReady(proto::SalvageReady{opt_.rank, stage_, replica_, step, opt_.manager.generation,
                                                       held.finishableStep,
                                                       held.exchange ? held.exchange->toWire() : std::vector<double>(),
                                                       held.exchangeStep});
  std::optional<proto::SalvageWrite> order;
  {
    BlockedOnPeers blocked(&waitingOnPeers_);  // waiting, not hung
    order = managerLink_->awaitSalvageWrite(timeout);
  }
  if (!order) {
    log::error("no salvage order from run_varuna within ", timeout.count() / 1000.0, " s; exiting with ", kExitPeerLost);
    exitWorker(kExitPeerLost);
  }
  const auto relayed = StepExchange::fromWire(order->exchange);
  const bool finish = order->step != step && order->step == held.finishableStep && relayed.has_value();
  if (order->step != step && !finish) {
    log::error("run_varuna ordered step ", order->step, " written but this rank holds ", step,
               held.finishableStep >= 0 ? strCat(" (and can finish ", held.finishableStep, " given its exchange)")
                                        : std::string(),
               "; exiting with ", kExitPeerLost);
    exitWorker(kExitPeerLost);
  }
  if (finish) {
    try {
      finishStep(*relayed);
    } catch (const std::exception& e) {
      log::error("finishing step ", order->step, " from the relayed exchange failed: ", e.what(), "; exiting with ",
                 kExitPeerLost);
      exitWorker(kExitPeerLost);
    }
  }
  try {
    writeSalvageShare(*order);
  } catch (const ckpt::SupersededError& e) {
    log::error(e.what());
    exitWorker(kExitSuperseded);
  } catch (const std::exception& e) {
    log::error("writing the salvaged checkpoint of step ", order->step, " failed: ", e.what());
    exitWorker(kExitStorageError);
  }
  log::info("wrote stage ", stage_, "'s share of the salvaged step ", order->step, "; exiting with ", kExitSalvaged);
  exitWorker(kExitSalvaged);
}

void Varuna::Impl::writeSalvageShare(const proto::SalvageWrite& order) {
  const auto& store = opt_.checkpointing.globalStore;
  // A periodic checkpoint still being written lands (or fails) first: its
  // completion and retention must not race with this one's.
  if (writer_) writer_->drain();
  ckpt::checkNotSuperseded(store, opt_.manager.generation);
  const auto dir = ckpt::checkpointDir(store, order.step);
  if (ckpt::isIntact(dir)) return;  // e.g. a periodic checkpoint of that step
  CheckpointParts parts;  // every piece of the stage; no generator states (see the top of this file)
  if (order.writerIndex == 0) {
    parts.meta = checkpointMeta(order.step);
    (*parts.meta)["stage_to_rank_map"] = "";  // no rank's generators are kept
    (*parts.meta)["salvaged"] = {{"generation", opt_.manager.generation}, {"writers", order.writers}};
  }
  const CheckpointJob job = composeCheckpoint(store, order.step, parts);
  CheckpointWriterOptions options;
  // Its own run: the writers' parts never combine with a periodic
  // checkpoint's parts of the same generation.
  options.writer = {opt_.manager.generation, ckpt::runTag(opt_.manager.generation, "") + "s", order.writerIndex,
                    order.writers};
  options.keepCheckpoints = opt_.checkpointing.keepCheckpoints;
  options.onFailure = [](int64_t, const std::string&) {};  // run() throws instead
  CheckpointWriter writer(std::move(options));
  writer.run(job);
  // Exit 77 promises a complete checkpoint: the last writer to land completes
  // it; the others wait for that (on a store that is slow to show files, a
  // writer may not see the last part and leave the completion to another).
  // The communicator is interrupted here already: that stops nothing.
  waitUntilIntact(dir, 2 * managerLink_->salvageTimeout(), "salvaged checkpoint", /*stopIfInterrupted=*/false);
}

}  // namespace varuna
