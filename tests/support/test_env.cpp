#include "test_env.h"

#include <cstdlib>
#include <stdexcept>
#include <unistd.h>

namespace varuna::test {
namespace {

std::filesystem::path fromEnv(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::filesystem::path(value) : std::filesystem::path(fallback);
}

}  // namespace

std::filesystem::path scratchDir(const std::string& name) {
  auto dir = fromEnv("VARUNA_TEST_TMPDIR", "/tmp/varuna-test") / (name + "-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::filesystem::path buildDir() { return fromEnv("VARUNA_BUILD_DIR", "."); }
std::filesystem::path sourceDir() { return fromEnv("VARUNA_SOURCE_DIR", ".."); }

}  // namespace varuna::test
