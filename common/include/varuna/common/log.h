// The logging facade used by every component.
//
// Backed by spdlog, but its header exposes no spdlog (or fmt) type, so the
// worker can include it next to libtorch, which bundles its own fmt. Every line
// carries the process context: component and [job host rank stage].
// Thread-safe; configure once from main() before other threads start.
#pragma once

#include <string>
#include <string_view>

#include "varuna/common/errors.h"

namespace varuna::log {

enum class Level { kDebug, kInfo, kWarn, kError };

struct Context {
  std::string component = "varuna";
  std::string job;
  std::string host;
  int rank = -1;   // -1: not a worker
  int stage = -1;  // -1: unknown
};

// Sets the prefix of every following line and the minimum level printed.
void configure(const Context& context, Level minLevel = Level::kInfo);
// Parses "debug", "info", "warn", "error" (e.g. from --log_level).
Level parseLevel(std::string_view name);
void setLevel(Level minLevel);
void setStage(int stage);

void write(Level level, std::string_view message);

template <typename... Args> void debug(const Args&... a) { write(Level::kDebug, strCat(a...)); }
template <typename... Args> void info(const Args&... a) { write(Level::kInfo, strCat(a...)); }
template <typename... Args> void warn(const Args&... a) { write(Level::kWarn, strCat(a...)); }
template <typename... Args> void error(const Args&... a) { write(Level::kError, strCat(a...)); }

// Flushes everything buffered; call before a fast exit.
void flush();

}  // namespace varuna::log
