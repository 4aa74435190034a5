#include "varuna/manager/host_launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pwd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>

#include "varuna/common/errors.h"
#include "varuna/common/log.h"

namespace varuna {
namespace {

using Clock = std::chrono::steady_clock;

std::string lastLines(const std::string& text, int n) {
  size_t pos = text.size();
  if (pos > 0 && text[pos - 1] == '\n') --pos;
  for (int i = 0; i < n && pos != std::string::npos && pos > 0; ++i) pos = text.rfind('\n', pos - 1);
  return pos == std::string::npos || pos == 0 ? text : text.substr(pos + 1);
}

// The environment of a command started as `account`: run_varuna's own, with
// the account's HOME, USER and LOGNAME. Made before the fork: the child may
// not allocate (another thread may hold the allocator's lock).
std::vector<std::string> environmentFor(const LocalAccount& account) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view entry(*e);
    if (entry.starts_with("HOME=") || entry.starts_with("USER=") || entry.starts_with("LOGNAME=")) continue;
    env.emplace_back(entry);
  }
  env.push_back("HOME=" + account.home);
  env.push_back("USER=" + account.name);
  env.push_back("LOGNAME=" + account.name);
  return env;
}

std::optional<LocalAccount> lookUpAccount(const std::string& name) {
  std::vector<char> buffer(16384);
  passwd entry{};
  passwd* found = nullptr;
  int rc = 0;
  while ((rc = ::getpwnam_r(name.c_str(), &entry, buffer.data(), buffer.size(), &found)) == ERANGE &&
         buffer.size() < (1u << 20)) {
    buffer.resize(buffer.size() * 2);
  }
  if (rc != 0 || !found) return std::nullopt;
  LocalAccount account{found->pw_name, found->pw_uid, found->pw_gid, {}, found->pw_dir ? found->pw_dir : "/"};
  // Its groups as a login would have them; asked again while the list is
  // longer than the room given (it may grow between two calls).
  int count = 64;
  for (int attempt = 0; attempt < 4; ++attempt) {
    account.groups.resize(static_cast<size_t>(count));
    int groups = count;
    if (::getgrouplist(account.name.c_str(), account.gid, account.groups.data(), &groups) >= 0) {
      account.groups.resize(static_cast<size_t>(groups));
      return account;
    }
    count = std::max(groups, 2 * count);
  }
  return std::nullopt;  // the account's groups cannot be read: not switched to with a wrong list
}

}  // namespace

LocalStart localStartFor(const std::string& sshUser) {
  const uid_t self = ::geteuid();
  if (sshUser.empty()) return {};
  const auto account = lookUpAccount(sshUser);
  if (account && account->uid == self) return {};
  if (self != 0) return {.overSsh = true};
  if (!account) {
    throw ConfigError(strCat("ssh_user '", sshUser, "' has no account on this machine (or its groups cannot be read), ",
                             "so the agents of its own ",
                             "addresses cannot run as it: create the account here, or leave this machine out of the ",
                             "machine list"));
  }
  return {.account = account};
}

std::string shellQuote(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

bool isLocalHost(const std::string& host) {
  if (host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0) return true;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return false;
  bool local = false;
  for (ifaddrs* a = list; a && !local; a = a->ifa_next) {
    if (!a->ifa_addr) continue;
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ifa_addr->sa_family == AF_INET) {
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr, text, sizeof(text));
    }
    local = host == text;
  }
  ::freeifaddrs(list);
  return local;
}

HostCommandResult runLocalCommand(const std::string& command, std::chrono::milliseconds timeout,
                                  const std::string& input, const LocalAccount* account) {
  HostCommandResult result;
  std::vector<std::string> env = account ? environmentFor(*account) : std::vector<std::string>();
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  int pipeFds[2];
  int inputFds[2];
  if (::pipe2(pipeFds, O_CLOEXEC) != 0) {
    result.message = strCat("pipe failed: ", std::strerror(errno));
    return result;
  }
  if (::pipe2(inputFds, O_CLOEXEC) != 0) {
    result.message = strCat("pipe failed: ", std::strerror(errno));
    ::close(pipeFds[0]);
    ::close(pipeFds[1]);
    return result;
  }
  // The input is a line or two (a credential, the env_file's variables), so
  // it fits in the pipe's buffer (64 KiB on Linux): written before the fork
  // it can neither block nor raise SIGPIPE (a child that exits at once).
  constexpr size_t kMaxInput = 32 * 1024;
  if (input.size() > kMaxInput ||
      (!input.empty() && ::write(inputFds[1], input.data(), input.size()) != static_cast<ssize_t>(input.size()))) {
    for (int fd : {pipeFds[0], pipeFds[1], inputFds[0], inputFds[1]}) ::close(fd);
    result.message = strCat("cannot pass ", input.size(), " bytes of input to a local command (at most ", kMaxInput,
                            ": is the env_file that large?)");
    return result;
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(pipeFds[1], 1);
    ::dup2(pipeFds[1], 2);
    ::dup2(inputFds[0], 0);
    ::close_range(3, ~0U, 0);  // nothing of the manager's (its listening socket!) leaks into agents
    const char* argv[] = {"sh", "-c", command.c_str(), nullptr};
    if (!account) {
      ::execv("/bin/sh", const_cast<char* const*>(argv));
      ::_exit(127);
    }
    // Groups first, the uid last: after it nothing else may be changed.
    if (::setgroups(account->groups.size(), account->groups.data()) != 0 || ::setgid(account->gid) != 0 ||
        ::setuid(account->uid) != 0 || ::setuid(0) == 0) {
      static const char kFailed[] = "run_varuna: cannot switch to the job's user (ssh_user) for this machine's agent\n";
      [[maybe_unused]] const auto n = ::write(2, kFailed, sizeof(kFailed) - 1);
      ::_exit(126);
    }
    ::execve("/bin/sh", const_cast<char* const*>(argv), envp.data());
    ::_exit(127);
  }
  ::close(pipeFds[1]);
  ::close(inputFds[0]);
  ::close(inputFds[1]);
  if (pid < 0) {
    ::close(pipeFds[0]);
    result.message = strCat("fork failed: ", std::strerror(errno));
    return result;
  }
  // Read until EOF: a daemonizing command closes its end when it detaches.
  const auto deadline = Clock::now() + timeout;
  bool timedOut = false;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      timedOut = true;
      break;
    }
    pollfd p{pipeFds[0], POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char buffer[4096];
    const ssize_t n = ::read(pipeFds[0], buffer, sizeof(buffer));
    if (n <= 0) break;
    if (result.output.size() < 65536) result.output.append(buffer, static_cast<size_t>(n));
  }
  ::close(pipeFds[0]);
  if (timedOut) ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (timedOut) {
    result.message = strCat("the command did not finish within ", timeout.count(), " ms");
    return result;
  }
  result.exitStatus = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.ok = result.exitStatus == 0;
  if (!result.ok) result.message = strCat("exited with status ", result.exitStatus, ": ", lastLines(result.output, 4));
  return result;
}

HostCommandResult ShellHostLauncher::run(const std::string& host, const std::string& command,
                                         const std::string& input) {
  if (isLocalHost(host)) {
    LocalStart start;
    try {
      start = localStartFor(ssh_.user);
    } catch (const ConfigError& e) {
      HostCommandResult refused;
      refused.message = e.what();
      return refused;
    }
    if (!start.overSsh) {
      if (!start.account && ::geteuid() == 0 && ssh_.user.empty()) {
        std::call_once(rootWarning_, [] {
          log::warn("the agents and workers on this machine run as root (run_varuna's user): set ssh_user to the ",
                       "job's user and run_varuna starts them as it");
        });
      }
      return runLocalCommand(command, ssh_.commandTimeout, input, start.account ? &*start.account : nullptr);
    }
  }
  const SshResult ssh = runOverSsh(host, command, ssh_, input);
  HostCommandResult result;
  result.exitStatus = ssh.exitStatus;
  result.output = ssh.output;
  result.ok = ssh.failure == SshFailure::kNone && ssh.exitStatus == 0;
  if (!result.ok) result.message = ssh.message.empty() ? lastLines(ssh.output, 4) : ssh.message;
  return result;
}

}  // namespace varuna
