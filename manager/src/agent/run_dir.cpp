#include "agent/run_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <string>

#include "varuna/common/errors.h"

namespace varuna {

namespace fs = std::filesystem;

namespace {

std::string octal(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

[[noreturn]] void refuse(const fs::path& dir, const std::string& why) {
  throw ConfigError(strCat("the agent's run folder ", dir.string(), " ", why,
                           ": another user may have planted it. Remove it (as its owner or root) or give "
                           "varuna_agent another --run_dir"));
}

// mkdir with exactly `mode` (the umask would take bits off), unless it exists.
void makeFolder(const fs::path& dir, mode_t mode) {
  if (::mkdir(dir.c_str(), mode) == 0) {
    ::chmod(dir.c_str(), mode);
  } else if (errno != EEXIST) {
    throw ConfigError(strCat("cannot create the agent's run folder ", dir.string(), ": ", std::strerror(errno)));
  }
}

struct stat lstatOrRefuse(const fs::path& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    throw ConfigError(strCat("cannot inspect the agent's run folder ", dir.string(), ": ", std::strerror(errno)));
  }
  if (S_ISLNK(st.st_mode)) refuse(dir, "is a symbolic link");
  if (!S_ISDIR(st.st_mode)) refuse(dir, "is not a folder");
  return st;
}

// This user's own folder, writable by no one else; read access is taken away.
void checkPrivate(const fs::path& dir) {
  const struct stat st = lstatOrRefuse(dir);
  if (st.st_uid != ::geteuid()) refuse(dir, strCat("belongs to uid ", st.st_uid, ", not to this user (uid ", ::geteuid(), ")"));
  if (st.st_mode & (S_IWGRP | S_IWOTH)) refuse(dir, strCat("is writable by others (mode ", octal(st.st_mode), ")"));
  if ((st.st_mode & 07777) != 0700 && ::chmod(dir.c_str(), 0700) != 0) {
    throw ConfigError(strCat("cannot make the agent's run folder ", dir.string(), " private: ", std::strerror(errno)));
  }
}

// A --run_dir's root may be a link the administrator set up (stat, not
// lstat): what matters is that others cannot move our folders out of it.
struct stat ownRootStat(const fs::path& root) {
  struct stat st {};
  if (::stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw ConfigError(strCat("the agent's run root ", root.string(), " is not a folder"));
  }
  return st;
}

// The default root (/tmp/varuna) is anyone's to create first: a link there,
// or a folder another user owns (the owner of a sticky folder may still
// rename what is in it), would hand them our folders.
struct stat sharedRootStat(const fs::path& root) {
  const struct stat st = lstatOrRefuse(root);
  if (st.st_uid != 0 && st.st_uid != ::geteuid()) {
    refuse(root, strCat("belongs to uid ", st.st_uid, ", neither root nor this user (uid ", ::geteuid(), ")"));
  }
  return st;
}

}  // namespace

void prepareRunDir(const fs::path& runDir, bool sharedRoot) {
  fs::path run = fs::absolute(runDir).lexically_normal();
  if (run.filename().empty()) run = run.parent_path();  // "a/b/" is a/b
  const fs::path job = run.parent_path();
  const fs::path root = job.parent_path();
  std::error_code ec;
  if (!fs::exists(root, ec)) {
    fs::create_directories(root.parent_path(), ec);
    makeFolder(root, sharedRoot ? 01777 : 0700);
  }
  const struct stat rootStat = sharedRoot ? sharedRootStat(root) : ownRootStat(root);
  if ((rootStat.st_mode & S_IWOTH) && !(rootStat.st_mode & S_ISVTX)) {
    refuse(root, strCat("is writable by everyone without the sticky bit (mode ", octal(rootStat.st_mode), ")"));
  }
  makeFolder(job, 0700);
  checkPrivate(job);
  makeFolder(run, 0700);
  checkPrivate(run);
}

namespace {

// G of "g<G>_rank<R>.log" (digits only), or -1 for any other name.
int logGeneration(const std::string& name) {
  auto digits = [&](size_t from, int& value) -> size_t {  // the end of the digits at `from`, or npos
    const char* begin = name.data() + from;
    const char* end = name.data() + name.size();
    if (from >= name.size() || *begin < '0' || *begin > '9') return std::string::npos;
    const auto [stop, error] = std::from_chars(begin, end, value);
    return error == std::errc() ? static_cast<size_t>(stop - name.data()) : std::string::npos;
  };
  int generation = 0;
  int rank = 0;
  if (name.rfind("g", 0) != 0) return -1;
  const size_t afterGeneration = digits(1, generation);
  if (afterGeneration == std::string::npos || name.compare(afterGeneration, 5, "_rank") != 0) return -1;
  const size_t afterRank = digits(afterGeneration + 5, rank);
  if (afterRank == std::string::npos || name.substr(afterRank) != ".log") return -1;
  return generation;
}

}  // namespace

size_t pruneWorkerLogs(const std::filesystem::path& logDir, int generation) {
  // Housekeeping: no error here may stop a launch (nothing throws).
  size_t removed = 0;
  std::error_code ec;
  std::filesystem::directory_iterator it(logDir, ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.size() > 2 && name.compare(name.size() - 2, 2, ".1") == 0) name.resize(name.size() - 2);  // capLogs' copy
    const int logOf = logGeneration(name);
    if (logOf < 0 || logOf > generation - kKeptLogGenerations) continue;
    if (::unlink(it->path().c_str()) == 0) ++removed;  // a link is removed, never followed
  }
  return removed;
}

namespace {

// Writes all of `data` (a short write or a signal is not an error).
bool writeAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// Appends `length` bytes of `in` from `offset` to `out` by reading and writing.
bool readWriteRange(int in, int out, off_t offset, uint64_t length) {
  char buffer[1 << 16];
  while (length > 0) {
    const ssize_t got = ::pread(in, buffer, std::min<uint64_t>(sizeof(buffer), length), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return false;
    if (got == 0) return true;  // the file shrank under us: what there was is copied
    if (!writeAll(out, buffer, static_cast<size_t>(got))) return false;
    offset += got;
    length -= static_cast<uint64_t>(got);
  }
  return true;
}

// Appends `length` bytes of `in` from `offset` to `out`: copy_file_range (the
// kernel copies, no buffer in this process), or read and write where the
// filesystem or the kernel cannot (some return 0 at once instead of an error).
bool copyRange(int in, int out, off_t offset, uint64_t length) {
  bool copiedAny = false;
  while (length > 0) {
    const ssize_t n = ::copy_file_range(in, &offset, out, nullptr, length, 0);
    if (n > 0) {
      length -= static_cast<uint64_t>(n);
      copiedAny = true;
      continue;
    }
    if (n == 0 && copiedAny) return true;  // the file shrank under us: what there was is copied
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EXDEV && errno != ENOSYS && errno != EINVAL && errno != EOPNOTSUPP) return false;
    return readWriteRange(in, out, offset, length);  // the kernel advanced `offset` past what it copied
  }
  return true;
}

}  // namespace

LogCut cutLog(const fs::path& log, uint64_t maxBytes) {
  // Opened without following a link, then checked by what was opened: a
  // FIFO or a device swapped in after the caller's lstat is refused before
  // anything is read from it (O_NONBLOCK keeps a device's open from waiting).
  const int in = ::open(log.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (in < 0) return LogCut::kNone;
  struct stat st {};
  if (::fstat(in, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) <= maxBytes) {
    ::close(in);
    return LogCut::kNone;
  }
  const fs::path copy(log.string() + ".1");
  ::unlink(copy.c_str());  // a link planted under the name goes, never followed
  const int out = ::open(copy.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  const uint64_t kept = std::min(size, maxBytes);  // the newest lines: the ones a reader wants
  bool copied = out >= 0 && copyRange(in, out, static_cast<off_t>(size - kept), kept);
  if (out >= 0) copied = ::close(out) == 0 && copied;
  if (!copied) ::unlink(copy.c_str());  // no half copy passed off as the log's tail
  // Cut whether or not the copy succeeded: on a full disk the copy fails,
  // and the log must stop growing all the same.
  const bool cut = ::ftruncate(in, 0) == 0;
  ::close(in);
  if (!cut) return LogCut::kNone;
  return copied ? LogCut::kCopied : LogCut::kDropped;
}

namespace {

// lstat first: most rounds find every log small, and a link or a FIFO is
// passed over without being opened.
LogCut cutIfLarge(const fs::path& log, uint64_t maxBytes) {
  struct stat st {};
  if (::lstat(log.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) <= maxBytes) {
    return LogCut::kNone;
  }
  return cutLog(log, maxBytes);
}

void count(LogCapResult& result, LogCut cut) {
  if (cut == LogCut::kCopied) ++result.cut;
  if (cut == LogCut::kDropped) ++result.dropped;
}

}  // namespace

LogCapResult capLogs(const fs::path& runDir, uint64_t maxBytes, const std::atomic<bool>* stop) {
  LogCapResult result;
  count(result, cutIfLarge(runDir / "agent.log", maxBytes));
  std::error_code ec;
  fs::directory_iterator it(runDir / "logs", ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    if (stop && stop->load()) break;  // the agent is exiting: it must not wait for more copies
    if (logGeneration(it->path().filename().string()) >= 0) count(result, cutIfLarge(it->path(), maxBytes));
  }
  return result;
}

}  // namespace varuna
