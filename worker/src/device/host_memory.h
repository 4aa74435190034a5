// How the process's C library allocator treats large host blocks
// (VarunaOptions::hostMemory). Called once, from Varuna's constructor on the
// training thread, before the stage is built.
#pragma once

#include <string>

#include "varuna/worker/varuna.h"

namespace varuna {

// Applies `mode` to glibc's malloc: kCompact gives blocks of 4 MiB and more
// their own mappings, returned to the system when freed (a fixed
// M_MMAP_THRESHOLD; M_TRIM_THRESHOLD raised so the heap below is not
// trimmed and regrown every step); kFast leaves glibc's defaults. A setting
// the user made through MALLOC_MMAP_THRESHOLD_ wins. Returns what was done,
// for the log.
std::string applyHostMemory(HostMemory mode);

}  // namespace varuna
