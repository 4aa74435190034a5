// Fast paths for the messages that are most of what run_varuna reads: a
// worker's Heartbeat (from every worker that beats to it directly) and an
// agent's WorkerBeats (a relay per host every few hundred milliseconds, with
// its workers' beats and step reports). Their canonical encoding (what
// encode() writes: keys sorted, no spaces) is matched here without building a
// JSON document, which costs dozens of allocations per relay. Anything else
// (spaces, another key order, an unknown key, an integer with a fraction or
// exponent, a leading zero, -0, more than 18 digits, a value outside its
// field's type) returns nullopt and is left to the full parser, so the
// decoded message never differs from what the parser gives
// (protocol_test: both paths on the same frames).
#pragma once

#include <optional>
#include <string_view>

#include "varuna/common/protocol.h"

namespace varuna::proto::canonical {

std::optional<Heartbeat> heartbeat(std::string_view body);
std::optional<WorkerBeats> workerBeats(std::string_view body);

}  // namespace varuna::proto::canonical
