#include "varuna/worker/model.h"

#include <torch/utils.h>

#include <set>

#include "varuna/common/errors.h"

namespace varuna {

std::shared_ptr<Piece> buildPiece(const ModelSpec& model, int index) {
  VARUNA_CHECK(index >= 0 && index < static_cast<int>(model.pieces.size()), "piece ", index);
  torch::manual_seed(model.seed + static_cast<uint64_t>(index));
  auto piece = model.pieces[index].make();
  if (!piece) throw ConfigError(strCat("the factory of piece '", model.pieces[index].name, "' returned null"));
  return piece;
}

int pieceOfParameter(const ModelSpec& model, const std::string& fullName) {
  int best = -1;
  size_t bestLength = 0;
  for (size_t i = 0; i < model.pieces.size(); ++i) {
    const std::string& name = model.pieces[i].name;
    if (fullName.size() > name.size() + 1 && fullName.compare(0, name.size(), name) == 0 &&
        fullName[name.size()] == '.' && name.size() > bestLength) {
      best = static_cast<int>(i);
      bestLength = name.size();
    }
  }
  return best;
}

void validateModelSpec(const ModelSpec& model) {
  if (model.pieces.empty()) throw ConfigError("the model has no pieces: give at least one PieceSpec");
  std::set<std::string> names;
  for (size_t i = 0; i < model.pieces.size(); ++i) {
    const auto& p = model.pieces[i];
    if (p.name.empty()) throw ConfigError(strCat("piece ", i, " has no name"));
    if (!names.insert(p.name).second) throw ConfigError(strCat("two pieces are named '", p.name, "'"));
    if (!p.make) throw ConfigError(strCat("piece '", p.name, "' has no factory"));
  }
  if (!model.pieceCosts.empty() && model.pieceCosts.size() != model.pieces.size()) {
    throw ConfigError(strCat("pieceCosts has ", model.pieceCosts.size(), " entries for ",
                             model.pieces.size(), " pieces"));
  }
  std::set<std::string> tied;
  for (const auto& [a, b] : model.sharedWeights) {
    for (const auto& name : {a, b}) {
      if (pieceOfParameter(model, name) < 0) {
        throw ConfigError(strCat("shared weight '", name, "' does not name a parameter of any piece: "
                                 "names look like '<piece name>.<parameter path>', e.g. '",
                                 model.pieces.front().name, ".weight'"));
      }
      if (!tied.insert(name).second) {
        throw ConfigError(strCat("parameter '", name, "' appears in two shared-weight pairs; "
                                 "tie each parameter to exactly one other"));
      }
    }
    if (a == b) throw ConfigError(strCat("shared weight pair ('", a, "', '", b, "') ties a parameter to itself"));
  }
}

}  // namespace varuna
