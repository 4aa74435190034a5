// libFuzzer target: run_varuna's job-config and env-file parsers either return
// a config (whose JSON form reads back to the same config) or throw
// ConfigError; nothing else.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string_view>

#include "varuna/common/errors.h"
#include "varuna/manager/job_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto config = varuna::parseJobConfigText(text, "fuzz.json");
    const auto json = varuna::toJson(config);
    if (varuna::toJson(varuna::applyJobJson(varuna::JobConfig{}, json, "round trip")) != json) std::abort();
  } catch (const varuna::ConfigError&) {
  }
  try {
    for (const auto& [key, value] : varuna::parseEnvFile(text, "fuzz.env")) {
      if (key.empty() || key.find('=') != std::string::npos) std::abort();
    }
  } catch (const varuna::ConfigError&) {
  }
  return 0;
}
