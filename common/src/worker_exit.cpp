#include "varuna/common/worker_exit.h"

#include "varuna/common/errors.h"

namespace varuna {

ExitKind WorkerExit::kind() const {
  if (exitCode < 0) return ExitKind::kSignalled;
  switch (exitCode) {
    case kExitOk: return ExitKind::kFinished;
    case kExitCheckpointed: return ExitKind::kCheckpointed;
    case kExitSalvaged: return ExitKind::kSalvaged;
    case kExitSuperseded: return ExitKind::kSuperseded;
    case kExitPeerLost: return ExitKind::kPeerLost;
    case kExitConfigError: return ExitKind::kConfigError;
    case kExitStorageError: return ExitKind::kStorageError;
    default: return ExitKind::kCrashed;
  }
}

bool WorkerExit::asOrdered() const {
  const ExitKind k = kind();
  return k == ExitKind::kFinished || k == ExitKind::kCheckpointed || k == ExitKind::kSalvaged;
}

bool WorkerExit::causedHere() const {
  const ExitKind k = kind();
  return k != ExitKind::kPeerLost && k != ExitKind::kSuperseded && k != ExitKind::kSalvaged;
}

std::string WorkerExit::describe() const {
  const char* meaning = nullptr;
  switch (kind()) {
    case ExitKind::kSignalled: return signal > 0 ? strCat("signal ", signal) : std::string("a signal");
    case ExitKind::kConfigError: meaning = "configuration error"; break;
    case ExitKind::kPeerLost: meaning = "lost a peer"; break;
    case ExitKind::kStorageError: meaning = "checkpoint storage failed"; break;
    case ExitKind::kCheckpointed: meaning = "checkpointed"; break;
    case ExitKind::kSuperseded: meaning = "superseded by a newer generation"; break;
    case ExitKind::kSalvaged: meaning = "wrote its salvage share"; break;
    case ExitKind::kFinished:
    case ExitKind::kCrashed: break;
  }
  return meaning ? strCat("code ", exitCode, " (", meaning, ")") : strCat("code ", exitCode);
}

}  // namespace varuna
