// Profiler: one profiling run on every rank (see varuna/worker/profiler.h for
// what is measured and how the work is spread). This file is the run itself:
// options and the existing profile, agreement and waits through the
// rendezvous store, the (piece, size) measurements handed out round-robin,
// the results gathered and merged on rank 0, and profile.json written. The
// measurements are in profiler_measure.cpp; profiler_impl.h declares the Impl
// both share.
#include "varuna/worker/profiler.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <ctime>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "profiler/profiler_impl.h"
#include "varuna/common/errors.h"
#include "varuna/common/log.h"

namespace varuna {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

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
  comm.backend = opt_.commBackend;
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

std::vector<Profiler::Impl::Item> Profiler::Impl::pendingItems() const {
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
