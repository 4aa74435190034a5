// The list-scheduling generator of the zero-bubble schedules: zb-h1 (one
// chunk per stage) and zbv (two in a V). Private to schedule.cpp, which
// checks the arguments first.
#pragma once

#include <functional>

#include "varuna/common/schedule.h"

namespace varuna {

// `splitBackward`: B and W tasks (zbv) instead of a whole backward.
// `maxInFlight(stage)`: chunk micro-batches a rank may hold between a
// forward and the end of its backward (W when split), its activation memory.
Schedule chunkedSchedule(const ChunkLayout& layout, int microbatches, bool splitBackward,
                         const std::function<int(int stage)>& maxInFlight);

}  // namespace varuna
