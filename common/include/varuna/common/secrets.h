// Handling the job's secrets (today the job token) without leaking them
// through the clock or the process table. Pure functions, any thread (but
// scrubEnvironmentVariable changes the process environment: call it before
// other threads read the environment, as every environment write must).
#pragma once

#include <string_view>

namespace varuna {

// Whether `a` equals `b`, in a time that depends on their lengths only, not
// on where they first differ (a token compared byte by byte with an early
// exit tells a prober how many leading bytes it guessed).
bool constantTimeEquals(std::string_view a, std::string_view b);

// Removes the environment variable `name` from this process once its value
// has been read: overwrites the value in place first (where the process's
// initial environment holds it, which is what /proc/<pid>/environ shows),
// then unsets it, so neither that file nor a process started later reveals
// it. Does nothing when `name` is not set.
void scrubEnvironmentVariable(const char* name);

}  // namespace varuna
