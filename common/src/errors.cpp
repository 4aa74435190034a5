#include "varuna/common/errors.h"

#include <cstdio>
#include <cstdlib>

namespace varuna {

void checkFailed(const char* file, int line, const char* expr, const std::string& detail) {
  std::fprintf(stderr, "varuna: internal check failed at %s:%d: %s (%s)\n", file, line, expr,
               detail.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace varuna
