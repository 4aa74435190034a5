// Hand-made profiles for the simulator and AutoConfig tests: every figure is
// chosen so that expected step times and memory can be worked out by hand.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "varuna/common/profile.h"

namespace varuna::test {

inline profile::Timing timing(double seconds) {
  profile::Timing t;
  t.median = t.min = t.max = seconds;
  t.samples = 5;
  return t;
}

// Per piece, at micro-batch size b: forward f*b, backward bw*b, recompute r*b
// seconds; output, saved-activation bytes scale with b too.
struct PieceSpec {
  double forward = 1.0, backward = 2.0, recompute = 1.0;  // seconds per sample
  int64_t outputBytes = 0, savedBytes = 0;                // bytes per sample
  int64_t params = 0;
};

inline profile::Profile syntheticProfile(const std::vector<PieceSpec>& pieces, const std::vector<int64_t>& sizes) {
  profile::Profile p;
  p.modelFingerprint = "0123456789abcdef";
  p.host = "test";
  p.createdAt = "2024-01-01T00:00:00Z";
  p.optimizerBytesPerParam = 8;
  p.gradientBytesPerParam = 4;
  p.optimizerSecondsPerParam = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    profile::PieceProfile piece;
    piece.name = "piece" + std::to_string(k);
    piece.paramCount = pieces[k].params;
    piece.paramBytes = pieces[k].params * 4;
    for (int64_t b : sizes) {
      profile::PieceAtSize s;
      const double scale = static_cast<double>(b);
      s.forward = timing(pieces[k].forward * scale);
      s.backward = timing(pieces[k].backward * scale);
      s.recompute = timing(pieces[k].recompute * scale);
      s.outputBytes = k + 1 == pieces.size() ? 0 : pieces[k].outputBytes * b;
      s.savedActivationBytes = pieces[k].savedBytes * b;
      piece.bySize[b] = s;
    }
    p.pieces.push_back(piece);
  }
  return p;
}

// `n` identical pieces.
inline profile::Profile uniformProfile(int n, const std::vector<int64_t>& sizes, PieceSpec spec = {}) {
  return syntheticProfile(std::vector<PieceSpec>(n, spec), sizes);
}

}  // namespace varuna::test
