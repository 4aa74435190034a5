#include "varuna/common/stage_map.h"

#include <charconv>

#include "varuna/common/errors.h"

namespace varuna {
namespace {

[[noreturn]] void badMap(std::string_view text, const std::string& why) {
  throw ConfigError(strCat("invalid stage_to_rank_map '", text, "': ", why,
                           ". Expected per stage its ranks joined by ',' and ended by ';', "
                           "e.g. '0,2;1,3;' for 2 stages x 2 replicas"));
}

int parseRank(std::string_view text, std::string_view token) {
  int value = -1;
  const char* end = token.data() + token.size();
  auto [ptr, ec] = std::from_chars(token.data(), end, value);
  if (token.empty() || ec != std::errc() || ptr != end || value < 0) {
    badMap(text, strCat("'", token, "' is not a rank (a non-negative integer)"));
  }
  return value;
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string_view::npos ? std::string_view::npos : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return parts;
}

}  // namespace

StageToRankMap StageToRankMap::parse(std::string_view text) {
  std::string_view body = text;
  while (!body.empty() && (body.back() == ' ' || body.back() == '\n')) body.remove_suffix(1);
  if (body.empty()) badMap(text, "it is empty");
  if (body.back() == ';') body.remove_suffix(1);  // the final ';' is customary, not required
  std::vector<std::vector<int>> ranks;
  for (std::string_view stageText : split(body, ';')) {
    if (stageText.empty()) badMap(text, strCat("stage ", ranks.size(), " has no ranks"));
    std::vector<int> stageRanks;
    for (std::string_view token : split(stageText, ',')) stageRanks.push_back(parseRank(text, token));
    ranks.push_back(std::move(stageRanks));
  }
  try {
    return fromRanks(std::move(ranks));
  } catch (const ConfigError& e) {
    badMap(text, e.what());
  }
}

StageToRankMap StageToRankMap::fromRanks(std::vector<std::vector<int>> ranks) {
  if (ranks.empty()) throw ConfigError("no stages");
  const size_t replicas = ranks[0].size();
  size_t world = 0;
  for (size_t s = 0; s < ranks.size(); ++s) {
    if (ranks[s].size() != replicas) {
      throw ConfigError(strCat("stage ", s, " has ", ranks[s].size(), " ranks but stage 0 has ",
                               replicas, "; every stage needs one rank per replica"));
    }
    world += ranks[s].size();
  }
  std::vector<int> seen(world, -1);
  for (size_t s = 0; s < ranks.size(); ++s) {
    for (int r : ranks[s]) {
      if (r >= static_cast<int>(world)) {
        throw ConfigError(strCat("rank ", r, " is out of range: ", world,
                                 " ranks in all means ranks 0..", world - 1));
      }
      if (seen[r] >= 0) {
        throw ConfigError(strCat("rank ", r, " appears twice (stages ", seen[r], " and ", s, ")"));
      }
      seen[r] = static_cast<int>(s);
    }
  }
  return StageToRankMap(std::move(ranks));
}

StageToRankMap StageToRankMap::clustered(int stages, int replicas) {
  if (stages < 1 || replicas < 1) {
    throw ConfigError(strCat("need at least 1 stage and 1 replica, got ", stages, " x ", replicas));
  }
  std::vector<std::vector<int>> ranks(stages);
  for (int s = 0; s < stages; ++s) {
    for (int r = 0; r < replicas; ++r) ranks[s].push_back(r * stages + s);
  }
  return StageToRankMap(std::move(ranks));
}

StageToRankMap::StageToRankMap(std::vector<std::vector<int>> ranks) : ranks_(std::move(ranks)) {
  stageOfRank_.assign(worldSize(), -1);
  replicaOfRank_.assign(worldSize(), -1);
  for (int s = 0; s < numStages(); ++s) {
    for (int r = 0; r < numReplicas(); ++r) {
      stageOfRank_[ranks_[s][r]] = s;
      replicaOfRank_[ranks_[s][r]] = r;
    }
  }
}

void StageToRankMap::checkRank(int rank) const {
  if (rank < 0 || rank >= worldSize()) {
    throw ConfigError(strCat("rank ", rank, " is not in stage_to_rank_map '", toString(), "' (",
                             worldSize(), " ranks)"));
  }
}

int StageToRankMap::stageOf(int rank) const {
  checkRank(rank);
  return stageOfRank_[rank];
}

int StageToRankMap::replicaOf(int rank) const {
  checkRank(rank);
  return replicaOfRank_[rank];
}

int StageToRankMap::rankOf(int stage, int replica) const {
  VARUNA_CHECK(stage >= 0 && stage < numStages() && replica >= 0 && replica < numReplicas(),
               "stage ", stage, " replica ", replica);
  return ranks_[stage][replica];
}

const std::vector<int>& StageToRankMap::ranksOfStage(int stage) const {
  VARUNA_CHECK(stage >= 0 && stage < numStages(), "stage ", stage);
  return ranks_[stage];
}

std::string StageToRankMap::toString() const {
  std::string out;
  for (const auto& stage : ranks_) {
    for (size_t i = 0; i < stage.size(); ++i) {
      if (i) out += ',';
      out += std::to_string(stage[i]);
    }
    out += ';';
  }
  return out;
}

}  // namespace varuna
