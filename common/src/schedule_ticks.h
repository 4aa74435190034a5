// The clock of the list-scheduling simulations that generate schedules
// (schedule.cpp's Varuna builder, schedule_chunked.cpp): integer ticks.
// Private to common/src.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

#include "varuna/common/errors.h"

namespace varuna::ticks {

constexpr long kNever = std::numeric_limits<long>::max();

// The next tick at which a task may become ready: readiness only changes at
// a task's end or when a message arrives. So after a tick where something
// started or ended, the next tick (a message of one tick arrives then);
// otherwise the earliest end or arrival still ahead (idle ticks in between
// change nothing, and skipping them keeps the result identical while making
// it O(tasks)). `freeAt`: per stage, when its current task ends;
// `nextArrival`: the earliest arrival of a message after `now` (kNever:
// none, or messages of one tick). `what` names the schedule in the error of
// a simulation where nothing can run.
inline long nextEvent(const std::vector<long>& freeAt, long now, bool startedNow, const char* what,
                      long nextArrival = kNever) {
  bool endedNow = false;
  long next = nextArrival;
  for (long t : freeAt) {
    endedNow = endedNow || t == now;
    if (t > now) next = std::min(next, t);
  }
  if (startedNow || endedNow) return now + 1;
  VARUNA_CHECK(next != kNever, what, " schedule simulation stalled: no stage can run and none is busy");
  return next;
}

}  // namespace varuna::ticks
