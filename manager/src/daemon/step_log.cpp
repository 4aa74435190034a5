#include "varuna/manager/daemon/step_log.h"

#include <ctime>

#include <nlohmann/json.hpp>

namespace varuna {
namespace {

// As isoTimeNow() writes it, for a time in the past.
std::string isoTime(int64_t unixMs) {
  const std::time_t seconds = static_cast<std::time_t>(unixMs / 1000);
  std::tm utc{};
  ::gmtime_r(&seconds, &utc);
  char text[64];
  std::snprintf(text, sizeof(text), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900, utc.tm_mon + 1,
                utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, static_cast<int>(unixMs % 1000));
  return text;
}

}  // namespace

void StepLog::add(int generation, int64_t step, double loss, double stepSeconds, TimePoint now, int64_t unixMs) {
  const Line line{generation, step, loss, stepSeconds, now, unixMs};
  const bool firstOfGeneration = !written_ || written_->generation != generation;
  if (firstOfGeneration || now - written_->at >= kInterval) {
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
  // The step's own time, also for a line written at the end of its generation.
  log_.write("step", {{"time", isoTime(line.unixMs)},
                      {"unix_ms", line.unixMs},
                      {"generation", line.generation},
                      {"step", line.step},
                      {"loss", line.loss},
                      {"step_s", line.stepSeconds},
                      {"samples_per_s", samplesPerSecond}});
  written_ = line;
  pending_.reset();
}

}  // namespace varuna
