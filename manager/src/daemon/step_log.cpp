#include "daemon/step_log.h"

#include <filesystem>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/errors.h"
#include "varuna/common/log.h"

namespace varuna {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// A line of steps.jsonl read back for thinning: its text as written (kept
// byte for byte unless its samples/s changes) and what thinning looks at.
struct Record {
  std::string text;
  int64_t unixMs = 0, step = 0;
  int generation = 0;
};

// Not a step line (a line cut short by a crash): dropped by the rewrite.
std::optional<Record> parseRecord(std::string text) {
  try {
    const Json j = Json::parse(text);
    if (!j.is_object() || !j.contains("unix_ms") || !j.contains("step") || !j.contains("generation")) {
      return std::nullopt;
    }
    const auto unixMs = j.at("unix_ms").get<int64_t>(), step = j.at("step").get<int64_t>();
    return Record{std::move(text), unixMs, step, j.at("generation").get<int>()};
  } catch (const Json::exception&) {
    return std::nullopt;
  }
}

std::vector<Record> readRecords(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(strCat("cannot read ", path), 1);
  std::vector<Record> records;
  for (std::string line; std::getline(in, line);) {
    if (auto record = parseRecord(std::move(line))) records.push_back(std::move(*record));
  }
  if (in.bad()) throw Error(strCat("cannot read ", path), 1);
  return records;
}

// The records kept at `spacingMs`: every generation's first and last (the
// report's rollbacks need them exact) and, within a generation, a line only
// if it is at least `spacingMs` after the line kept before it.
std::vector<size_t> keepAt(const std::vector<Record>& records, int64_t spacingMs) {
  std::vector<size_t> kept;
  for (size_t i = 0; i < records.size(); ++i) {
    const bool first = i == 0 || records[i - 1].generation != records[i].generation;
    const bool last = i + 1 == records.size() || records[i + 1].generation != records[i].generation;
    if (first || last || records[i].unixMs - records[kept.back()].unixMs >= spacingMs) kept.push_back(i);
  }
  return kept;
}

uint64_t bytesOf(const std::vector<Record>& records, const std::vector<size_t>& kept) {
  uint64_t bytes = 0;
  for (const size_t i : kept) bytes += records[i].text.size() + 1;
  return bytes;
}

// Doubles `spacingMs` until what is kept fits in `targetBytes`. If only
// generation boundaries are left and they still do not fit (thousands of
// generations), the oldest go: the bound holds whatever the job did.
std::vector<size_t> fit(const std::vector<Record>& records, int64_t& spacingMs, uint64_t targetBytes) {
  const int64_t span = records.empty() ? 0 : records.back().unixMs - records.front().unixMs;
  std::vector<size_t> kept = keepAt(records, spacingMs);
  while (bytesOf(records, kept) > targetBytes && spacingMs <= span) {
    spacingMs *= 2;
    kept = keepAt(records, spacingMs);
  }
  uint64_t bytes = bytesOf(records, kept);
  size_t dropped = 0;
  while (bytes > targetBytes && dropped + 1 < kept.size()) bytes -= records[kept[dropped++]].text.size() + 1;
  kept.erase(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(dropped));
  return kept;
}

// The kept lines as the file's new content. A line whose predecessors were
// dropped gets the throughput since the line now before it, so samples/s
// still means what docs/run_varuna.md says (and is smoother, not one
// second's worth, where the lines are sparse).
std::string render(const std::vector<Record>& records, const std::vector<size_t>& kept, int64_t globalBatch) {
  std::string out;
  for (size_t k = 0; k < kept.size(); ++k) {
    const Record& record = records[kept[k]];
    const Record* before = k > 0 ? &records[kept[k - 1]] : nullptr;
    if (before && kept[k] != kept[k - 1] + 1 && before->generation == record.generation &&
        record.step > before->step && record.unixMs > before->unixMs) {
      Json j = Json::parse(record.text);
      j["samples_per_s"] = static_cast<double>((record.step - before->step) * globalBatch) /
                           (static_cast<double>(record.unixMs - before->unixMs) / 1000.0);
      out += j.dump(-1, ' ', false, Json::error_handler_t::replace);
    } else {
      out += record.text;
    }
    out += '\n';
  }
  return out;
}

}  // namespace

StepLog::StepLog(const std::string& path, int64_t globalBatch, uint64_t maxBytes)
    : path_(path), log_(std::in_place, path), globalBatch_(globalBatch), maxBytes_(maxBytes) {}

void StepLog::add(int generation, int64_t step, double loss, double stepSeconds, TimePoint now, int64_t unixMs) {
  const Line line{generation, step, loss, stepSeconds, now, unixMs};
  const bool firstOfGeneration = !written_ || written_->generation != generation;
  if (firstOfGeneration || now - written_->at >= interval_) {
    write(line);
  } else {
    pending_ = line;
  }
}

void StepLog::flush() {
  if (pending_) write(*pending_);
}

void StepLog::write(const Line& line) {
  double samplesPerSecond = line.stepSeconds > 0 ? static_cast<double>(globalBatch_) / line.stepSeconds : 0;
  if (written_ && written_->generation == line.generation && line.step > written_->step && line.at > written_->at) {
    samplesPerSecond = static_cast<double>((line.step - written_->step) * globalBatch_) /
                       std::chrono::duration<double>(line.at - written_->at).count();
  }
  written_ = line;
  pending_.reset();
  if (!log_) {
    try {
      log_.emplace(path_);  // a thinning replaced the file and could not reopen it
    } catch (const std::exception&) {
      return;  // the line is lost, as a line EventLog cannot write is
    }
  }
  // The step's own time, also for a line written at the end of its generation.
  log_->write("step", {{"time", isoTime(line.unixMs)},
                       {"unix_ms", line.unixMs},
                       {"generation", line.generation},
                       {"step", line.step},
                       {"loss", line.loss},
                       {"step_s", line.stepSeconds},
                       {"samples_per_s", samplesPerSecond}});
  thinIfFull(line.at);
}

void StepLog::thinIfFull(TimePoint now) noexcept {
  std::error_code ec;
  const uintmax_t bytes = fs::file_size(path_, ec);
  if (ec || bytes <= maxBytes_ || now < thinRetryAt_) return;
  try {
    thin();
  } catch (const std::exception& e) {
    thinRetryAt_ = now + kThinRetry;
    try {
      log::warn("cannot thin ", path_, " (", bytes, " bytes): ", e.what(), "; trying again in ", kThinRetry.count(),
                " minutes");
    } catch (...) {
    }
  }
}

// Why thinning and not rotation (steps.jsonl.1): the timeline draws the whole
// job from the manager's start, and events.jsonl keeps all of it; a rotated
// log would leave the older part of the picture without loss or throughput.
// Thinning keeps all of it, every generation's first and last step exact,
// at one resolution: the spacing of the lines kept doubles until they take
// half of maxBytes, and new lines come at that spacing from then on (the
// file fills up again at half the rate, so thinnings get rarer). A restarted
// manager starts at a line a second again: its thinnings thin its own lines
// first (the older ones are sparser already) until the spacing catches up;
// bounded all along, the newest part denser meanwhile. The file is replaced
// atomically (readers see the old or the new one, a crash leaves one of
// them), then reopened for appending.
void StepLog::thin() {
  const std::vector<Record> records = readRecords(path_);
  int64_t spacingMs = 2 * interval_.count();
  const std::vector<size_t> kept = fit(records, spacingMs, maxBytes_ / 2);
  const fs::path path(path_);
  ckpt::writeFileAtomic(path.has_parent_path() ? path.parent_path() : fs::path("."), path.filename().string(),
                        render(records, kept, globalBatch_));
  interval_ = std::chrono::milliseconds(spacingMs);
  log_.reset();  // its stream writes to the file just replaced
  log_.emplace(path_);
  log::info("thinned ", path_, " to ", kept.size(), " of ", records.size(), " lines; a line every ",
            spacingMs / 1000.0, " s from now on");
}

}  // namespace varuna
