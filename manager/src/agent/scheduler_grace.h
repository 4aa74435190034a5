// The grace time a scheduler gives a job it preempts, read where the agent
// can see it: Slurm's partition GraceTime (`scontrol show partition
// $SLURM_JOB_PARTITION`). `varuna_agent --sigterm_notice_s auto` takes its
// SIGTERM as a notice that the host goes that long after it. (Kubernetes
// shows a pod its terminationGracePeriodSeconds nowhere: give it in seconds.)
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace varuna {

// Slurm's durations: seconds ("30"), "MM:SS", "HH:MM:SS" or "D-HH:MM:SS".
std::optional<int64_t> parseSlurmSeconds(const std::string& text);

// GraceTime=... in `scontrol show partition` output; nullopt if absent or malformed.
std::optional<int64_t> graceTimeFromPartition(const std::string& scontrolOutput);

// This job's partition's GraceTime, asking scontrol (on PATH) for
// $SLURM_JOB_PARTITION. Throws ConfigError saying what is missing.
std::chrono::milliseconds slurmGraceTime();

}  // namespace varuna
