// The wire form of each control message, declared once: its type tag and a
// table of fields (wire name, member, how it is read). encodeMessage and
// decodeMessage walk the table, so a field's name is written in one place
// and every field is decoded by name. Private to protocol.cpp.
//
// Field kinds:
//   required(name, &T::m)        must be present, of the member's JSON type
//   optional(name, &T::m, v)     may be absent (older peers): then v
//   bounded(name, &T::m)         text cut to kMaxErrorTextBytes, valid UTF-8,
//                                on both sides (peer text goes into logs)
//   exchange(name, &T::m)        a salvage exchange result: [] or
//                                kExchangeValues numbers, non-finite as null;
//                                absent: []
#pragma once

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "varuna/common/protocol.h"

namespace varuna::proto {

// A value of the member's type. An integer member takes a JSON integer within
// its range only: nlohmann would cast a float or an out-of-range integer
// ("step": 1e300) with a plain conversion, undefined behaviour on a value
// any authenticated peer chooses.
template <typename M>
void readValue(const nlohmann::json& v, M& out) {
  if constexpr (std::is_integral_v<M> && !std::is_same_v<M, bool>) {
    const bool fits = v.is_number_unsigned()
                          ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<M>::max())
                          : v.is_number_integer() && v.get<int64_t>() >= static_cast<int64_t>(std::numeric_limits<M>::min()) &&
                                v.get<int64_t>() <= static_cast<int64_t>(std::numeric_limits<M>::max());
    if (!fits) {
      throw ProtocolError(std::string("malformed message: ") + (v.is_number() ? v.dump() : v.type_name()) +
                          " where an integer within the field's range belongs");
    }
    out = static_cast<M>(v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>());
  } else {
    v.get_to(out);
  }
}
template <typename M>
M readValue(const nlohmann::json& v) {
  M out{};
  readValue(v, out);
  return out;
}

// Nested values.
inline void to_json(nlohmann::json& j, const WorkerSpec& w) { j = {{"rank", w.rank}, {"local_rank", w.localRank}}; }
inline void from_json(const nlohmann::json& j, WorkerSpec& w) {
  readValue(j.at("rank"), w.rank);
  readValue(j.at("local_rank"), w.localRank);
}
// [rank, step, waiting]: a host's worth of beats in one small frame.
inline void to_json(nlohmann::json& j, const WorkerBeat& b) { j = {b.rank, b.step, b.waiting}; }
inline void from_json(const nlohmann::json& j, WorkerBeat& b) {
  if (!j.is_array() || j.size() != 3) throw ProtocolError("worker_beats: each beat must be [rank, step, waiting]");
  readValue(j.at(0), b.rank);
  readValue(j.at(1), b.step);
  readValue(j.at(2), b.waiting);
}

// [rank, stage, replica, step, loss, step_seconds, compute_seconds_per_microbatch]:
// a relayed step report (WorkerBeats::reports). A non-finite figure (a loss
// that overflowed) travels as null and comes back as NaN: one bad step must
// not cost the host's whole relay.
inline nlohmann::json finiteOrNull(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }
inline double numberOrNan(const nlohmann::json& v) {
  return v.is_null() ? std::numeric_limits<double>::quiet_NaN() : v.get<double>();
}
inline void to_json(nlohmann::json& j, const StepReport& r) {
  j = {r.rank, r.stage, r.replica, r.step, finiteOrNull(r.loss), finiteOrNull(r.stepSeconds),
       finiteOrNull(r.computeSecondsPerMicrobatch)};
}
inline void from_json(const nlohmann::json& j, StepReport& r) {
  if (!j.is_array() || j.size() != 7) {
    throw ProtocolError("worker_beats: each report must be [rank, stage, replica, step, loss, step_seconds, "
                        "compute_seconds_per_microbatch]");
  }
  readValue(j.at(0), r.rank);
  readValue(j.at(1), r.stage);
  readValue(j.at(2), r.replica);
  readValue(j.at(3), r.step);
  r.loss = numberOrNan(j.at(4));
  r.stepSeconds = numberOrNan(j.at(5));
  r.computeSecondsPerMicrobatch = numberOrNan(j.at(6));
}

namespace wire {

template <typename T, typename M>
struct Required {
  const char* name;
  M T::*member;
};
template <typename T, typename M>
struct Optional {
  const char* name;
  M T::*member;
  M fallback;
};
template <typename T>
struct Bounded {
  const char* name;
  std::string T::*member;
};
template <typename T>
struct Exchange {
  const char* name;
  std::vector<double> T::*member;
};

template <typename T, typename M>
constexpr Required<T, M> required(const char* name, M T::*member) {
  return {name, member};
}
template <typename T, typename M>
constexpr Optional<T, M> optional(const char* name, M T::*member, M fallback) {
  return {name, member, fallback};
}
template <typename T>
constexpr Bounded<T> bounded(const char* name, std::string T::*member) {
  return {name, member};
}
template <typename T>
constexpr Exchange<T> exchange(const char* name, std::vector<double> T::*member) {
  return {name, member};
}

// Writing.
template <typename T, typename M>
void write(nlohmann::json& j, const T& m, const Required<T, M>& f) {
  j[f.name] = m.*(f.member);
}
template <typename T, typename M>
void write(nlohmann::json& j, const T& m, const Optional<T, M>& f) {
  j[f.name] = m.*(f.member);
}
template <typename T>
void write(nlohmann::json& j, const T& m, const Bounded<T>& f) {
  j[f.name] = boundedText(m.*(f.member));
}
template <typename T>
void write(nlohmann::json& j, const T& m, const Exchange<T>& f) {
  auto values = nlohmann::json::array();
  for (double v : m.*(f.member)) values.push_back(std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr));
  j[f.name] = values;
}

// Reading.
template <typename T, typename M>
void read(const nlohmann::json& j, T& m, const Required<T, M>& f) {
  readValue(j.at(f.name), m.*(f.member));
}
template <typename T, typename M>
void read(const nlohmann::json& j, T& m, const Optional<T, M>& f) {
  m.*(f.member) = j.contains(f.name) ? readValue<M>(j.at(f.name)) : f.fallback;
}
template <typename T>
void read(const nlohmann::json& j, T& m, const Bounded<T>& f) {
  m.*(f.member) = boundedText(j.at(f.name).template get<std::string>());
}
template <typename T>
void read(const nlohmann::json& j, T& m, const Exchange<T>& f, const char* type) {
  auto& out = m.*(f.member);
  out.clear();
  if (!j.contains(f.name)) return;
  const auto& values = j.at(f.name);
  if (!values.is_array() || !(values.empty() || values.size() == kExchangeValues)) {
    throw ProtocolError(std::string(type) + ": " + f.name + " must be [] or an array of " +
                        std::to_string(kExchangeValues) + " numbers");
  }
  for (const auto& v : values) {
    if (!v.is_null() && !v.is_number()) throw ProtocolError(std::string(type) + ": exchange values must be numbers or null");
    out.push_back(v.is_null() ? std::numeric_limits<double>::infinity() : v.template get<double>());
  }
}
template <typename T, typename F>
void read(const nlohmann::json& j, T& m, const F& f, const char*) {
  read(j, m, f);
}

// One specialisation per message (protocol.cpp): `type` and `fields()`.
template <typename T>
struct Form;

template <typename T>
nlohmann::json encodeMessage(const T& m) {
  nlohmann::json j = {{"type", Form<T>::type}};
  std::apply([&](const auto&... field) { (write(j, m, field), ...); }, Form<T>::fields());
  return j;
}

template <typename T>
T decodeMessage(const nlohmann::json& j) {
  T m;
  std::apply([&](const auto&... field) { (read(j, m, field, Form<T>::type), ...); }, Form<T>::fields());
  return m;
}

}  // namespace wire
}  // namespace varuna::proto
