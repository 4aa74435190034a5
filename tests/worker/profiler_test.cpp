// The Profiler through real profile_gpt processes on loopback: a small GPT
// profiled by 2 processes (4 pieces), adding a size to an existing profile,
// reusing cached results, cross-host classification, and refusing stale or
// malformed profiles on every rank.
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fstream>

#include "char_dataset.h"
#include "gpt_model.h"
#include "process.h"
#include "test_env.h"
#include "varuna/common/errors.h"
#include "varuna/common/profile.h"
#include "varuna/worker/profiler.h"

// Last: c10's logging header defines its own CHECK (abort on failure), which
// would silently replace Catch's if it came after.
#include <catch2/catch.hpp>

using namespace varuna;
using namespace varuna::test;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kSeq = 16;

fs::path profileGptBinary() { return buildDir() / "examples" / "gpt" / "profile_gpt"; }

// A small English text: a fixed vocabulary the test can rebuild the model from.
fs::path writeText(const fs::path& dir) {
  const fs::path path = dir / "text.txt";
  std::ofstream out(path);
  for (int i = 0; i < 40; ++i) out << "The quick brown fox jumps over the lazy dog. Pack my box with five jugs.\n";
  return path;
}

// The spec profile_gpt builds from the same flags.
ModelSpec smallGpt(const fs::path& text, int64_t dModel) {
  gpt::GptConfig config;
  config.vocabSize = gpt::CharDataset::fromPath(text.string()).vocabSize();
  config.dModel = dModel;
  config.heads = 2;
  config.layers = 2;
  config.seqLen = kSeq;
  return gpt::makeGptModel(config);
}

struct JobResult {
  std::vector<int> codes;
  std::vector<std::string> stdoutText, stderrText;
};

// `world` profile_gpt processes rendezvousing on a store this test hosts
// (port 0, read back); `hosts[r]`, if given, is rank r's VARUNA_HOST.
JobResult runProfiler(const fs::path& dir, const std::string& name, int world, const std::vector<std::string>& args,
                      const std::vector<std::string>& hosts = {}) {
  c10d::TCPStoreOptions opts;
  opts.port = 0;
  opts.isServer = true;
  opts.numWorkers = world;
  opts.waitWorkers = false;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  std::vector<ChildProcess> workers;
  for (int rank = 0; rank < world; ++rank) {
    std::vector<std::string> argv = {profileGptBinary().string(), "--rank", std::to_string(rank), "--local_rank",
                                     std::to_string(rank), "--master_addr", "127.0.0.1", "--master_port",
                                     std::to_string(store->getPort()), "--external_store", "--peer_timeout_s", "30"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::map<std::string, std::string> env{{"WORLD_SIZE", std::to_string(world)}};
    if (!hosts.empty()) env["VARUNA_HOST"] = hosts[rank];
    workers.emplace_back(argv, env, dir / (name + "_rank" + std::to_string(rank)));
  }
  JobResult result;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (auto& w : workers) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const auto code = w.wait(std::max(left, std::chrono::milliseconds(0)));
    result.codes.push_back(code ? *code : -1);
    result.stdoutText.push_back(w.stdoutText());
    result.stderrText.push_back(w.stderrText());
  }
  return result;
}

void requireSucceeded(const JobResult& job) {
  for (size_t r = 0; r < job.codes.size(); ++r) {
    INFO("rank " << r << " exit code " << job.codes[r] << ", stderr:\n" << job.stderrText[r]);
    REQUIRE(job.codes[r] == 0);
  }
}

std::vector<std::string> modelArgs(const fs::path& text, const fs::path& out, int64_t dModel = 32) {
  return {"--data", text.string(), "--layers", "2", "--d_model", std::to_string(dModel), "--heads", "2",
          "--seq_len", std::to_string(kSeq), "--profile_dir", out.string(), "--warmup", "1", "--repetitions", "5"};
}

std::vector<std::string> plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

void checkTiming(const profile::Timing& t, int repetitions) {
  CHECK(t.median > 0);
  CHECK(t.min <= t.median);
  CHECK(t.median <= t.max);
  CHECK(t.samples >= 1);
  CHECK(t.samples <= repetitions);
  CHECK(t.spread >= 0);
}

const profile::PieceAtSize& figures(const profile::Profile& p, const std::string& piece, int64_t size) {
  for (const auto& pp : p.pieces) {
    if (pp.name == piece) return pp.bySize.at(size);
  }
  FAIL("no piece " << piece);
  throw std::logic_error("unreachable");
}

}  // namespace

TEST_CASE("profile_gpt profiles a small GPT with 2 processes, adds sizes and reuses cached results",
          "[integration][profiler]") {
  const auto dir = scratchDir("profile-small-gpt");
  const auto text = writeText(dir);
  const auto out = dir / "profile";
  const ModelSpec spec = smallGpt(text, 32);
  const std::string fingerprint = modelFingerprint(spec);

  // 2 processes, 4 pieces x 2 sizes.
  const auto first = runProfiler(dir, "first", 2, plus(modelArgs(text, out), {"--micro_batch_sizes", "1,2"}));
  requireSucceeded(first);
  CHECK_THAT(first.stdoutText[0], Catch::Contains("wrote " + profilePath(out.string())));
  {
    std::ifstream in(profilePath(out.string()));
    const auto raw = nlohmann::json::parse(in);
    CHECK(raw.at("version") == profile::kVersion);
    CHECK(raw.at("format") == "varuna-profile");
  }
  const auto p1 = profile::readProfile(profilePath(out.string()), fingerprint);
  CHECK(p1.modelFingerprint == fingerprint);
  CHECK(p1.device == "cpu");
  CHECK(p1.precision == "fp32");
  REQUIRE(p1.pieces.size() == spec.pieces.size());
  for (size_t i = 0; i < spec.pieces.size(); ++i) {
    const auto& piece = p1.pieces[i];
    INFO("piece " << piece.name);
    CHECK(piece.name == spec.pieces[i].name);  // in model order
    CHECK(piece.paramCount == spec.pieces[i].paramCount);
    CHECK(piece.paramBytes == 4 * piece.paramCount);
    REQUIRE(piece.bySize.size() == 2);
    for (int64_t b : {1, 2}) {
      INFO("micro-batch " << b);
      const auto& f = piece.bySize.at(b);
      checkTiming(f.forward, 5);
      checkTiming(f.backward, 5);
      checkTiming(f.recompute, 5);
      checkTiming(f.backwardInput, 5);
      checkTiming(f.backwardWeight, 5);
      const bool isHead = i + 1 == spec.pieces.size();
      CHECK(f.outputBytes == (isHead ? 0 : b * kSeq * 32 * 4));
      CHECK(f.savedActivationBytes > 0);
      CHECK(f.peakBytes >= f.savedActivationBytes);
    }
  }
  // A block keeps activations proportional to the micro-batch; its split
  // backward keeps the gradients at its matrix products from B to W, more
  // for a larger micro-batch, less than the activations.
  CHECK(figures(p1, "block0", 2).savedActivationBytes > figures(p1, "block0", 1).savedActivationBytes);
  CHECK(figures(p1, "block0", 1).splitKeptBytes > 0);
  CHECK(figures(p1, "block0", 2).splitKeptBytes > figures(p1, "block0", 1).splitKeptBytes);
  CHECK(figures(p1, "block0", 1).splitKeptBytes < figures(p1, "block0", 1).savedActivationBytes);
  CHECK(figures(p1, "block0", 1).savedActivationBytes > figures(p1, "block0", 1).outputBytes);
  CHECK(p1.optimizerSecondsPerParam > 0);
  CHECK(p1.optimizerBytesPerParam == 8);  // adamw
  // Both ranks on this host: same-host links only.
  REQUIRE(p1.p2p.size() == 2);
  for (const auto& s : p1.p2p) {
    INFO("p2p " << s.bytes << " bytes");
    CHECK((s.bytes == kSeq * 32 * 4 || s.bytes == 2 * kSeq * 32 * 4));
    CHECK(s.sameHostSeconds > 0);
    CHECK(s.crossHostSeconds == -1);
  }
  REQUIRE_FALSE(p1.allreduce.empty());
  for (const auto& s : p1.allreduce) {
    CHECK(s.replicas == 2);
    CHECK_FALSE(s.crossHost);
    CHECK(s.seconds > 0);
    CHECK(s.bytes > 0);
  }
  CHECK(p1.allreduceSeconds(p1.pieces[1].paramBytes, 2, false) > 0);

  // Adding a size keeps what was there.
  const auto second =
      runProfiler(dir, "second", 2, plus(modelArgs(text, out), {"--micro_batch_sizes", "4", "--add"}));
  requireSucceeded(second);
  const auto p2 = profile::readProfile(profilePath(out.string()), fingerprint);
  CHECK(p2.microBatchSizes() == std::vector<int64_t>({1, 2, 4}));
  for (const auto& piece : p1.pieces) {
    for (int64_t b : {1, 2}) CHECK(figures(p2, piece.name, b) == piece.bySize.at(b));
  }
  CHECK(figures(p2, "block1", 4).outputBytes == 4 * kSeq * 32 * 4);
  CHECK(p2.p2p.size() == 3);

  // Reusing cached results measures only what is missing (size 8): the rest
  // is carried over bit for bit.
  const auto third =
      runProfiler(dir, "third", 2, plus(modelArgs(text, out), {"--micro_batch_sizes", "1,2,4,8", "--reuse"}));
  requireSucceeded(third);
  CHECK_THAT(third.stderrText[0], Catch::Contains("4 measurements over 2 ranks, reused 12 cached"));
  const auto p3 = profile::readProfile(profilePath(out.string()), fingerprint);
  CHECK(p3.microBatchSizes() == std::vector<int64_t>({1, 2, 4, 8}));
  for (const auto& piece : p2.pieces) {
    for (int64_t b : {1, 2, 4}) CHECK(figures(p3, piece.name, b) == piece.bySize.at(b));
  }
  for (const auto& s : p2.p2p) {
    auto it =
        std::find_if(p3.p2p.begin(), p3.p2p.end(), [&](const profile::P2PSample& o) { return o.bytes == s.bytes; });
    REQUIRE(it != p3.p2p.end());
    CHECK(*it == s);
  }
  CHECK(p3.p2p.size() == 4);
  CHECK((p3.allreduce == p2.allreduce));  // same gradient sizes, all cached
  CHECK(p3.createdAt == p1.createdAt);
}

TEST_CASE("ranks with different host identities are profiled as cross-host links", "[integration][profiler]") {
  const auto dir = scratchDir("profile-cross-host");
  const auto text = writeText(dir);
  const auto out = dir / "profile";
  // Two loopback addresses: Gloo binds each, and the ranks count as two hosts.
  const auto job = runProfiler(dir, "cross", 2,
                               plus(modelArgs(text, out), {"--micro_batch_sizes", "1", "--pieces", "block0,head"}),
                               {"127.0.0.1", "127.0.0.2"});
  requireSucceeded(job);
  const auto p = profile::readProfile(profilePath(out.string()));
  REQUIRE(p.pieces.size() == 2);  // only the pieces asked for
  CHECK(p.pieces[0].name == "block0");
  CHECK(p.pieces[1].name == "head");
  REQUIRE(p.p2p.size() == 1);
  CHECK(p.p2p[0].crossHostSeconds > 0);
  CHECK(p.p2p[0].sameHostSeconds == -1);
  REQUIRE_FALSE(p.allreduce.empty());
  for (const auto& s : p.allreduce) CHECK(s.crossHost);
}

TEST_CASE("a stale or malformed profile is refused on every rank", "[integration][profiler]") {
  const auto dir = scratchDir("profile-refused");
  const auto text = writeText(dir);
  const auto out = dir / "profile";
  const auto quick = std::vector<std::string>{"--micro_batch_sizes", "1", "--no_comm", "--add"};
  const auto made = runProfiler(dir, "made", 1, plus(modelArgs(text, out), quick));
  requireSucceeded(made);
  const std::string before = readText(profilePath(out.string()));

  auto refusedEverywhere = [&](const std::string& name, const std::vector<std::string>& args,
                               const std::string& message) {
    const auto job = runProfiler(dir, name, 2, args);
    for (size_t r = 0; r < job.codes.size(); ++r) {
      INFO(name << ": rank " << r << " stderr:\n" << job.stderrText[r]);
      CHECK(job.codes[r] == kExitConfigError);
      CHECK_THAT(job.stderrText[r], Catch::Contains(message));
      CHECK_THAT(job.stderrText[r], Catch::Contains(profilePath(out.string())));
    }
  };

  SECTION("the model changed (d_model 48)") {
    refusedEverywhere("stale", plus(modelArgs(text, out, 48), quick), "stale");
    CHECK(readText(profilePath(out.string())) == before);  // left as it was
    // The model check alone, as run_varuna's users would do it.
    CHECK_THROWS_WITH(profile::readProfile(profilePath(out.string()), modelFingerprint(smallGpt(text, 48))),
                      Catch::Contains("stale"));
    CHECK_NOTHROW(profile::readProfile(profilePath(out.string()), modelFingerprint(smallGpt(text, 32))));
  }
  SECTION("not JSON") {
    std::ofstream(profilePath(out.string())) << before.substr(0, before.size() / 2);
    refusedEverywhere("truncated", plus(modelArgs(text, out), quick), "is not valid JSON");
  }
  SECTION("a field missing") {
    auto j = nlohmann::json::parse(before);
    j["pieces"][0]["micro_batch"]["1"].erase("forward");
    std::ofstream(profilePath(out.string())) << j.dump();
    refusedEverywhere("missing", plus(modelArgs(text, out), quick), "is malformed");
  }
  SECTION("another version") {
    auto j = nlohmann::json::parse(before);
    j["version"] = profile::kVersion + 1;
    std::ofstream(profilePath(out.string())) << j.dump();
    refusedEverywhere("version", plus(modelArgs(text, out), quick), "version");
  }
}
