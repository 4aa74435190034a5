#include "varuna/common/checkpoint_files.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
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
void publish(const fs::path& target, const std::function<void(int fd, const fs::path& tmp)>& fill) {
  fs::create_directories(target.parent_path());
  const fs::path tmp = target.string() + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) ioError("cannot create", tmp);
  try {
    fill(fd, tmp);
    if (::fsync(fd) != 0) ioError("cannot fsync", tmp);
  } catch (...) {
    ::close(fd);
    fs::remove(tmp);
    throw;
  }
  ::close(fd);
  std::error_code ec;
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
    throw CheckpointError(strCat("'", path.string(), "' is not a valid file list: ", e.what()));
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

void writePart(const fs::path& dir, int rank, const std::vector<FileEntry>& files) {
  json j;
  j["rank"] = rank;
  j["files"] = json::array();
  for (const auto& f : files) j["files"].push_back(entryToJson(f));
  writeFileAtomic(dir / "parts", "rank_" + std::to_string(rank) + ".json", j.dump());
}

bool finalize(const fs::path& globalStore, int64_t step, int worldSize) {
  const fs::path dir = checkpointDir(globalStore, step);
  std::map<std::string, FileEntry> files;
  for (int r = 0; r < worldSize; ++r) {
    const fs::path part = dir / "parts" / ("rank_" + std::to_string(r) + ".json");
    if (!fs::exists(part)) return false;
    for (auto& e : readEntries(part)) files[e.name] = e;
  }
  json manifest;
  manifest["step"] = step;
  manifest["files"] = json::array();
  for (const auto& [name, e] : files) manifest["files"].push_back(entryToJson(e));
  writeFileAtomic(dir, kManifest, manifest.dump(1));
  writeFileAtomic(dir, kMarker, std::to_string(step) + "\n");
  // The pointer only moves forward; latestComplete() does not depend on it.
  int64_t current = -1;
  try {
    current = std::stoll(readFile(globalStore / kLatest));
  } catch (const std::exception&) {
  }
  if (step > current) writeFileAtomic(globalStore, kLatest, std::to_string(step) + "\n");
  return true;
}

bool isComplete(const fs::path& dir) { return fs::exists(dir / kMarker); }

std::vector<FileEntry> readManifest(const fs::path& dir) { return readEntries(dir / kManifest); }

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
      throw CheckpointError(strCat("checkpoint '", dir.string(), "' has no file '", name, "' in its manifest"));
    }
    const fs::path path = dir / name;
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (ec) throw CheckpointError(strCat("checkpoint '", dir.string(), "': file '", name, "' is missing"));
    if (size != it->second.size) {
      throw CheckpointError(strCat("checkpoint '", dir.string(), "': file '", name, "' has ", size,
                                   " bytes, the manifest says ", it->second.size, " (truncated or overwritten)"));
    }
    if (checksums && crc32(readFile(path)) != it->second.crc32) {
      throw CheckpointError(strCat("checkpoint '", dir.string(), "': file '", name,
                                   "' fails its checksum (corrupted)"));
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

std::optional<int64_t> latestComplete(const fs::path& globalStore) {
  for (int64_t step : listCheckpoints(globalStore)) {
    try {
      verify(checkpointDir(globalStore, step), {}, /*checksums=*/false);
      return step;
    } catch (const CheckpointError&) {
      // Interrupted or damaged: fall back to the previous one.
    }
  }
  return std::nullopt;
}

}  // namespace varuna::ckpt
