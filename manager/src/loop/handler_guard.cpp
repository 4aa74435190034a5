#include "loop/handler_guard.h"

#include "varuna/common/log.h"
#include "varuna/common/protocol.h"

namespace varuna {

void HandlerGuard::report(std::string_view what, std::string_view error) noexcept {
  ++failures_;
  try {
    uint64_t suppressed = 0;
    if (!limiter_.allow(std::chrono::steady_clock::now(), &suppressed)) return;
    log::error(what, " failed: ", proto::boundedText(error),
               suppressed > 0 ? strCat(" (", suppressed, " more handler failure(s) not logged)") : std::string());
  } catch (...) {
    // Out of memory while logging: the failure is counted, nothing more can be done.
  }
}

}  // namespace varuna
