#include "daemon/checkpoint_watcher.h"

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/common/protocol.h"

namespace varuna {
namespace {

constexpr size_t kMaxSkippedKept = 100;

// On the store's thread: a scanner that throws (an injected one) is a scan
// that failed, so a result always comes back (a launch or the next scan
// waits for it).
StoreScan scanStoreSafely(const StoreScanner& scanner, const StoreScanRequest& request) {
  try {
    return scanner(request);
  } catch (const std::exception& e) {
    StoreScan failed;
    failed.error = *e.what() ? e.what() : "the store scan failed";
    return failed;
  }
}

// The steady-clock time `ageSeconds` before `now`.
CheckpointWatcher::TimePoint completedAt(double ageSeconds, CheckpointWatcher::TimePoint now) {
  return now - std::chrono::duration_cast<CheckpointWatcher::TimePoint::duration>(std::chrono::duration<double>(ageSeconds));
}

}  // namespace

CheckpointWatcher::CheckpointWatcher(boost::asio::io_context& io, std::shared_ptr<HandlerGuard> guard,
                                     EventLog& events, std::string globalStore, StoreScanner scanner, Clock& clock)
    : clock_(clock),
      guard_(std::move(guard)),
      events_(events),
      globalStore_(std::move(globalStore)),
      scanner_(std::move(scanner)),
      worker_(std::make_unique<BackgroundWorker>(io, "varuna-store")) {}

void CheckpointWatcher::scanNow() {
  const StoreScan scan = scanStoreSafely(scanner_, request(/*thorough=*/true));
  latest_ = read(scan);
  if (scan.latestAgeSeconds) latestCompletedAt_ = completedAt(*scan.latestAgeSeconds, clock_.now());
}

void CheckpointWatcher::poll() {
  if (scanInFlight_) return;
  scanInFlight_ = true;
  worker_->run([scanner = scanner_, request = request(/*thorough=*/false)] { return scanStoreSafely(scanner, request); },
               guard_->wrap("a checkpoint store scan", [this](const StoreScan& scan) {
                 scanInFlight_ = false;
                 scanned(scan);
               }));
}

void CheckpointWatcher::finalScan(std::function<void()> done) {
  finalScanDone_ = false;
  worker_->run([scanner = scanner_, request = request(/*thorough=*/true)] { return scanStoreSafely(scanner, request); },
               guard_->wrap("the final checkpoint store scan", [this, done](const StoreScan& scan) {
                 finalScanDone_ = true;
                 scanned(scan);
                 done();
               }));
}

void CheckpointWatcher::prepareLaunch(int generation, std::function<void(const LaunchPrep&)> done) {
  // Fencing: the store records the generation before any of its workers
  // exists, so the workers of every earlier generation that are still alive
  // are refused when they try to complete a checkpoint. And the checkpoint to
  // resume from is looked up again, thoroughly (the one a morph's workers
  // just wrote).
  worker_->run(
      [store = globalStore_, generation, scanner = scanner_, request = request(/*thorough=*/true)] {
        LaunchPrep prep;
        try {
          ckpt::recordGeneration(store, generation);
        } catch (const std::exception& e) {
          prep.recordError = *e.what() ? e.what() : "unknown error";
          return prep;  // no launch: no need for its checkpoint
        }
        prep.scan = scanStoreSafely(scanner, request);
        return prep;
      },
      guard_->wrap("a launch's store work", std::move(done)));
}

void CheckpointWatcher::scanned(const StoreScan& scan) {
  note(read(scan), clock_.now(), scan.latestAgeSeconds);
}

std::optional<int64_t> CheckpointWatcher::read(const StoreScan& scan) {
  if (!scan.error.empty()) {
    // Never a fresh start either (that would throw the job's progress away):
    // keep resuming from the last known.
    if (readError_ != scan.error) {
      readError_ = scan.error;
      log::error("cannot look for checkpoints in ", globalStore_, ": ", scan.error,
                 latest_ ? strCat("; using the last one seen, step ", *latest_) : std::string());
      events_.write("store_error", {{"error", proto::boundedText(scan.error)}});
    }
    return latest_;
  }
  readError_.clear();
  for (const auto& skip : scan.skipped) {
    if (!skipped_.insert(skip.step).second) continue;  // reported already
    // Bounded (state.json lists them): the oldest go first; they are older
    // than every checkpoint a scan still passes over.
    while (skipped_.size() > kMaxSkippedKept) skipped_.erase(skipped_.begin());
    log::warn("skipping the checkpoint of step ", skip.step, ": ", skip.reason,
              scan.latest ? strCat("; the latest usable one is step ", *scan.latest) : std::string("; no usable one is left"));
    events_.write("checkpoint_skipped", {{"step", skip.step}, {"reason", proto::boundedText(skip.reason)}});
  }
  return scan.latest;
}

void CheckpointWatcher::note(std::optional<int64_t> latest, TimePoint now, std::optional<double> ageSeconds) {
  if (!latest || latest == latest_) return;
  latestCompletedAt_ = ageSeconds ? std::optional(completedAt(*ageSeconds, now)) : std::nullopt;
  if (latest_ && *latest < *latest_) {
    // The newer one was found damaged (checkpoint_skipped says which): not a new checkpoint.
    latest_ = latest;
    return;
  }
  latest_ = latest;
  latestSeenAt_ = now;
  events_.write("checkpoint_complete", {{"step", *latest}});
}

}  // namespace varuna
