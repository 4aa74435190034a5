// Dynamic loss scaling for fp16 training: multiply the loss by `scale` so small
// gradients survive fp16; on overflow skip the step and shrink the scale, after
// `growthInterval` clean steps grow it again. Pure arithmetic; every rank runs
// the same sequence of update() calls with the same overflow flags, so the scale
// stays identical everywhere.
#pragma once

#include <algorithm>
#include <cstdint>

#include "varuna/common/errors.h"

namespace varuna {

struct LossScaleOptions {
  bool dynamic = true;          // false: a static scale of `initialScale`
  double initialScale = 65536;  // 2^16
  double minScale = 1.0;
  double growthFactor = 2.0;
  double backoffFactor = 0.5;
  int64_t growthInterval = 1000;
};

class LossScaler {
 public:
  explicit LossScaler(LossScaleOptions options = {}) : options_(options), scale_(options.initialScale) {
    if (!(options.initialScale > 0) || !(options.minScale > 0) || !(options.growthFactor >= 1) ||
        !(options.backoffFactor > 0 && options.backoffFactor < 1) || options.growthInterval < 1) {
      throw ConfigError(strCat("invalid loss-scale options: initial ", options.initialScale, ", min ",
                               options.minScale, ", growth ", options.growthFactor, ", backoff ",
                               options.backoffFactor, ", interval ", options.growthInterval,
                               " (need scales > 0, growth >= 1, 0 < backoff < 1, interval >= 1)"));
    }
  }

  double scale() const { return scale_; }
  int64_t cleanSteps() const { return cleanSteps_; }

  // Call once per step with whether any gradient anywhere was inf/NaN.
  void update(bool overflow) {
    if (!options_.dynamic) return;
    if (overflow) {
      scale_ = std::max(options_.minScale, scale_ * options_.backoffFactor);
      cleanSteps_ = 0;
      return;
    }
    if (++cleanSteps_ >= options_.growthInterval) {
      scale_ *= options_.growthFactor;
      cleanSteps_ = 0;
    }
  }

  // For checkpoints (P2).
  void restore(double scale, int64_t cleanSteps) {
    scale_ = scale;
    cleanSteps_ = cleanSteps;
  }

 private:
  LossScaleOptions options_;
  double scale_;
  int64_t cleanSteps_ = 0;
};

}  // namespace varuna
