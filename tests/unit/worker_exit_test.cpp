// WorkerExit (one reading of a worker's exit for the agent, the daemon and the
// morph controller) and the shared time helpers (time_util.h).
#include <catch2/catch.hpp>

#include "varuna/common/errors.h"
#include "varuna/common/time_util.h"
#include "varuna/common/worker_exit.h"

using namespace varuna;
using namespace std::chrono_literals;

TEST_CASE("exit codes are named in messages") {
  CHECK(WorkerExit::fromCode(-1).describe() == "a signal");
  CHECK(WorkerExit{-1, 9}.describe() == "signal 9");
  CHECK(WorkerExit::fromCode(1).describe() == "code 1");
  CHECK(WorkerExit::fromCode(kExitStorageError).describe() == "code 74 (checkpoint storage failed)");
  CHECK(WorkerExit::fromCode(kExitSuperseded).describe() == "code 76 (superseded by a newer generation)");
  CHECK(WorkerExit::fromCode(kExitSalvaged).describe() == "code 77 (wrote its salvage share)");
}

TEST_CASE("every documented exit code has one kind, and what each implies") {
  struct Case {
    int code;
    int signal;
    ExitKind kind;
    bool asOrdered;
    bool causedHere;
  };
  const Case cases[] = {
      {kExitOk, 0, ExitKind::kFinished, true, true},
      {kExitCheckpointed, 0, ExitKind::kCheckpointed, true, true},
      {kExitSalvaged, 0, ExitKind::kSalvaged, true, false},  // a share written after a loss elsewhere
      {kExitSuperseded, 0, ExitKind::kSuperseded, false, false},
      {kExitPeerLost, 0, ExitKind::kPeerLost, false, false},
      {kExitConfigError, 0, ExitKind::kConfigError, false, true},
      {kExitStorageError, 0, ExitKind::kStorageError, false, true},
      {1, 0, ExitKind::kCrashed, false, true},
      {-1, 9, ExitKind::kSignalled, false, true},
  };
  for (const auto& c : cases) {
    CAPTURE(c.code, c.signal);
    const WorkerExit exit{c.code, c.signal};
    CHECK(exit.kind() == c.kind);
    CHECK(exit.asOrdered() == c.asOrdered);
    CHECK(exit.causedHere() == c.causedHere);
  }
}

TEST_CASE("a doubling backoff starts at its first wait, doubles, stops at its cap and starts over after reset") {
  DoublingBackoff backoff(50ms, 300ms);
  CHECK(backoff.current() == 0ms);
  CHECK(backoff.next() == 50ms);
  CHECK(backoff.next() == 100ms);
  CHECK(backoff.next() == 200ms);
  CHECK(backoff.next() == 300ms);
  CHECK(backoff.next() == 300ms);
  backoff.reset();
  CHECK(backoff.next() == 50ms);
  // A cap below the first wait is the first wait.
  CHECK(DoublingBackoff::after(0ms, 2s, 1s) == 2s);
  CHECK(DoublingBackoff::after(2s, 2s, 1s) == 2s);
}

TEST_CASE("time conversions") {
  const auto t0 = std::chrono::steady_clock::time_point{};
  CHECK(secondsBetween(t0, t0 + 1500ms) == Approx(1.5));
  CHECK(secondsBetween(t0 + 1s, t0) == Approx(-1.0));
  CHECK(millis(2.5) == 2500ms);
  CHECK(millis(0.0004) == 0ms);
  CHECK(seconds(1250ms) == Approx(1.25));
  // A peer's deadline: never negative, never past the bound, no overflow at the extremes.
  CHECK(clampedUntil(10'500, 10'000, 1h) == 500ms);
  CHECK(clampedUntil(9'000, 10'000, 1h) == 0ms);
  CHECK(clampedUntil(INT64_MAX, 10'000, 24h) == 24h);
  CHECK(clampedUntil(INT64_MAX, -1, 24h) == 24h);
  CHECK(clampedUntil(INT64_MIN, 10'000, 24h) == 0ms);
}
