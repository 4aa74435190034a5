// libFuzzer target: the machine-list parser either returns machines that obey
// its rules or throws ConfigError; nothing else.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string_view>

#include "varuna/common/errors.h"
#include "varuna/common/machine_list.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    std::set<std::string> hosts;
    for (const auto& m : varuna::parseMachineList(text, "fuzz", 1)) {
      if (m.slots < 1 || m.slots > 1024 || !varuna::isValidHostAddress(m.host) || !hosts.insert(m.host).second) {
        std::abort();
      }
    }
  } catch (const varuna::ConfigError&) {
  }
  return 0;
}
