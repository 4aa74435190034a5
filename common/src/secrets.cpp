#include "varuna/common/secrets.h"

#include <cstdlib>
#include <cstring>

namespace varuna {

bool constantTimeEquals(std::string_view a, std::string_view b) {
  // Every byte of the longer one is read whatever the others hold; the
  // lengths themselves are not secret (a token's length is fixed).
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  unsigned char differ = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    differ |= static_cast<unsigned char>(x ^ y);
  }
  return differ == 0;
}

void scrubEnvironmentVariable(const char* name) {
  if (char* value = std::getenv(name)) {
    // volatile: the compiler may not drop a write to memory it sees no later read of.
    volatile char* bytes = value;
    for (size_t i = 0, n = std::strlen(value); i < n; ++i) bytes[i] = '\0';
  }
  ::unsetenv(name);
}

}  // namespace varuna
