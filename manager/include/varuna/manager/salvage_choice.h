// Which step a salvage writes, and who writes it (docs/salvage.md).
//
// When a generation ends on a sudden loss, each surviving worker reports the
// step its memory holds whole: the last step whose job-wide exchange it
// finished (it applies that step's update without talking to anyone again).
// A rank that died during the exchange may leave survivors on both sides of
// it (some finished step N+1, some still hold N). Those still at N did all
// of N+1 but the exchange: given its result, relayed from a survivor that
// finished it, they can apply N+1 themselves ("finish" it). So the choice is
// the newest step that some survivor of *every* stage holds or can finish,
// where finishing needs a survivor that holds the step and its exchange
// result. One survivor per stage writes that stage's share; writers are
// spread over hosts, and hosts about to be taken (a preemption notice) are
// used only when nothing else holds the step. Pure: no I/O, no clock.
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
  int64_t finishableStep = -1;   // step + 1 when only its exchange is missing, else -1
  std::vector<double> exchange;  // the result of the exchange of step `exchangeStep` the rank finished
  // The step of `exchange` (-1: `step`'s): for a rank that applied a step but
  // missed its buffer broadcast (its `step` is -1), the step it applied.
  int64_t exchangeStep = -1;
};

struct SalvageChoice {
  int64_t step = 0;
  std::vector<int> writers;  // the writing rank of each stage, by stage
  // The step's exchange result, when a writer must finish the step first
  // (`finishing`, by rank); empty otherwise.
  std::vector<double> exchange;
  std::vector<int> finishing;
};

// nullopt when no step is held (or can be finished) by a survivor of every
// one of `stages` stages.
std::optional<SalvageChoice> chooseSalvage(const std::vector<SalvageReport>& reports, int stages,
                                           const std::set<std::string>& leavingHosts);

// Why chooseSalvage found nothing, for the event log: e.g. "no survivor of
// stage 1" or "no step common to every stage (stage 0 holds 41, stage 1 holds 40)".
std::string whyNoSalvage(const std::vector<SalvageReport>& reports, int stages);

}  // namespace varuna
