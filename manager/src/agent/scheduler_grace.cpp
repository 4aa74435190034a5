#include "agent/scheduler_grace.h"

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <regex>

#include "varuna/common/errors.h"

namespace varuna {

std::optional<int64_t> parseSlurmSeconds(const std::string& text) {
  static const std::regex form(R"(^(?:(\d{1,4})-)?(\d{1,7})(?::(\d{1,2}))?(?::(\d{1,2}))?$)");
  std::smatch m;
  if (!std::regex_match(text, m, form)) return std::nullopt;
  const int64_t days = m[1].matched ? std::stoll(m[1]) : 0;
  // 1 field: seconds; 2: MM:SS; 3: HH:MM:SS.
  int64_t fields[3] = {std::stoll(m[2]), m[3].matched ? std::stoll(m[3]) : -1, m[4].matched ? std::stoll(m[4]) : -1};
  int64_t seconds = 0;
  for (int64_t f : fields) {
    if (f < 0) break;
    seconds = seconds * 60 + f;
  }
  if (days > 0 && !m[4].matched) return std::nullopt;  // D- goes with HH:MM:SS only
  return days * 86400 + seconds;
}

std::optional<int64_t> graceTimeFromPartition(const std::string& scontrolOutput) {
  static const std::regex field(R"((?:^|\s)GraceTime=(\S+))");
  std::smatch m;
  if (!std::regex_search(scontrolOutput, m, field)) return std::nullopt;
  return parseSlurmSeconds(m[1]);
}

std::chrono::milliseconds slurmGraceTime() {
  const char* partition = std::getenv("SLURM_JOB_PARTITION");
  if (!partition || !*partition) {
    throw ConfigError("--sigterm_notice_s auto reads the Slurm partition's GraceTime, but SLURM_JOB_PARTITION is not "
                      "set (not a Slurm job?): give the grace in seconds");
  }
  const std::string name = partition;
  if (name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.") != std::string::npos) {
    throw ConfigError(strCat("SLURM_JOB_PARTITION '", name, "' is not a partition name"));
  }
  const std::string command = "scontrol show partition " + name + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) throw ConfigError("--sigterm_notice_s auto: cannot run scontrol");
  std::string output;
  std::array<char, 4096> buffer{};
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  const auto grace = graceTimeFromPartition(output);
  if (status != 0 || !grace) {
    throw ConfigError(strCat("--sigterm_notice_s auto: no GraceTime in `scontrol show partition ", name,
                             "` (exit ", WIFEXITED(status) ? WEXITSTATUS(status) : -1, "): ", output.substr(0, 300),
                             "; give the grace in seconds"));
  }
  return std::chrono::seconds(*grace);
}

}  // namespace varuna
