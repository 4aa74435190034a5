// Which step a salvage writes, and who writes it (docs/salvage.md).
//
// When a generation ends on a sudden loss, each surviving worker reports the
// step its memory holds whole: the last step whose job-wide exchange it
// finished (it applies that step's update without talking to anyone again).
// A rank that died during the exchange may leave survivors on both sides of
// it (some finished step N+1, some still hold N), so the choice is the
// newest step that some survivor of *every* stage holds. One survivor per
// stage writes that stage's share; writers are spread over hosts, and hosts
// about to be taken (a preemption notice) are used only when nothing else
// holds the step. Pure: no I/O, no clock.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace varuna {

struct SalvageReport {
  int rank = 0;
  int stage = 0;
  int64_t step = -1;  // -1: nothing it can vouch for
  std::string host;
};

struct SalvageChoice {
  int64_t step = 0;
  std::vector<int> writers;  // the writing rank of each stage, by stage
};

// nullopt when no step is held by a survivor of every one of `stages` stages.
std::optional<SalvageChoice> chooseSalvage(const std::vector<SalvageReport>& reports, int stages,
                                           const std::set<std::string>& leavingHosts);

// Why chooseSalvage found nothing, for the event log: e.g. "no survivor of
// stage 1" or "no step common to every stage (stage 0 holds 41, stage 1 holds 40)".
std::string whyNoSalvage(const std::vector<SalvageReport>& reports, int stages);

}  // namespace varuna
