#include "loop/event_log.h"

#include <chrono>
#include <ctime>
#include <filesystem>

#include "varuna/common/errors.h"
#include "varuna/common/log.h"

namespace varuna {

int64_t unixMillisNow() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string isoTime(int64_t unixMs) {
  const std::time_t seconds = static_cast<std::time_t>(unixMs / 1000);
  std::tm utc{};
  ::gmtime_r(&seconds, &utc);
  char text[64];
  std::snprintf(text, sizeof(text), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900, utc.tm_mon + 1,
                utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, static_cast<int>(unixMs % 1000));
  return text;
}

std::string isoTimeNow() { return isoTime(unixMillisNow()); }

EventLog::EventLog(const std::string& path, uint64_t maxBytes)
    : path_(path), out_(path, std::ios::app), maxBytes_(maxBytes) {
  if (!out_) throw Error(strCat("cannot open the event log ", path, " for appending"), 1);
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  bytes_ = ec ? 0 : size;
}

void EventLog::rotate() {
  out_.close();
  std::error_code ec;
  std::filesystem::rename(path_, path_ + ".1", ec);
  if (ec) log::error("rotating the event log ", path_, " failed: ", ec.message(), "; it goes on growing");
  out_.open(path_, std::ios::app);
  if (!out_) out_.clear();  // the next write counts the loss and tries again
  bytes_ = 0;
}

void EventLog::write(const std::string& event, nlohmann::json fields) noexcept {
  try {
    nlohmann::json line = {{"time", isoTimeNow()}, {"unix_ms", unixMillisNow()}, {"event", event}};
    for (auto& [k, v] : fields.items()) line[k] = v;
    // A field may hold bytes that are not UTF-8 (a path, a peer's text):
    // replaced with U+FFFD rather than a type_error out of a handler.
    const std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + '\n';
    if (bytes_ > 0 && bytes_ + text.size() > maxBytes_) rotate();
    if (!out_.is_open()) out_.open(path_, std::ios::app);
    out_ << text;
    out_.flush();
    bytes_ += text.size();
    if (out_) return;
    out_.clear();  // a full disk: the next line tries again (the stream would stay failed)
    noteLost("the write failed (full or failing disk?)");
  } catch (const std::exception& e) {
    noteLost(e.what());
  }
}

void EventLog::noteLost(const char* why) noexcept {
  ++lost_;
  try {
    uint64_t suppressed = 0;
    if (lostLog_.allow(std::chrono::steady_clock::now(), &suppressed)) {
      log::error("an event was not recorded in ", path_, ": ", why, " (", lost_, " lost so far)");
    }
  } catch (...) {
  }
}

}  // namespace varuna
