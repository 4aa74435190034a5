// bench_manager_scale's readings of /proc: contention (PSI, schedstat) and a
// process's resident memory. Linux only; zeros where the kernel lacks them.
#pragma once

#include <sys/types.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>

namespace {

// Contention, which the round trips depend on: PSI's "some" stall time of
// the whole machine (microseconds some runnable task waited for a CPU), and
// /proc/PID/schedstat of the manager's event-loop thread (ns run, ns waited
// on a run queue, times scheduled). Zeros where the kernel lacks them.
inline double cpuPressureSomeSeconds() {
  std::ifstream in("/proc/pressure/cpu");
  std::string line;
  while (std::getline(in, line)) {
    const auto at = line.find("total=");
    if (line.rfind("some", 0) == 0 && at != std::string::npos) return std::stod(line.substr(at + 6)) * 1e-6;
  }
  return 0;
}

struct SchedStat {
  double runS = 0, waitS = 0;
  double slices = 0;
};
inline SchedStat schedStat(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/schedstat");
  SchedStat s;
  double runNs = 0, waitNs = 0;
  if (in >> runNs >> waitNs >> s.slices) {
    s.runS = runNs * 1e-9;
    s.waitS = waitNs * 1e-9;
  }
  return s;
}

// A process's resident set now and at its peak (VmRSS, VmHWM), MiB.
inline std::pair<double, double> residentMiB(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  double rss = 0, peak = 0;
  for (std::string line; std::getline(in, line);) {
    const auto kib = [&] { return std::atof(line.c_str() + line.find_first_of("0123456789")) / 1024; };
    if (line.rfind("VmRSS:", 0) == 0) rss = kib();
    if (line.rfind("VmHWM:", 0) == 0) peak = kib();
  }
  return {rss, peak};
}

}  // namespace
