#include "char_dataset.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "varuna/common/errors.h"

namespace gpt {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::string readFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

}  // namespace

// GCC 12 at -O2 reports a false -Warray-bounds and -Wstringop-overflow in
// std::string's move constructor below (it assumes the short-string buffer
// after the size check) once libtorch's precompiled headers come first.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
CharDataset CharDataset::fromPath(const std::string& path) {
  namespace fs = std::filesystem;
  std::string text;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(path)) {
      if (entry.is_regular_file() && !entry.is_symlink()) files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) text += readFile(f);
  } else if (fs::is_regular_file(path, ec)) {
    text = readFile(path);
  }
  if (text.size() < 1024) {
    throw varuna::ConfigError(varuna::strCat("training text '", path, "' is missing or smaller than 1 KiB; pass "
                                             "--data with a text file or a directory of text files"));
  }
  return CharDataset(std::move(text));
}
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic pop
#endif

CharDataset::CharDataset(std::string text) {
  std::set<char> chars(text.begin(), text.end());
  vocab_.assign(chars.begin(), chars.end());
  int64_t index[256] = {};
  for (size_t i = 0; i < vocab_.size(); ++i) index[static_cast<unsigned char>(vocab_[i])] = static_cast<int64_t>(i);
  tokens_.reserve(text.size());
  for (char c : text) tokens_.push_back(index[static_cast<unsigned char>(c)]);
}

varuna::Batch CharDataset::samples(int64_t first, int64_t count, int64_t seqLen, uint64_t seed) const {
  if (size() <= seqLen + 1) {
    throw varuna::ConfigError(varuna::strCat("text of ", size(), " characters is too short for seq_len ", seqLen));
  }
  auto tokens = torch::empty({count, seqLen}, torch::kLong);
  auto targets = torch::empty({count, seqLen}, torch::kLong);
  auto tok = tokens.accessor<int64_t, 2>();
  auto tgt = targets.accessor<int64_t, 2>();
  const uint64_t windows = static_cast<uint64_t>(size() - seqLen - 1);
  for (int64_t s = 0; s < count; ++s) {
    const uint64_t k = static_cast<uint64_t>(first + s);
    const int64_t offset = static_cast<int64_t>(splitmix64(seed * 0x100000001b3ULL ^ k) % windows);
    for (int64_t t = 0; t < seqLen; ++t) {
      tok[s][t] = tokens_[offset + t];
      tgt[s][t] = tokens_[offset + t + 1];
    }
  }
  return {{"tokens", tokens}, {"targets", targets}};
}

varuna::Batch CharDataset::replicaBatch(int64_t step, int64_t globalBatch, int replica, int replicas, int64_t seqLen,
                                        uint64_t seed) const {
  const int64_t share = globalBatch / replicas;
  return samples(step * globalBatch + replica * share, share, seqLen, seed);
}

}  // namespace gpt
