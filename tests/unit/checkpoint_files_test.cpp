#include <catch2/catch.hpp>

#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "test_env.h"
#include "varuna/common/checkpoint_files.h"

using namespace varuna;
namespace fs = std::filesystem;

namespace {

ckpt::WriterIdentity writer(int64_t generation, int rank, int worldSize) {
  return {generation, ckpt::runTag(generation, "test"), rank, worldSize};
}

// Rank `rank` of a run writes its file of `step` (content tagged so runs differ) and its part.
void writeRankPart(const fs::path& store, int64_t step, const ckpt::WriterIdentity& w, const std::string& tag = "") {
  const auto dir = ckpt::partialDir(store, step, w.run);
  auto e = ckpt::writeFileAtomic(dir, "piece_" + std::to_string(w.rank) + ".params.pt",
                                 std::string(500 + 100 * w.rank, 'a' + w.rank) + tag + std::to_string(step));
  ckpt::writePart(store, step, w, {e});
}

// A two-rank checkpoint of `step` with small files; complete unless told.
void writeCheckpoint(const fs::path& store, int64_t step, bool bothRanks = true, int64_t generation = 1) {
  writeRankPart(store, step, writer(generation, 0, 2));
  CHECK(ckpt::finalize(store, step, writer(generation, 0, 2)) == ckpt::Finalized::kWaiting);  // rank 1 is missing
  if (!bothRanks) return;
  writeRankPart(store, step, writer(generation, 1, 2));
  CHECK(ckpt::finalize(store, step, writer(generation, 1, 2)) == ckpt::Finalized::kCompleted);
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
  CHECK_FALSE(fs::exists(ckpt::checkpointDir(store, 10)));  // still a partial folder
  CHECK(ckpt::listCheckpoints(store).empty());
  CHECK_FALSE(ckpt::isComplete(ckpt::checkpointDir(store, 10)));
  CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 10)), Catch::Contains("does not exist"));
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
  writeCheckpoint(store, 9, /*bothRanks=*/false);  // interrupted: never under its final name
  CHECK(ckpt::listCheckpoints(store) == std::vector<int64_t>{7, 5});
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
    fs::resize_file(ckpt::checkpointDir(store, 1) / "piece_0.params.pt", 10);
    CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 1)),
                      Catch::Contains("'piece_0.params.pt' has 10 bytes") && Catch::Contains("varuna_ckpt_1"));
    std::vector<ckpt::SkippedCheckpoint> skipped;
    CHECK_FALSE(ckpt::latestComplete(store, &skipped).has_value());
    REQUIRE(skipped.size() == 1);
    CHECK(skipped[0].step == 1);
    CHECK_THAT(skipped[0].reason, Catch::Contains("has 10 bytes"));
  }
  SECTION("a flipped byte") {
    writeCheckpoint(store, 2);
    flipByte(ckpt::checkpointDir(store, 2) / "piece_1.params.pt", 100);
    CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 2)),
                      Catch::Contains("'piece_1.params.pt' fails its checksum"));
    const auto manifest = ckpt::readManifest(ckpt::checkpointDir(store, 2));
    CHECK_THROWS_WITH(ckpt::readVerified(ckpt::checkpointDir(store, 2), manifest, "piece_1.params.pt"),
                      Catch::Contains("fails its checksum"));
    CHECK(ckpt::readVerified(ckpt::checkpointDir(store, 2), manifest, "piece_0.params.pt").size() == 501);
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
    fs::remove(ckpt::checkpointDir(store, 4) / "piece_1.params.pt");
    CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 4)), Catch::Contains("'piece_1.params.pt' is missing"));
  }
  SECTION("a checkpoint that does not exist") {
    CHECK_THROWS_WITH(ckpt::verify(ckpt::checkpointDir(store, 99)), Catch::Contains("does not exist"));
  }
}

TEST_CASE("crc32 matches the standard check value", "[checkpoint]") {
  CHECK(ckpt::crc32("123456789") == 0xCBF43926u);
  CHECK(ckpt::crc32("6789", ckpt::crc32("12345")) == 0xCBF43926u);
}

TEST_CASE("storage failures carry the storage exit code, not the configuration one", "[checkpoint]") {
  CHECK(ckpt::CheckpointError("x").exitCode() == kExitStorageError);
  CHECK(ckpt::SupersededError("x").exitCode() == kExitSuperseded);
  CHECK(kExitStorageError != kExitConfigError);
}

TEST_CASE("a checkpoint is completed only from parts of one generation", "[checkpoint][fencing]") {
  const auto store = test::scratchDir("ckpt-fence");
  const int64_t step = 40;
  // A dead generation 3 of world size 4 left parts of step 40 (ranks 0-3, no COMPLETE).
  for (int r = 0; r < 4; ++r) writeRankPart(store, step, writer(3, r, 4), "old");
  const auto deadDir = ckpt::partialDir(store, step, ckpt::runTag(3, ""));
  REQUIRE(fs::exists(deadDir / "parts" / "rank_3.json"));

  SECTION("the next generation has another world size") {
    writeRankPart(store, step, writer(4, 0, 2), "new");
    // Rank 1's part of generation 4 is missing: the dead generation's rank-1 part must not count.
    CHECK(ckpt::finalize(store, step, writer(4, 0, 2)) == ckpt::Finalized::kWaiting);
    writeRankPart(store, step, writer(4, 1, 2), "new");
    CHECK(ckpt::finalize(store, step, writer(4, 1, 2)) == ckpt::Finalized::kCompleted);
  }
  SECTION("the next generation has the same world size") {
    for (int r = 0; r < 4; ++r) {
      writeRankPart(store, step, writer(4, r, 4), "new");
      CHECK(ckpt::finalize(store, step, writer(4, r, 4)) ==
            (r < 3 ? ckpt::Finalized::kWaiting : ckpt::Finalized::kCompleted));
    }
  }
  const auto dir = ckpt::checkpointDir(store, step);
  REQUIRE(ckpt::isComplete(dir));
  CHECK_NOTHROW(ckpt::verify(dir));  // sizes and checksums match the files
  const auto manifest = nlohmann::json::parse(ckpt::readFile(dir / ckpt::kManifest));
  CHECK(manifest["generation"] == 4);
  for (const auto& entry : ckpt::readManifest(dir)) {
    CHECK_THAT(ckpt::readFile(dir / entry.name), Catch::Contains("new") && !Catch::Contains("old"));
  }
  // The dead generation's parts were never moved in, and its folder stays apart.
  CHECK(fs::exists(deadDir));
  // A late part of the dead generation cannot complete or overwrite it.
  CHECK(ckpt::finalize(store, step, writer(3, 0, 4)) == ckpt::Finalized::kAlreadyComplete);
  CHECK(manifest == nlohmann::json::parse(ckpt::readFile(dir / ckpt::kManifest)));
}

TEST_CASE("a superseded generation is refused and never completes a checkpoint", "[checkpoint][fencing]") {
  const auto store = test::scratchDir("ckpt-superseded");
  ckpt::writeFileAtomic(store, ckpt::kJobFile, R"({"job": "j"})");
  ckpt::recordGeneration(store, 5);
  CHECK(ckpt::recordedGeneration(store) == 5);
  // The record keeps the job's name (run_varuna's claim on the store).
  CHECK(nlohmann::json::parse(ckpt::readFile(store / ckpt::kJobFile))["job"] == "j");

  writeRankPart(store, 8, writer(4, 0, 2));
  writeRankPart(store, 8, writer(4, 1, 2));
  CHECK_THROWS_AS(ckpt::finalize(store, 8, writer(4, 1, 2)), ckpt::SupersededError);
  CHECK_THROWS_WITH(ckpt::checkNotSuperseded(store, 4), Catch::Contains("superseded by generation 5"));
  CHECK_FALSE(fs::exists(ckpt::checkpointDir(store, 8)));
  CHECK_FALSE(ckpt::latestComplete(store).has_value());
  // The current generation and runs without a generation are not fenced.
  CHECK_NOTHROW(ckpt::checkNotSuperseded(store, 5));
  CHECK_NOTHROW(ckpt::checkNotSuperseded(store, -1));
  writeCheckpoint(store, 9, true, 5);
  CHECK(ckpt::latestComplete(store) == 9);
}

TEST_CASE("an interrupted folder under the final name is moved aside, never mixed in", "[checkpoint][fencing]") {
  const auto store = test::scratchDir("ckpt-aside");
  const auto dir = ckpt::checkpointDir(store, 3);
  ckpt::writeFileAtomic(dir, "piece_9.params.pt", "left by an older version");
  writeCheckpoint(store, 3);
  REQUIRE(ckpt::isComplete(dir));
  CHECK_FALSE(fs::exists(dir / "piece_9.params.pt"));
  CHECK_NOTHROW(ckpt::verify(dir));
  CHECK(ckpt::applyRetention(store, 2, 1).size() == 1);  // the folder moved aside
}

TEST_CASE("a damaged checkpoint is marked and passed over, naming it", "[checkpoint]") {
  const auto store = test::scratchDir("ckpt-marked");
  writeCheckpoint(store, 1);
  writeCheckpoint(store, 2);
  ckpt::markDamaged(ckpt::checkpointDir(store, 2), "piece_1.params.pt fails its checksum");
  std::vector<ckpt::SkippedCheckpoint> skipped;
  CHECK(ckpt::latestComplete(store, &skipped) == 1);
  REQUIRE(skipped.size() == 1);
  CHECK(skipped[0].step == 2);
  CHECK_THAT(skipped[0].reason, Catch::Contains("marked damaged") && Catch::Contains("fails its checksum"));
  CHECK(ckpt::completeCheckpoints(store) == std::vector<int64_t>{1});
  // A run that falls back to 1 reaches step 2 again: its checkpoint replaces the damaged one.
  writeCheckpoint(store, 2, true, 2);
  CHECK(ckpt::isIntact(ckpt::checkpointDir(store, 2)));
  CHECK_NOTHROW(ckpt::verify(ckpt::checkpointDir(store, 2)));
  CHECK(ckpt::latestComplete(store) == 2);
  CHECK(ckpt::applyRetention(store, 3, 2).size() == 1);  // the damaged one, moved aside
}

TEST_CASE("retention keeps the newest N complete checkpoints and clears the remains", "[checkpoint][retention]") {
  const auto store = test::scratchDir("ckpt-retention");
  for (int64_t step : {10, 20, 30, 40}) writeCheckpoint(store, step, true, 2);
  writeCheckpoint(store, 25, /*bothRanks=*/false, 2);   // interrupted, older than the newest
  writeCheckpoint(store, 50, /*bothRanks=*/false, 2);   // may still be in progress
  writeCheckpoint(store, 60, /*bothRanks=*/false, 1);   // of a superseded generation
  ckpt::markDamaged(ckpt::checkpointDir(store, 20), "test");

  SECTION("keep 2") {
    const auto removed = ckpt::applyRetention(store, 2, 2);
    CHECK(ckpt::listCheckpoints(store) == std::vector<int64_t>{40, 30});
    CHECK(removed.size() == 4);  // 10, 20 (damaged), the partials of 25 and of generation 1
    CHECK(fs::exists(ckpt::partialDir(store, 50, "g2")));
    CHECK_FALSE(fs::exists(ckpt::partialDir(store, 25, "g2")));
    CHECK_FALSE(fs::exists(ckpt::partialDir(store, 60, "g1")));
  }
  SECTION("keep 1 never removes the newest") {
    ckpt::applyRetention(store, 1, 2);
    CHECK(ckpt::listCheckpoints(store) == std::vector<int64_t>{40});
    CHECK(ckpt::latestComplete(store) == 40);
  }
  SECTION("keep 0 keeps every complete checkpoint") {
    ckpt::applyRetention(store, 0, 2);
    CHECK(ckpt::listCheckpoints(store) == std::vector<int64_t>{40, 30, 10});
  }
  SECTION("a store without a complete checkpoint keeps its partial folders") {
    const auto empty = test::scratchDir("ckpt-retention-empty");
    writeCheckpoint(empty, 5, /*bothRanks=*/false, 2);
    CHECK(ckpt::applyRetention(empty, 1, 2).empty());
    CHECK(fs::exists(ckpt::partialDir(empty, 5, "g2")));
  }
}

TEST_CASE("a link planted at the temporary name is replaced, never written through", "[checkpoint][security]") {
  const fs::path dir = test::scratchDir("ckpt-planted-link");
  fs::create_directories(dir / "out");
  const fs::path victim = dir / "victim.txt";
  { std::ofstream(victim) << "untouched"; }
  // writeFileAtomic's temporary is <target>.tmp.<pid>: guessable by another user.
  fs::create_symlink(victim, dir / "out" / ("connection.json.tmp." + std::to_string(::getpid())));
  ckpt::writeFileAtomic(dir / "out", "connection.json", "secret");
  const auto text = [](const fs::path& p) {
    std::ifstream in(p);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  CHECK(text(victim) == "untouched");
  CHECK(text(dir / "out" / "connection.json") == "secret");
  CHECK_FALSE(fs::is_symlink(dir / "out" / "connection.json"));
}
