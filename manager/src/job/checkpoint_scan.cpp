#include "varuna/manager/checkpoint_scan.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

namespace varuna {
namespace {

namespace fs = std::filesystem;

// The step the store's pointer names, if it has a readable one.
std::optional<int64_t> readPointer(const fs::path& store) {
  std::error_code ec;
  if (!fs::exists(store / ckpt::kLatest, ec)) return std::nullopt;
  try {
    const std::string text = ckpt::readFile(store / ckpt::kLatest);
    size_t used = 0;
    const int64_t step = std::stoll(text, &used);
    if (text.find_first_not_of(" \t\r\n", used) != std::string::npos) return std::nullopt;
    return step;
  } catch (const std::exception&) {  // half-written by hand, or unreadable: list instead
    return std::nullopt;
  }
}

// The pointer's checkpoint is usable: complete, not marked damaged, and
// (unless it is `known`) its files have the sizes of its manifest.
bool usable(const fs::path& store, int64_t step, std::optional<int64_t> known) {
  const fs::path dir = ckpt::checkpointDir(store, step);
  std::error_code ec;
  if (fs::exists(dir / ckpt::kDamaged, ec) || ec) return false;
  if (known && *known == step) return ckpt::isComplete(dir);
  try {
    ckpt::verify(dir, {}, /*checksums=*/false);
    return true;
  } catch (const std::exception&) {  // the listing says why
    return false;
  }
}

}  // namespace

std::optional<double> checkpointAgeSeconds(const std::string& globalStore, int64_t step) {
  std::error_code ec;
  const auto marker = ckpt::checkpointDir(globalStore, step) / ckpt::kMarker;
  const auto completed = std::filesystem::last_write_time(marker, ec);
  if (ec) return std::nullopt;
  // On the clock the file times are on: no conversion to another.
  const auto age = std::filesystem::file_time_type::clock::now() - completed;
  return std::max(0.0, std::chrono::duration<double>(age).count());
}

StoreScan scanCheckpointStore(const StoreScanRequest& request) {
  StoreScan scan;
  try {
    if (!request.thorough) {
      const auto pointer = readPointer(request.globalStore);
      if (pointer && usable(request.globalStore, *pointer, request.known)) {
        scan.latest = pointer;
        if (pointer != request.known) scan.latestAgeSeconds = checkpointAgeSeconds(request.globalStore, *pointer);
        return scan;
      }
    }
    scan.listed = true;
    scan.latest = ckpt::latestComplete(request.globalStore, &scan.skipped);
    if (scan.latest && scan.latest != request.known) scan.latestAgeSeconds = checkpointAgeSeconds(request.globalStore, *scan.latest);
  } catch (const std::exception& e) {
    scan = StoreScan{};
    scan.listed = true;
    scan.error = e.what();
    if (scan.error.empty()) scan.error = "unknown error";
  }
  return scan;
}

}  // namespace varuna
