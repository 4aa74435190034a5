// WorkerExit: what a worker's exit means, read once for everyone who acts on
// it (the agent that reaps it, the daemon that logs and counts it, the morph
// controller that decides what comes next). The codes are errors.h's
// (docs/worker-api.md, "Exit codes").
#pragma once

#include <string>

namespace varuna {

enum class ExitKind {
  kFinished,      // 0: trained every step
  kCheckpointed,  // 75: wrote the on-demand checkpoint it was asked for
  kSalvaged,      // 77: wrote its stage's share of a salvage it was ordered to
  kSuperseded,    // 76: its generation was replaced (ordered out, or found a newer launch)
  kPeerLost,      // 3: another rank died or hung
  kConfigError,   // 2: bad arguments or model; every relaunch would fail the same way
  kStorageError,  // 74: checkpoint storage failed
  kCrashed,       // any other code
  kSignalled,     // killed by a signal
};

struct WorkerExit {
  int exitCode = 0;  // -1 when a signal ended it
  int signal = 0;

  static WorkerExit fromCode(int exitCode) { return {exitCode, 0}; }

  ExitKind kind() const;
  // It did what it was told (finished, checkpointed, wrote its salvage
  // share): not a failure; its log tail is not needed.
  bool asOrdered() const;
  // A failure of its own, as opposed to the echo of one elsewhere (a lost
  // peer, a superseded generation, a salvage share written after a loss):
  // the echo is counted where it happened.
  bool causedHere() const;
  // "code 74 (checkpoint storage failed)", "code 1", "signal 9".
  std::string describe() const;
};

}  // namespace varuna
