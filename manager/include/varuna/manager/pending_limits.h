// PendingLimits: what run_varuna allows the connections that have not said
// hello yet (docs/run_varuna.md, "Connections and limits"). Its own header:
// the daemon's options carry it, the pending-connection set (manager/src/loop/)
// enforces it.
#pragma once

#include <chrono>
#include <cstddef>

namespace varuna {

struct PendingLimits {
  size_t maxPending = 64;
  std::chrono::milliseconds helloDeadline{5000};
  // The first frame (the hello, well under 1 KiB) may be at most this large;
  // a bigger header closes the connection before its body is read.
  size_t maxHelloBytes = 16 * 1024;
};

}  // namespace varuna
