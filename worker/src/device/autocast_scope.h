// RAII: enables autocast for bf16/fp16 on the model's device type for the
// lifetime of the scope (the forward and recompute passes), restoring the
// previous state after. fp32 makes it a no-op.
#pragma once

#include <ATen/autocast_mode.h>

#include "varuna/worker/varuna.h"

namespace varuna {

// The reduced type a mixed-precision mode computes in (fp32 has none: its
// scope is disabled).
inline at::ScalarType autocastType(Precision p) { return p == Precision::kBf16 ? at::kBFloat16 : at::kHalf; }

class AutocastScope {
 public:
  AutocastScope(bool enabled, at::DeviceType deviceType, at::ScalarType dtype)
      : enabled_(enabled), deviceType_(deviceType) {
    if (!enabled_) return;
    previousEnabled_ = at::autocast::is_autocast_enabled(deviceType_);
    previousDtype_ = at::autocast::get_autocast_dtype(deviceType_);
    at::autocast::set_autocast_enabled(deviceType_, true);
    at::autocast::set_autocast_dtype(deviceType_, dtype);
  }
  ~AutocastScope() {
    if (!enabled_) return;
    at::autocast::set_autocast_enabled(deviceType_, previousEnabled_);
    at::autocast::set_autocast_dtype(deviceType_, previousDtype_);
    at::autocast::clear_cache();
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool enabled_;
  at::DeviceType deviceType_;
  bool previousEnabled_ = false;
  at::ScalarType previousDtype_ = at::kFloat;
};

}  // namespace varuna
