#include "varuna/common/checkpoint_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <chrono>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>

namespace varuna::ckpt {
namespace {

using nlohmann::json;

[[noreturn]] void ioError(const std::string& what, const fs::path& path) {
  throw CheckpointError(strCat(what, " '", path.string(), "': ", std::strerror(errno)));
}

void fsyncPath(const fs::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) ioError("cannot open", path);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) ioError("cannot fsync", path);
}

void writeAll(int fd, std::string_view bytes, const fs::path& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) ioError("cannot write", path);
    done += static_cast<size_t>(n);
  }
}

// tmp file in the same directory, fsync, rename, fsync the directory.
void publish(const fs::path& target, const std::function<void(int fd, const fs::path& tmp)>& fill, mode_t mode = 0644) {
  std::error_code ec;
  fs::create_directories(target.parent_path(), ec);
  if (ec) {
    throw CheckpointError(strCat("cannot create the folder '", target.parent_path().string(), "': ", ec.message()));
  }
  const fs::path tmp = target.string() + ".tmp." + std::to_string(::getpid());
  // A new file, never one (or a link) that was already there: a leftover of
  // a process that had this pid is removed first (unlink removes a link,
  // not what it points at).
  constexpr int kFlags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  int fd = ::open(tmp.c_str(), kFlags, mode);
  if (fd < 0 && errno == EEXIST && ::unlink(tmp.c_str()) == 0) fd = ::open(tmp.c_str(), kFlags, mode);
  if (fd < 0) ioError("cannot create", tmp);
  try {
    fill(fd, tmp);
    if (::fsync(fd) != 0) ioError("cannot fsync", tmp);
  } catch (...) {
    ::close(fd);
    fs::remove(tmp, ec);
    throw;
  }
  if (::close(fd) != 0) {  // NFS reports a failed write-back here
    const int saved = errno;
    fs::remove(tmp, ec);
    errno = saved;
    ioError("cannot close", tmp);
  }
  fs::rename(tmp, target, ec);
  if (ec) throw CheckpointError(strCat("cannot rename '", tmp.string(), "' to '", target.string(), "': ", ec.message()));
  fsyncPath(target.parent_path(), O_RDONLY | O_DIRECTORY);
}

json entryToJson(const FileEntry& e) { return {{"name", e.name}, {"size", e.size}, {"crc32", e.crc32}}; }
FileEntry entryFromJson(const json& j) { return {j.at("name"), j.at("size"), j.at("crc32")}; }

std::vector<FileEntry> readEntries(const fs::path& path) {
  std::vector<FileEntry> entries;
  try {
    const json parsed = json::parse(readFile(path));  // named: at() returns a reference into it
    for (const auto& j : parsed.at("files")) entries.push_back(entryFromJson(j));
  } catch (const json::exception& e) {
    throw DamagedError(strCat("'", path.string(), "' is not a valid file list: ", e.what()));
  }
  return entries;
}

}  // namespace

fs::path checkpointDir(const fs::path& globalStore, int64_t step) {
  return globalStore / ("varuna_ckpt_" + std::to_string(step));
}

uint32_t crc32(std::string_view bytes, uint32_t previous) {
  uLong crc = previous;
  const auto* data = reinterpret_cast<const Bytef*>(bytes.data());
  size_t left = bytes.size();
  while (left > 0) {  // zlib takes 32-bit lengths
    const uInt chunk = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
    crc = ::crc32(crc, data, chunk);
    data += chunk;
    left -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

FileEntry writeFileAtomic(const fs::path& dir, const std::string& name, std::string_view bytes) {
  publish(dir / name, [&](int fd, const fs::path& tmp) { writeAll(fd, bytes, tmp); });
  return {name, bytes.size(), crc32(bytes)};
}

FileEntry writePrivateFileAtomic(const fs::path& dir, const std::string& name, std::string_view bytes) {
  // 0600 from its creation (no umask change, which would reach every thread
  // of the process): a secret is never readable by others, not even briefly.
  publish(dir / name, [&](int fd, const fs::path& tmp) {
    if (::fchmod(fd, 0600) != 0) ioError("cannot restrict", tmp);
    writeAll(fd, bytes, tmp);
  }, 0600);
  return {name, bytes.size(), crc32(bytes)};
}

FileEntry writeFileStreaming(const fs::path& dir, const std::string& name, const std::function<void(const Sink&)>& produce) {
  FileEntry entry{name, 0, 0};
  publish(dir / name, [&](int fd, const fs::path& tmp) {
    produce([&](const void* data, size_t size) {
      const std::string_view chunk(static_cast<const char*>(data), size);
      writeAll(fd, chunk, tmp);
      entry.crc32 = crc32(chunk, entry.crc32);
      entry.size += size;
    });
  });
  return entry;
}

void copyFileAtomic(const fs::path& from, const fs::path& to) {
  const int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) ioError("cannot open", from);
  try {
    publish(to, [&](int fd, const fs::path& tmp) {
      std::vector<char> buffer(8 << 20);
      while (true) {
        const ssize_t n = ::read(in, buffer.data(), buffer.size());
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) ioError("cannot read", from);
        if (n == 0) break;
        writeAll(fd, std::string_view(buffer.data(), static_cast<size_t>(n)), tmp);
      }
    });
  } catch (...) {
    ::close(in);
    throw;
  }
  ::close(in);
}

std::string readFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(strCat("cannot read '", path.string(), "': it does not exist or is unreadable"));
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::string runTag(int64_t generation, const std::string& randomTag) {
  return generation >= 0 ? strCat("g", generation) : strCat("r", randomTag);
}

fs::path partialDir(const fs::path& globalStore, int64_t step, const std::string& run) {
  return globalStore / strCat("varuna_ckpt_", step, ".", run, ".partial");
}

void writePart(const fs::path& globalStore, int64_t step, const WriterIdentity& writer,
               const std::vector<FileEntry>& files) {
  json j;
  j["rank"] = writer.rank;
  j["generation"] = writer.generation;
  j["run"] = writer.run;
  j["world_size"] = writer.worldSize;
  j["files"] = json::array();
  for (const auto& f : files) j["files"].push_back(entryToJson(f));
  writeFileAtomic(partialDir(globalStore, step, writer.run) / "parts", strCat("rank_", writer.rank, ".json"), j.dump());
}

namespace {

// The files of rank r's part, or nullopt when the part is missing or was
// written by another run or world size (a leftover: never combined).
std::optional<std::vector<FileEntry>> readPartOf(const fs::path& dir, int rank, const WriterIdentity& writer) {
  const fs::path path = dir / "parts" / strCat("rank_", rank, ".json");
  std::string bytes;
  try {
    bytes = readFile(path);
  } catch (const CheckpointError&) {
    return std::nullopt;  // not written yet, or the folder was just renamed into place
  }
  std::vector<FileEntry> entries;
  try {
    const json part = json::parse(bytes);
    if (part.at("run").get<std::string>() != writer.run || part.at("world_size").get<int>() != writer.worldSize ||
        part.at("generation").get<int64_t>() != writer.generation) {
      return std::nullopt;
    }
    for (const auto& j : part.at("files")) entries.push_back(entryFromJson(j));
  } catch (const json::exception&) {
    return std::nullopt;  // a part of an older format
  }
  return entries;
}

// Another folder in the way of the rename (an interrupted checkpoint of an
// older version): moved aside, never mixed in; retention removes it.
void moveAside(const fs::path& dir) {
  const fs::path aside = strCat(dir.string(), ".stale.", ::getpid(), ".",
                                std::chrono::steady_clock::now().time_since_epoch().count());
  std::error_code ec;
  fs::rename(dir, aside, ec);
  if (ec && fs::exists(dir)) {
    throw CheckpointError(strCat("cannot move the interrupted checkpoint '", dir.string(), "' aside: ", ec.message()));
  }
}

void movePointerForward(const fs::path& globalStore, int64_t step) {
  int64_t current = -1;
  try {
    current = std::stoll(readFile(globalStore / kLatest));
  } catch (const std::exception&) {
  }
  if (step > current) writeFileAtomic(globalStore, kLatest, std::to_string(step) + "\n");
}

}  // namespace

Finalized finalize(const fs::path& globalStore, int64_t step, const WriterIdentity& writer) {
  const fs::path target = checkpointDir(globalStore, step);
  if (isIntact(target)) return Finalized::kAlreadyComplete;
  const fs::path dir = partialDir(globalStore, step, writer.run);
  std::map<std::string, FileEntry> files;
  for (int r = 0; r < writer.worldSize; ++r) {
    auto part = readPartOf(dir, r, writer);
    // Missing: still to come, or another rank completed the checkpoint and
    // renamed the folder between our look and our read.
    if (!part) return isIntact(target) ? Finalized::kAlreadyComplete : Finalized::kWaiting;
    for (auto& e : *part) files[e.name] = e;
  }
  checkNotSuperseded(globalStore, writer.generation);
  // One finaliser: when two parts land at once both ranks see the full set;
  // the one that creates the claim completes the checkpoint.
  const fs::path claim = dir / "FINALIZING";
  const int fd = ::open(claim.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == EEXIST) return Finalized::kWaiting;  // another rank is completing it
    if (errno == ENOENT && isIntact(target)) return Finalized::kAlreadyComplete;  // and has
    ioError("cannot create", claim);
  }
  ::close(fd);
  json manifest;
  manifest["step"] = step;
  manifest["generation"] = writer.generation;
  manifest["run"] = writer.run;
  manifest["world_size"] = writer.worldSize;
  manifest["files"] = json::array();
  for (const auto& [name, e] : files) manifest["files"].push_back(entryToJson(e));
  try {
    writeFileAtomic(dir, kManifest, manifest.dump(1));
    writeFileAtomic(dir, kMarker, std::to_string(step) + "\n");
  } catch (...) {
    std::error_code ignored;
    fs::remove(claim, ignored);  // a later attempt (e.g. the on-demand one) may try again
    throw;
  }
  fs::remove(claim);
  if (fs::exists(target)) {
    if (isIntact(target)) return Finalized::kAlreadyComplete;
    moveAside(target);  // interrupted, or marked damaged: replaced by this one
  }
  // The commit point: the folder appears complete under its final name at once.
  std::error_code ec;
  fs::rename(dir, target, ec);
  if (ec) {
    // Another run completed this step meanwhile (a periodic checkpoint and a
    // salvage of the same step): it is there, which is what counts.
    if (isIntact(target)) return Finalized::kAlreadyComplete;
    throw CheckpointError(strCat("cannot rename '", dir.string(), "' to '", target.string(), "': ", ec.message()));
  }
  fsyncPath(globalStore, O_RDONLY | O_DIRECTORY);
  movePointerForward(globalStore, step);  // latestComplete() does not depend on it
  return Finalized::kCompleted;
}

std::optional<int64_t> recordedGeneration(const fs::path& globalStore) {
  const fs::path path = globalStore / kJobFile;
  if (!fs::exists(path)) return std::nullopt;
  try {
    const json j = json::parse(readFile(path));
    if (j.is_object() && j.contains("generation") && j["generation"].is_number_integer()) {
      return j["generation"].get<int64_t>();
    }
  } catch (const json::exception&) {
  } catch (const CheckpointError&) {
  }
  return std::nullopt;
}

void recordGeneration(const fs::path& globalStore, int64_t generation) {
  json j = json::object();
  const fs::path path = globalStore / kJobFile;
  if (fs::exists(path)) {
    try {
      j = json::parse(readFile(path));
      if (!j.is_object()) j = json::object();
    } catch (const json::exception&) {
      j = json::object();
    }
  }
  j["generation"] = generation;
  writeFileAtomic(globalStore, kJobFile, j.dump() + "\n");
}

void checkNotSuperseded(const fs::path& globalStore, int64_t generation) {
  if (generation < 0) return;
  const auto recorded = recordedGeneration(globalStore);
  if (recorded && *recorded > generation) {
    throw SupersededError(strCat("generation ", generation, " was superseded by generation ", *recorded,
                                 " (recorded in ", (globalStore / kJobFile).string(),
                                 "): this worker must not write the checkpoint store any more"));
  }
}

void markDamaged(const fs::path& dir, const std::string& reason) {
  if (!fs::is_directory(dir) || fs::exists(dir / kDamaged)) return;
  writeFileAtomic(dir, kDamaged, reason + "\n");
}

bool isComplete(const fs::path& dir) { return fs::exists(dir / kMarker); }

bool isIntact(const fs::path& dir) { return isComplete(dir) && !fs::exists(dir / kDamaged); }

std::vector<FileEntry> readManifest(const fs::path& dir) { return readEntries(dir / kManifest); }

std::string readVerified(const fs::path& dir, const std::vector<FileEntry>& manifest, const std::string& name) {
  auto it = std::find_if(manifest.begin(), manifest.end(), [&](const FileEntry& e) { return e.name == name; });
  if (it == manifest.end()) {
    throw DamagedError(strCat("checkpoint '", dir.string(), "' has no file '", name, "' in its manifest"));
  }
  if (!fs::exists(dir / name)) throw DamagedError(strCat("checkpoint '", dir.string(), "': file '", name, "' is missing"));
  std::string bytes = readFile(dir / name);
  if (bytes.size() != it->size) {
    throw DamagedError(strCat("checkpoint '", dir.string(), "': file '", name, "' has ", bytes.size(),
                                 " bytes, the manifest says ", it->size, " (truncated or overwritten)"));
  }
  if (crc32(bytes) != it->crc32) {
    throw DamagedError(strCat("checkpoint '", dir.string(), "': file '", name, "' fails its checksum (corrupted)"));
  }
  return bytes;
}

void verify(const fs::path& dir, const std::vector<std::string>& only, bool checksums) {
  if (!fs::is_directory(dir)) throw CheckpointError(strCat("checkpoint '", dir.string(), "' does not exist"));
  if (!isComplete(dir)) {
    throw CheckpointError(strCat("checkpoint '", dir.string(), "' is incomplete: its ", kMarker,
                                 " marker is missing (the write was interrupted)"));
  }
  const auto entries = readManifest(dir);
  std::map<std::string, FileEntry> byName;
  for (const auto& e : entries) byName[e.name] = e;
  std::vector<std::string> names = only;
  if (names.empty()) {
    for (const auto& e : entries) names.push_back(e.name);
  }
  for (const auto& name : names) {
    auto it = byName.find(name);
    if (it == byName.end()) {
      throw DamagedError(strCat("checkpoint '", dir.string(), "' has no file '", name, "' in its manifest"));
    }
    const fs::path path = dir / name;
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (ec) throw DamagedError(strCat("checkpoint '", dir.string(), "': file '", name, "' is missing"));
    if (size != it->second.size) {
      throw DamagedError(strCat("checkpoint '", dir.string(), "': file '", name, "' has ", size,
                                   " bytes, the manifest says ", it->second.size, " (truncated or overwritten)"));
    }
    if (checksums && crc32(readFile(path)) != it->second.crc32) {
      throw DamagedError(strCat("checkpoint '", dir.string(), "': file '", name, "' fails its checksum (corrupted)"));
    }
  }
}

std::vector<int64_t> listCheckpoints(const fs::path& globalStore) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(globalStore, ec)) {
    const std::string name = entry.path().filename().string();
    constexpr std::string_view prefix = "varuna_ckpt_";
    if (!entry.is_directory() || name.rfind(prefix, 0) != 0) continue;
    try {
      size_t used = 0;
      const int64_t step = std::stoll(name.substr(prefix.size()), &used);
      if (used == name.size() - prefix.size()) steps.push_back(step);
    } catch (const std::exception&) {
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::vector<int64_t> completeCheckpoints(const fs::path& globalStore, size_t limit,
                                         std::vector<SkippedCheckpoint>* skipped) {
  std::vector<int64_t> complete;
  for (int64_t step : listCheckpoints(globalStore)) {
    const fs::path dir = checkpointDir(globalStore, step);
    if (!isComplete(dir)) continue;  // interrupted: not a candidate, nothing to report
    std::string reason;
    if (fs::exists(dir / kDamaged)) {
      std::string why;
      try {
        why = readFile(dir / kDamaged);
      } catch (const CheckpointError&) {
      }
      while (!why.empty() && (why.back() == '\n' || why.back() == '\r')) why.pop_back();
      reason = strCat("marked damaged: ", why);
    } else {
      try {
        verify(dir, {}, /*checksums=*/false);
      } catch (const CheckpointError& e) {
        reason = e.what();
      }
    }
    if (!reason.empty()) {
      if (skipped) skipped->push_back({step, reason});
      continue;
    }
    complete.push_back(step);
    if (limit > 0 && complete.size() >= limit) break;
  }
  return complete;
}

std::optional<int64_t> latestComplete(const fs::path& globalStore, std::vector<SkippedCheckpoint>* skipped) {
  const auto steps = completeCheckpoints(globalStore, 1, skipped);
  if (steps.empty()) return std::nullopt;
  return steps.front();
}

namespace {

// "varuna_ckpt_<step>.<run>.partial" -> (step, run); nullopt for other names.
std::optional<std::pair<int64_t, std::string>> parsePartialName(const std::string& name) {
  constexpr std::string_view prefix = "varuna_ckpt_", suffix = ".partial";
  if (name.rfind(prefix, 0) != 0 || name.size() <= prefix.size() + suffix.size() ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return std::nullopt;
  }
  const std::string middle = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  const size_t dot = middle.find('.');
  if (dot == std::string::npos) return std::nullopt;
  try {
    size_t used = 0;
    const int64_t step = std::stoll(middle.substr(0, dot), &used);
    if (used != dot) return std::nullopt;
    return std::make_pair(step, middle.substr(dot + 1));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// A partial folder that can never complete: its step is already covered by a
// complete checkpoint (every run finishes its earlier checkpoints before a
// later one completes), or its generation was superseded.
bool partialIsDead(int64_t step, const std::string& run, std::optional<int64_t> newest, int64_t currentGeneration) {
  if (newest && step <= *newest) return true;
  if (currentGeneration >= 0 && run.size() > 1 && run[0] == 'g') {
    try {
      return std::stoll(run.substr(1)) < currentGeneration;
    } catch (const std::exception&) {
    }
  }
  return false;
}

// Temporary files of writes that died (a live write's file is seconds old).
bool isStaleTemporary(const fs::directory_entry& entry) {
  const std::string name = entry.path().filename().string();
  if (name.find(".tmp.") == std::string::npos || !entry.is_regular_file()) return false;
  std::error_code ec;
  const auto age = fs::file_time_type::clock::now() - fs::last_write_time(entry.path(), ec);
  return !ec && age > std::chrono::minutes(10);
}

}  // namespace

std::vector<fs::path> applyRetention(const fs::path& globalStore, int keep, int64_t currentGeneration) {
  std::vector<fs::path> removed;
  auto remove = [&removed](const fs::path& path) {
    std::error_code ec;
    fs::remove_all(path, ec);
    if (!ec) removed.push_back(path);
  };
  // A checkpoint is first renamed out of its place (atomic: a reader sees it
  // whole or not at all, never complete-looking with files gone), then removed.
  auto retire = [&](const fs::path& dir) {
    fs::path aside = dir;
    aside += strCat(".stale.retired.", ::getpid());
    std::error_code ec;
    fs::rename(dir, aside, ec);
    remove(ec ? dir : aside);
    if (!ec && !removed.empty() && removed.back() == aside) removed.back() = dir;
  };
  const auto complete = completeCheckpoints(globalStore);
  const std::optional<int64_t> newest = complete.empty() ? std::nullopt : std::optional<int64_t>(complete.front());
  std::set<int64_t> kept(complete.begin(), complete.end());
  if (keep > 0) {
    for (size_t i = static_cast<size_t>(keep); i < complete.size(); ++i) kept.erase(complete[i]);
  }
  for (int64_t step : listCheckpoints(globalStore)) {
    // Older than the newest complete checkpoint and not kept: old, damaged or
    // interrupted. Newer ones may still be in progress (or are the newest).
    if (newest && step < *newest && !kept.count(step)) retire(checkpointDir(globalStore, step));
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(globalStore, ec)) {
    const std::string name = entry.path().filename().string();
    if (auto partial = parsePartialName(name)) {
      if (partialIsDead(partial->first, partial->second, newest, currentGeneration)) remove(entry.path());
    } else if (name.rfind("varuna_ckpt_", 0) == 0 && name.find(".stale.") != std::string::npos) {
      remove(entry.path());
    } else if (isStaleTemporary(entry)) {
      remove(entry.path());
    }
  }
  return removed;
}

}  // namespace varuna::ckpt
