// Error types shared by every component.
//
// Two kinds of failure (as Gloo's docs/errors.md separates them):
//  - expected runtime failures (bad input, I/O, lost peer) are typed exceptions
//    carrying context and, for workers, the process exit code to use;
//  - broken invariants are VARUNA_CHECK failures that print both sides and abort.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace varuna {

// Documented worker exit codes (docs/worker-api.md). The launcher and the
// manager read them to tell a bad configuration from a lost peer.
inline constexpr int kExitOk = 0;
inline constexpr int kExitTrainingFailed = 1;    // the training itself failed (e.g. non-finite gradients)
inline constexpr int kExitConfigError = 2;       // bad arguments or model spec
inline constexpr int kExitPeerLost = 3;          // another rank died or hung
// Checkpoint storage failed (full disk, I/O error, a checkpoint that fails its
// checksum): retrying, or falling back to an older checkpoint, can help. The
// value is sysexits' EX_IOERR.
inline constexpr int kExitStorageError = 74;
// This worker's generation was superseded by a newer launch of the same job
// (the manager recorded it in the store): it must not touch the store again.
inline constexpr int kExitSuperseded = 76;
inline constexpr int kExitCheckpointed = 75;     // on-demand checkpoint written (P2)
// This worker lost a peer and wrote its stage's share of the salvaged
// checkpoint the manager ordered (docs/salvage.md).
inline constexpr int kExitSalvaged = 77;
// run_varuna's control port is in use (another manager, or the previous one
// still exiting): a retry can work, unlike a configuration error (2). The
// value is sysexits' EX_UNAVAILABLE.
inline constexpr int kExitAddressInUse = 69;

// Base of every expected failure. `exitCode()` is what a worker should exit with.
class Error : public std::runtime_error {
 public:
  Error(const std::string& what, int exitCode) : std::runtime_error(what), exitCode_(exitCode) {}
  int exitCode() const { return exitCode_; }

 private:
  int exitCode_;
};

// Bad user input: names the input, the offending value and the fix.
class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& what) : Error(what, kExitConfigError) {}
};

// A peer rank died, hung or became unreachable.
class PeerLostError : public Error {
 public:
  PeerLostError(const std::string& what, int lostRank)
      : Error(what, kExitPeerLost), lostRank_(lostRank) {}
  // The rank believed lost, or -1 when it could not be determined.
  int lostRank() const { return lostRank_; }

 private:
  int lostRank_;
};

// Concatenates anything streamable: strCat("rank ", 3, " lost").
template <typename... Args>
std::string strCat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

[[noreturn]] void checkFailed(const char* file, int line, const char* expr, const std::string& detail);

}  // namespace varuna

// Invariant checks: never for user input (use ConfigError for that).
#define VARUNA_CHECK(cond, ...)                                                     \
  do {                                                                              \
    if (!(cond)) ::varuna::checkFailed(__FILE__, __LINE__, #cond, ::varuna::strCat(__VA_ARGS__)); \
  } while (0)

#define VARUNA_CHECK_EQ(a, b)                                                       \
  do {                                                                              \
    const auto& varuna_a_ = (a);                                                    \
    const auto& varuna_b_ = (b);                                                    \
    if (!(varuna_a_ == varuna_b_))                                                  \
      ::varuna::checkFailed(__FILE__, __LINE__, #a " == " #b,                       \
                            ::varuna::strCat(varuna_a_, " vs ", varuna_b_));        \
  } while (0)
