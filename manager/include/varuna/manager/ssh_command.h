// runOverSsh: the manager's SSH seam. run_varuna starts a host agent on each
// machine by running one command there over SSH (libssh) and reading its
// exit status and output.
//
// Security: public-key authentication only, and the server's host key must
// already be in `knownHostsFile` (the system-wide /etc/ssh/ssh_known_hosts is
// not consulted). An unknown or changed key is refused and never recorded
// automatically: the result tells the user how to verify and add it.
// ~/.ssh/config is not read, so what runs is what the options say.
//
// Threading: blocking; each call owns its own libssh session, so several
// threads may call it at once (libssh >= 0.10 is thread-safe with one session
// per thread). Expected failures (unreachable host, host key, authentication,
// non-zero exit, timeout) come back as values; nothing is thrown.
#pragma once

#include <chrono>
#include <string>

namespace varuna {

struct SshOptions {
  std::string user;  // empty: the current user
  int port = 22;
  std::string identityFile;    // empty: libssh's defaults (~/.ssh/id_ed25519, id_ecdsa, id_rsa) and ssh-agent
  std::string knownHostsFile;  // empty: ~/.ssh/known_hosts
  // Bounds each step of connecting: TCP connect plus key exchange, then authentication.
  std::chrono::milliseconds connectTimeout{10000};
  // Bounds the whole exec, from opening the channel to the exit status. On
  // expiry the command is sent SIGKILL and the session closed; sshd delivers
  // the signal to non-root logins only, so a root login's command ends only
  // when it next writes output (SIGPIPE) or on its own.
  std::chrono::milliseconds commandTimeout{60000};
};

enum class SshFailure {
  kNone,
  kUnreachable,     // TCP connect or SSH handshake failed or timed out, or the connection dropped
  kUnknownHostKey,  // the host has no key in knownHostsFile (or the file is missing / unreadable)
  kHostKeyChanged,  // knownHostsFile holds a different key for the host (possible man-in-the-middle)
  kAuthFailed,      // the server refused the public key, or the identity file cannot be loaded
  kCommandFailed,   // the command could not start, exited non-zero or was killed by a signal
  kTimeout,         // commandTimeout expired (or authentication outlasted connectTimeout)
};
const char* toString(SshFailure failure);

struct SshResult {
  SshFailure failure = SshFailure::kNone;
  int exitStatus = -1;  // the remote command's, when it ran and reported one
  std::string output;   // stdout + stderr of the command, in arrival order; the last 64 KiB when longer
  std::string message;  // for failures: one sentence naming host:port and the fix
  bool ok() const { return failure == SshFailure::kNone; }
};

// Runs `command` (through the remote user's login shell) on `host`; `input`
// is its stdin (then EOF). Secrets go there: the command line of the remote
// shell is visible to every user of the host through `ps`.
SshResult runOverSsh(const std::string& host, const std::string& command, const SshOptions& options,
                     const std::string& input = "");

}  // namespace varuna
