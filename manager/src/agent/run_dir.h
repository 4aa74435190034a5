// The agent's run folder (<run_root>/<job>/<host>: connection.json with the
// job token, agent.pid, logs) made safe on a host other users share: they
// must not be able to plant it, link out of it, or read what is in it.
// Called by varuna_agent's main before anything is written there.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>

namespace varuna {

// Creates `runDir` and its parent (the job's folder) with mode 0700 where
// they are missing, and the folder above them (the run root) if missing:
// with `sharedRoot` (the default /tmp/varuna, shared by every user's jobs)
// 01777, sticky so that nobody moves another's folder; else 0700. Then checks, without following symbolic links: the run folder
// and the job's folder are real folders owned by this user and writable by
// no one else (tightened to 0700 if only readable by others); the run root,
// if writable by others, is sticky. Throws ConfigError naming the folder,
// what is wrong and the fix: another user may have planted it.
void prepareRunDir(const std::filesystem::path& runDir, bool sharedRoot);

// The workers' logs kept in `logDir` (g<G>_rank<R>.log, and capLogs'
// g<G>_rank<R>.log.1) when generation
// `generation` starts: those of the last kKeptLogGenerations generations.
// Older ones are removed, so a job that morphs every few minutes for weeks
// leaves a bounded number of files; each of those is the training
// program's own output (its size is the program's). Returns how many went.
inline constexpr int kKeptLogGenerations = 10;
size_t pruneWorkerLogs(const std::filesystem::path& logDir, int generation);

// Caps the logs of a run folder by size, as logrotate's copytruncate does:
// `agent.log` and each worker's log in logs/ past `maxBytes` has its last
// `maxBytes` copied to <name>.1 (replacing the one before) and is truncated
// in place, so the process writing it through a descriptor opened with
// O_APPEND (a worker, the agent's own output) goes on at its start. Lines
// written between the copy and the cut are lost; where the copy fails (a
// full disk) the log is cut all the same, without a copy: the disk matters
// more than the old lines. Never follows a link, never reads a FIFO or a
// device planted under a log's name; nothing throws. The copy runs in the
// kernel (copy_file_range) where it can: the agent calls this off its event
// loop. `stop`, when set, ends the walk between two files (an exiting agent).
// A worker's log removed by pruneWorkerLogs meanwhile may leave its <name>.1
// behind until the next launch prunes it.
inline constexpr uint64_t kMaxLogBytes = 64ull << 20;
enum class LogCut { kNone, kCopied, kDropped };
struct LogCapResult {
  size_t cut = 0;      // copied to <name>.1, then cut
  size_t dropped = 0;  // cut without a copy (the copy failed)
};
LogCapResult capLogs(const std::filesystem::path& runDir, uint64_t maxBytes = kMaxLogBytes,
                     const std::atomic<bool>* stop = nullptr);
// One log: cut (as above) if it is a regular file past `maxBytes`, checked on
// the descriptor opened, not on the name.
LogCut cutLog(const std::filesystem::path& log, uint64_t maxBytes);

}  // namespace varuna
