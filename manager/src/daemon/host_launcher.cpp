#include "varuna/manager/host_launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

#include "varuna/common/errors.h"

namespace varuna {
namespace {

using Clock = std::chrono::steady_clock;

std::string lastLines(const std::string& text, int n) {
  size_t pos = text.size();
  if (pos > 0 && text[pos - 1] == '\n') --pos;
  for (int i = 0; i < n && pos != std::string::npos && pos > 0; ++i) pos = text.rfind('\n', pos - 1);
  return pos == std::string::npos || pos == 0 ? text : text.substr(pos + 1);
}

}  // namespace

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
                                  const std::string& input) {
  HostCommandResult result;
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
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
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
  if (isLocalHost(host)) return runLocalCommand(command, ssh_.commandTimeout, input);
  const SshResult ssh = runOverSsh(host, command, ssh_, input);
  HostCommandResult result;
  result.exitStatus = ssh.exitStatus;
  result.output = ssh.output;
  result.ok = ssh.failure == SshFailure::kNone && ssh.exitStatus == 0;
  if (!result.ok) result.message = ssh.message.empty() ? lastLines(ssh.output, 4) : ssh.message;
  return result;
}

}  // namespace varuna
