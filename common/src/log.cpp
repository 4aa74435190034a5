#include "varuna/common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <mutex>

namespace varuna::log {
namespace {

std::mutex gMutex;
Context gContext;

std::shared_ptr<spdlog::logger> makeLogger() {
  // stderr: stdout belongs to the training program's own output.
  auto logger = spdlog::stderr_color_mt("varuna");
  logger->set_level(spdlog::level::info);
  return logger;
}

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = makeLogger();
  return *instance;
}

std::string contextPrefix(const Context& c) {
  std::string tags;
  auto add = [&tags](const std::string& t) {
    if (!tags.empty()) tags += ' ';
    tags += t;
  };
  if (!c.job.empty()) add("job=" + c.job);
  if (!c.host.empty()) add("host=" + c.host);
  if (c.rank >= 0) add("rank=" + std::to_string(c.rank));
  if (c.stage >= 0) add("stage=" + std::to_string(c.stage));
  return c.component + (tags.empty() ? "" : " [" + tags + "]");
}

void applyPattern() {
  // %^..%$ colours the level on terminals; the context is fixed text.
  logger().set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ " + contextPrefix(gContext) + ": %v");
}

spdlog::level::level_enum toSpd(Level level) {
  switch (level) {
    case Level::kDebug: return spdlog::level::debug;
    case Level::kInfo: return spdlog::level::info;
    case Level::kWarn: return spdlog::level::warn;
    case Level::kError: return spdlog::level::err;
  }
  return spdlog::level::info;
}

}  // namespace

void configure(const Context& context, Level minLevel) {
  std::lock_guard<std::mutex> lock(gMutex);
  gContext = context;
  applyPattern();
  logger().set_level(toSpd(minLevel));
}

Level parseLevel(std::string_view name) {
  if (name == "debug") return Level::kDebug;
  if (name == "info") return Level::kInfo;
  if (name == "warn" || name == "warning") return Level::kWarn;
  if (name == "error") return Level::kError;
  throw ConfigError(strCat("unknown log level '", name, "': use debug, info, warn or error"));
}

void setLevel(Level minLevel) { logger().set_level(toSpd(minLevel)); }

void setStage(int stage) {
  std::lock_guard<std::mutex> lock(gMutex);
  gContext.stage = stage;
  applyPattern();
}

void write(Level level, std::string_view message) { logger().log(toSpd(level), "{}", message); }

void flush() { logger().flush(); }

}  // namespace varuna::log
