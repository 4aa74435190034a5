#include "varuna/common/partition.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "varuna/common/errors.h"

namespace varuna {

int Partition::stageOfPiece(int piece) const {
  for (int s = 0; s < numStages(); ++s) {
    if (piece >= begin(s) && piece < end(s)) return s;
  }
  VARUNA_CHECK(false, "piece ", piece, " is in no stage");
  return -1;
}

double Partition::maxStageCost() const {
  return stageCost.empty() ? 0.0 : *std::max_element(stageCost.begin(), stageCost.end());
}

std::string Partition::describe(const std::vector<std::string>& pieceNames) const {
  std::ostringstream out;
  for (int s = 0; s < numStages(); ++s) {
    if (s) out << "; ";
    out << "stage " << s << ": pieces " << begin(s) << "-" << end(s) - 1;
    if (static_cast<int>(pieceNames.size()) >= end(s)) {
      out << " (" << pieceNames[begin(s)] << ".." << pieceNames[end(s) - 1] << ")";
    }
    out << " cost " << stageCost[s];
  }
  return out.str();
}

Partition partitionPieces(const std::vector<double>& pieceCosts, int stages) {
  const int n = static_cast<int>(pieceCosts.size());
  if (stages < 1) throw ConfigError(strCat("number of pipeline stages must be >= 1, got ", stages));
  if (stages > n) {
    throw ConfigError(strCat("cannot split ", n, " pieces into ", stages,
                             " pipeline stages: add CutPoints or use at most ", n, " stages"));
  }
  for (int i = 0; i < n; ++i) {
    if (!(pieceCosts[i] >= 0.0) || std::isinf(pieceCosts[i])) {
      throw ConfigError(strCat("cost of piece ", i, " is ", pieceCosts[i], "; costs must be finite and >= 0"));
    }
  }
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + pieceCosts[i];
  auto span = [&prefix](int a, int b) { return prefix[b] - prefix[a]; };

  // best[k][j]: smallest possible slowest-stage cost for pieces [0, j) in k stages.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, kInf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, -1));
  best[0][0] = 0.0;
  for (int k = 1; k <= stages; ++k) {
    for (int j = k; j <= n - (stages - k); ++j) {
      for (int i = k - 1; i < j; ++i) {
        const double candidate = std::max(best[k - 1][i], span(i, j));
        // Strictly better only: among equal optima the earliest cut wins, which
        // keeps the result deterministic across processes.
        if (candidate < best[k][j]) {
          best[k][j] = candidate;
          cut[k][j] = i;
        }
      }
    }
  }
  Partition result;
  result.firstPiece.assign(stages + 1, 0);
  result.firstPiece[stages] = n;
  for (int k = stages, j = n; k >= 1; --k) {
    j = cut[k][j];
    result.firstPiece[k - 1] = j;
  }
  for (int s = 0; s < stages; ++s) {
    result.stageCost.push_back(span(result.firstPiece[s], result.firstPiece[s + 1]));
  }
  return result;
}

}  // namespace varuna
