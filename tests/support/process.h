// Child processes for multi-process tests: real fork/exec, output to files,
// waits with deadlines, SIGKILL for fault injection. Destruction kills and
// reaps whatever is still running, so no test leaves a process behind.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace varuna::test {

class ChildProcess {
 public:
  // Starts argv[0] with the current environment plus `env`; stdout and stderr
  // go to `logPrefix`.out / .err.
  ChildProcess(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
               const std::filesystem::path& logPrefix);
  ~ChildProcess();
  ChildProcess(ChildProcess&&) noexcept;
  ChildProcess(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  // Exit code (or 128+signal) once exited within `timeout`, else nullopt.
  std::optional<int> wait(std::chrono::milliseconds timeout);
  void kill(int signal);
  std::string stdoutText() const;
  std::string stderrText() const;

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
  std::filesystem::path logPrefix_;
};

// Polls `predicate` every few milliseconds until true or `timeout`; true if met.
template <typename F>
bool waitUntil(F&& predicate, std::chrono::milliseconds timeout);

std::string readText(const std::filesystem::path& path);

}  // namespace varuna::test

#include <thread>

template <typename F>
bool varuna::test::waitUntil(F&& predicate, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (predicate()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return predicate();
}
