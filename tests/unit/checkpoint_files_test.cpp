#include <catch2/catch.hpp>

#include <fstream>

#include "test_env.h"
#include "varuna/common/checkpoint_files.h"

using namespace varuna;
namespace fs = std::filesystem;

namespace {

// A two-rank checkpoint of `step` with small files; complete unless told.
void writeCheckpoint(const fs::path& store, int64_t step, bool bothRanks = true) {
  const auto dir = ckpt::checkpointDir(store, step);
  auto a = ckpt::writeFileAtomic(dir, "piece_0_a.params.pt", std::string(1000, 'a') + std::to_string(step));
  ckpt::writePart(dir, 0, {a});
  CHECK_FALSE(ckpt::finalize(store, step, 2));  // rank 1 is missing
  if (!bothRanks) return;
  auto b = ckpt::writeFileAtomic(dir, "piece_1_b.params.pt", std::string(500, 'b'));
  ckpt::writePart(dir, 1, {b});
  CHECK(ckpt::finalize(store, step, 2));
}

void flipByte(const fs::path& path, size_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c ^= 0x40;
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("a checkpoint is complete only when every part has landed", "[checkpoint]") {
  const auto store = test::scratchDir("ckpt-complete");
  writeCheckpoint(store, 10, /*bothRanks=*/false);
  CHECK_FALSE(ckpt::isComplete(ckpt::checkpointDir(store, 10)));
  CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 10)), Catch::Contains("incomplete"));
  CHECK_FALSE(ckpt::latestComplete(store).has_value());

  writeCheckpoint(store, 20);
  CHECK(ckpt::isComplete(ckpt::checkpointDir(store, 20)));
  CHECK_NOTHROW(ckpt::verify(ckpt::checkpointDir(store, 20)));
  CHECK(ckpt::readManifest(ckpt::checkpointDir(store, 20)).size() == 2);
  CHECK(ckpt::latestComplete(store) == 20);
  CHECK(ckpt::readFile(store / ckpt::kLatest) == "20\n");
  // No temporary files are left behind.
  for (const auto& e : fs::recursive_directory_iterator(store)) {
    CHECK(e.path().string().find(".tmp.") == std::string::npos);
  }
}

TEST_CASE("the newest complete checkpoint wins; interrupted ones are skipped", "[checkpoint]") {
  const auto store = test::scratchDir("ckpt-latest");
  writeCheckpoint(store, 5);
  writeCheckpoint(store, 7);
  writeCheckpoint(store, 9, /*bothRanks=*/false);  // interrupted
  CHECK(ckpt::listCheckpoints(store) == std::vector<int64_t>{9, 7, 5});
  CHECK(ckpt::latestComplete(store) == 7);
  // The pointer never moves backwards.
  writeCheckpoint(store, 6);
  CHECK(ckpt::readFile(store / ckpt::kLatest) == "7\n");
  CHECK(ckpt::latestComplete(store) == 7);
}

TEST_CASE("damaged checkpoints are refused, naming the file", "[checkpoint]") {
  const auto store = test::scratchDir("ckpt-damage");
  SECTION("a truncated file") {
    writeCheckpoint(store, 1);
    fs::resize_file(ckpt::checkpointDir(store, 1) / "piece_0_a.params.pt", 10);
    CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 1)),
                      Catch::Contains("'piece_0_a.params.pt' has 10 bytes") && Catch::Contains("varuna_ckpt_1"));
    CHECK_FALSE(ckpt::latestComplete(store).has_value());
  }
  SECTION("a flipped byte") {
    writeCheckpoint(store, 2);
    flipByte(ckpt::checkpointDir(store, 2) / "piece_1_b.params.pt", 100);
    CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 2)),
                      Catch::Contains("'piece_1_b.params.pt' fails its checksum"));
    // Sizes still match: only a reader that checks sums notices.
    CHECK_NOTHROW(ckpt::verify(ckpt::checkpointDir(store, 2), {}, /*checksums=*/false));
  }
  SECTION("a deleted marker") {
    writeCheckpoint(store, 3);
    fs::remove(ckpt::checkpointDir(store, 3) / ckpt::kMarker);
    CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 3)), Catch::Contains("COMPLETE marker is missing"));
  }
  SECTION("a deleted file") {
    writeCheckpoint(store, 4);
    fs::remove(ckpt::checkpointDir(store, 4) / "piece_1_b.params.pt");
    CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 4)), Catch::Contains("'piece_1_b.params.pt' is missing"));
  }
  SECTION("a checkpoint that does not exist") {
    CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 99)), Catch::Contains("does not exist"));
  }
}

TEST_CASE("crc32 matches the standard check value", "[checkpoint]") {
  CHECK(ckpt::crc32("123456789") == 0xCBF43926u);
  CHECK(ckpt::crc32("6789", ckpt::crc32("12345")) == 0xCBF43926u);
}
