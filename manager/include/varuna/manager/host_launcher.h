// HostLauncher: the seam through which run_varuna runs a command on a host:
// this machine's own addresses directly (/bin/sh), every other host over SSH
// (libssh, host keys checked). Used to start the agents. Blocking: the daemon
// calls it from a short-lived thread per host and posts the result back to its
// event loop. Implementations must be callable from several threads at once.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

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

// A local account a command is started under instead of run_varuna's own.
struct LocalAccount {
  std::string name;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary, as a login would have them
  std::string home;
};

// How the agents of this machine's own addresses start. An agent is the job's
// user on every host: the SSH login (`ssh_user`, default run_varuna's user).
// So this machine runs it directly only as that same user: directly as
// run_varuna's user when `sshUser` is empty or names it; as `sshUser` when
// run_varuna is root (it switches to the account, never leaving a root
// agent behind a job that names its user); over SSH, like any host, when
// run_varuna is another user who cannot switch.
struct LocalStart {
  bool overSsh = false;
  std::optional<LocalAccount> account;  // set: switch to it
};
// Throws ConfigError naming `sshUser` when root must switch to an account
// this machine does not have.
LocalStart localStartFor(const std::string& sshUser);

class ShellHostLauncher : public HostLauncher {
 public:
  explicit ShellHostLauncher(SshOptions ssh) : ssh_(std::move(ssh)) {}
  HostCommandResult run(const std::string& host, const std::string& command, const std::string& input) override;

 private:
  SshOptions ssh_;
  std::once_flag rootWarning_;
};

// True for localhost, 127.0.0.0/8, ::1 and the addresses of this machine's interfaces.
bool isLocalHost(const std::string& host);

// Runs `command` with /bin/sh -c, `input` on its stdin, capturing stdout+stderr,
// killing it after `timeout`; as `account` when given (run_varuna is root:
// its groups, gid and uid, and HOME, USER and LOGNAME of it).
HostCommandResult runLocalCommand(const std::string& command, std::chrono::milliseconds timeout,
                                  const std::string& input = "", const LocalAccount* account = nullptr);

// 'text' quoted for a POSIX shell.
std::string shellQuote(const std::string& text);

}  // namespace varuna
