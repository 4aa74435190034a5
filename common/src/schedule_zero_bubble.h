// The zero-bubble schedule generator (ScheduleKind::kZeroBubbleH1), private
// to schedule.cpp, which checks the arguments before calling it.
#pragma once

#include "varuna/common/schedule.h"

namespace varuna {

Schedule zeroBubbleH1Schedule(int stages, int microbatches);

}  // namespace varuna
