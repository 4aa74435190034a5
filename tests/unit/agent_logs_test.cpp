// The agent's log cap (agent/run_dir.h, capLogs): logs past the cap keep
// their newest bytes in <log>.1 and are cut in place, a writer goes on at
// their start, a copy that cannot be made still cuts the log, and nothing
// planted under a log's name (a link, a FIFO) is followed or blocks.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_env.h"
#include "agent/run_dir.h"

using namespace varuna;
namespace fs = std::filesystem;

namespace {

std::string readText(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// A worker's log, held open with O_APPEND as the agent hands it over, with `text` in it.
int openWorkerLog(const fs::path& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  return fd;
}

}  // namespace

TEST_CASE("agent: logs past the cap are cut in place and a writer goes on at their start", "[runtime][agent]") {
  const auto dir = varuna::test::scratchDir("cap_logs");
  fs::create_directories(dir / "logs");
  const int worker = openWorkerLog(dir / "logs" / "g3_rank0.log", std::string(20000, 'w'));
  std::ofstream(dir / "agent.log") << std::string(500, 'a');  // under the cap
  std::ofstream(dir / "logs" / "notes.txt") << std::string(50000, 'n');  // not a worker's log
  fs::create_symlink(dir / "elsewhere", dir / "logs" / "g3_rank0.log.1");  // planted where the copy goes
  std::ofstream(dir / "elsewhere") << "untouched";

  const LogCapResult first = capLogs(dir, 30000);
  CHECK(first.cut == 0);  // 20000 bytes: under a cap of 30000
  const LogCapResult result = capLogs(dir, 10000);
  CHECK(result.cut == 1);
  CHECK(result.dropped == 0);
  CHECK(fs::file_size(dir / "logs" / "g3_rank0.log") == 0);
  CHECK_FALSE(fs::is_symlink(dir / "logs" / "g3_rank0.log.1"));
  CHECK(fs::file_size(dir / "logs" / "g3_rank0.log.1") == 10000);  // the newest 10000 bytes only
  CHECK((fs::status(dir / "logs" / "g3_rank0.log.1").permissions() & fs::perms::all) ==
        (fs::perms::owner_read | fs::perms::owner_write));
  CHECK(readText(dir / "elsewhere") == "untouched");
  CHECK(fs::file_size(dir / "agent.log") == 500);
  CHECK(fs::file_size(dir / "logs" / "notes.txt") == 50000);
  // The worker writes on, at the start of the cut file (no hole).
  REQUIRE(::write(worker, "next\n", 5) == 5);
  ::close(worker);
  CHECK(readText(dir / "logs" / "g3_rank0.log") == "next\n");
  CHECK(capLogs(dir, 10000).cut == 0);
  CHECK(capLogs(dir / "missing", 10).cut == 0);
}

TEST_CASE("agent: the copy of a cut log holds its newest bytes", "[runtime][agent]") {
  const auto dir = varuna::test::scratchDir("cap_logs_tail");
  fs::create_directories(dir / "logs");
  std::string text;
  for (int line = 0; line < 3000; ++line) text += "line " + std::to_string(line) + "\n";
  const int worker = openWorkerLog(dir / "logs" / "g1_rank2.log", text);
  ::close(worker);
  REQUIRE(text.size() > 4096);
  REQUIRE(capLogs(dir, 4096).cut == 1);
  CHECK(readText(dir / "logs" / "g1_rank2.log.1") == text.substr(text.size() - 4096));
  CHECK(readText(dir / "logs" / "g1_rank2.log.1").find("line 2999\n") != std::string::npos);
}

TEST_CASE("agent: a log whose copy cannot be made is cut all the same", "[runtime][agent]") {
  // The copy's name taken by a folder: as on a full disk, no copy can be
  // written; the log must not go on growing for it.
  const auto dir = varuna::test::scratchDir("cap_logs_no_copy");
  fs::create_directories(dir / "logs" / "g2_rank0.log.1");
  std::ofstream(dir / "logs" / "g2_rank0.log.1" / "kept") << "the folder's own";
  const int worker = openWorkerLog(dir / "logs" / "g2_rank0.log", std::string(20000, 'w'));
  const LogCapResult result = capLogs(dir, 10000);
  CHECK(result.cut == 0);
  CHECK(result.dropped == 1);
  CHECK(fs::file_size(dir / "logs" / "g2_rank0.log") == 0);
  CHECK(readText(dir / "logs" / "g2_rank0.log.1" / "kept") == "the folder's own");
  REQUIRE(::write(worker, "next\n", 5) == 5);
  ::close(worker);
  CHECK(readText(dir / "logs" / "g2_rank0.log") == "next\n");
}

TEST_CASE("agent: a FIFO under a log's name is passed over, and refused once opened", "[runtime][agent]") {
  const auto dir = varuna::test::scratchDir("cap_logs_fifo");
  fs::create_directories(dir / "logs");
  REQUIRE(::mkfifo((dir / "logs" / "g4_rank0.log").c_str(), 0600) == 0);
  REQUIRE(::mkfifo((dir / "agent.log").c_str(), 0600) == 0);
  // capLogs' lstat passes them over.
  const LogCapResult result = capLogs(dir, 0);
  CHECK(result.cut == 0);
  CHECK(result.dropped == 0);
  // One swapped in after that lstat: cutLog opens it (O_NONBLOCK, no
  // waiting for a writer), sees by fstat that it is no regular file and
  // leaves it, reading nothing from it. A read from this FIFO, which no
  // writer ever opens, would wait forever: ctest's timeout would say so.
  CHECK(cutLog(dir / "logs" / "g4_rank0.log", 0) == LogCut::kNone);
  CHECK(fs::is_fifo(dir / "logs" / "g4_rank0.log"));
  CHECK_FALSE(fs::exists(dir / "logs" / "g4_rank0.log.1"));
  // A link in a log's place is not followed either.
  std::ofstream(dir / "target") << std::string(100, 't');
  fs::create_symlink(dir / "target", dir / "logs" / "g5_rank0.log");
  CHECK(cutLog(dir / "logs" / "g5_rank0.log", 10) == LogCut::kNone);
  CHECK(fs::file_size(dir / "target") == 100);
}
