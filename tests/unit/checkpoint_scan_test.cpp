// The manager's look at the checkpoint store (scanCheckpointStore): the
// `latest` pointer first, the listing when the pointer cannot be trusted.
#include <catch2/catch.hpp>

#include <fstream>

#include "test_env.h"
#include "varuna/manager/checkpoint_scan.h"

using namespace varuna;
namespace fs = std::filesystem;

namespace {

// A one-rank checkpoint of `step`, completed (and the pointer moved) as a worker does it.
void writeCheckpoint(const fs::path& store, int64_t step) {
  const ckpt::WriterIdentity writer{1, ckpt::runTag(1, "test"), 0, 1};
  const auto entry = ckpt::writeFileAtomic(ckpt::partialDir(store, step, writer.run), "piece_0.params.pt",
                                           std::string(300, 'p') + std::to_string(step));
  ckpt::writePart(store, step, writer, {entry});
  REQUIRE(ckpt::finalize(store, step, writer) == ckpt::Finalized::kCompleted);
}

}  // namespace

TEST_CASE("store scan: the pointer answers without a listing; the listing when it cannot", "[scan]") {
  const auto store = test::scratchDir("scan-pointer");
  // An empty store: nothing, no error.
  auto scan = scanCheckpointStore({store.string(), false, std::nullopt});
  CHECK_FALSE(scan.latest);
  CHECK(scan.error.empty());
  CHECK(scan.listed);  // no pointer

  writeCheckpoint(store, 10);
  writeCheckpoint(store, 20);
  scan = scanCheckpointStore({store.string(), false, std::nullopt});
  CHECK(scan.latest == 20);
  CHECK_FALSE(scan.listed);
  // A thorough scan lists (and agrees).
  scan = scanCheckpointStore({store.string(), true, std::nullopt});
  CHECK(scan.latest == 20);
  CHECK(scan.listed);

  // A pointer left behind (its writer died between the rename and the
  // pointer): the quick scan trusts it, the thorough one finds the newer one.
  ckpt::writeFileAtomic(store, ckpt::kLatest, "10\n");
  CHECK(scanCheckpointStore({store.string(), false, std::nullopt}).latest == 10);
  CHECK(scanCheckpointStore({store.string(), true, std::nullopt}).latest == 20);
  ckpt::writeFileAtomic(store, ckpt::kLatest, "20\n");

  // A file of the newest one truncated: its sizes no longer match, so the
  // listing passes over it and says why.
  {
    std::ofstream truncate(ckpt::checkpointDir(store, 20) / "piece_0.params.pt", std::ios::trunc);
  }
  scan = scanCheckpointStore({store.string(), false, std::nullopt});
  CHECK(scan.latest == 10);
  CHECK(scan.listed);
  REQUIRE(scan.skipped.size() == 1);
  CHECK(scan.skipped[0].step == 20);
  // ... unless it was seen usable before: a complete checkpoint's files are
  // not looked at again every second (a loader that finds damage marks it).
  CHECK(scanCheckpointStore({store.string(), false, 20}).latest == 20);
  ckpt::markDamaged(ckpt::checkpointDir(store, 20), "piece_0.params.pt is truncated");
  scan = scanCheckpointStore({store.string(), false, 20});
  CHECK(scan.latest == 10);
  REQUIRE(scan.skipped.size() == 1);
  CHECK_THAT(scan.skipped[0].reason, Catch::Contains("marked damaged"));

  // A pointer that is not a number, or names a checkpoint that is gone: the listing.
  ckpt::writeFileAtomic(store, ckpt::kLatest, "twenty\n");
  CHECK(scanCheckpointStore({store.string(), false, std::nullopt}).latest == 10);
  ckpt::writeFileAtomic(store, ckpt::kLatest, "30\n");
  scan = scanCheckpointStore({store.string(), false, std::nullopt});
  CHECK(scan.latest == 10);
  CHECK(scan.listed);
}

TEST_CASE("store scan: a store that is not a folder gives no checkpoint and no exception", "[scan]") {
  const auto dir = test::scratchDir("scan-error");
  // A file where the store's folder should be.
  std::ofstream(dir / "store") << "not a folder";
  StoreScan scan;
  REQUIRE_NOTHROW(scan = scanCheckpointStore({(dir / "store").string(), true, std::nullopt}));
  CHECK_FALSE(scan.latest);
}

TEST_CASE("store scan: the age of a newly found checkpoint comes from its marker", "[scan]") {
  // What a restarted manager reports as varuna_last_checkpoint_age_seconds:
  // the checkpoint's own age, not the time since this process saw it.
  const auto store = test::scratchDir("scan-age");
  writeCheckpoint(store, 30);
  const auto marker = ckpt::checkpointDir(store, 30) / ckpt::kMarker;
  fs::last_write_time(marker, fs::file_time_type::clock::now() - std::chrono::hours(2));
  for (bool thorough : {false, true}) {
    const auto scan = scanCheckpointStore({store.string(), thorough, std::nullopt});
    REQUIRE(scan.latestAgeSeconds);
    CHECK(*scan.latestAgeSeconds == Approx(7200).margin(60));
  }
  // Known to the caller already: not looked at again.
  CHECK_FALSE(scanCheckpointStore({store.string(), false, 30}).latestAgeSeconds);
}
