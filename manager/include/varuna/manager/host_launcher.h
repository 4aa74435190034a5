// HostLauncher: the seam through which run_varuna runs a command on a host:
// this machine's own addresses directly (/bin/sh), every other host over SSH
// (libssh, host keys checked). Used to start the agents. Blocking: the daemon
// calls it from a short-lived thread per host and posts the result back to its
// event loop. Implementations must be callable from several threads at once.
#pragma once

#include <chrono>
#include <string>

#include "varuna/manager/ssh_command.h"

namespace varuna {

struct HostCommandResult {
  bool ok = false;
  int exitStatus = -1;  // the command's, when it ran
  std::string output;   // its stdout + stderr
  std::string message;  // failures: one sentence with the host and the fix
};

class HostLauncher {
 public:
  virtual ~HostLauncher() = default;
  // `input` is the command's stdin (then EOF): how secrets travel.
  virtual HostCommandResult run(const std::string& host, const std::string& command, const std::string& input) = 0;
};

class ShellHostLauncher : public HostLauncher {
 public:
  explicit ShellHostLauncher(SshOptions ssh) : ssh_(std::move(ssh)) {}
  HostCommandResult run(const std::string& host, const std::string& command, const std::string& input) override;

 private:
  SshOptions ssh_;
};

// True for localhost, 127.0.0.0/8, ::1 and the addresses of this machine's interfaces.
bool isLocalHost(const std::string& host);

// Runs `command` with /bin/sh -c, `input` on its stdin, capturing stdout+stderr,
// killing it after `timeout`.
HostCommandResult runLocalCommand(const std::string& command, std::chrono::milliseconds timeout,
                                  const std::string& input = "");

// 'text' quoted for a POSIX shell.
std::string shellQuote(const std::string& text);

}  // namespace varuna
