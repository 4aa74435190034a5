#include "daemon/host_absences.h"
#include "varuna/common/time_util.h"

#include <algorithm>

namespace varuna {

HostAbsence& HostAbsences::markAbsent(const std::string& host, const std::string& why, TimePoint now) {
  auto [it, fresh] = absent_.try_emplace(host);
  if (fresh) {
    it->second.why = why;
    it->second.since = now;
    // Back only a short while ago: a flapping host, whose backoff goes on
    // from where it was rather than from the first wait.
    if (auto r = returned_.find(host); r != returned_.end() && now - r->second.first < policy_.most) {
      it->second.backoff = r->second.second;
    }
  }
  return it->second;
}

void HostAbsences::scheduleRetry(const std::string& host, TimePoint now) {
  HostAbsence& absence = absent_.at(host);
  if (policy_.first.count() <= 0) return;  // --host_retry_s 0: back only when the list is written
  absence.backoff = DoublingBackoff::after(absence.backoff, policy_.first, policy_.most);
  absence.retryAt = now + absence.backoff;
}

void HostAbsences::markPreempted(const std::string& host, TimePoint until, TimePoint now) {
  HostAbsence& absence = markAbsent(host, "preempted", now);
  absence.preemptedUntil = until;
  if (policy_.first.count() > 0) absence.retryAt = std::max(absence.retryAt.value_or(TimePoint{}), until);
}

void HostAbsences::markSlow(const std::string& host, TimePoint now) { markAbsent(host, "slow", now).slow = true; }

void HostAbsences::noteAttempt(const std::string& host) {
  if (auto* absence = find(host)) ++absence->attempts;
}

bool HostAbsences::mayComeBack(const std::string& host, TimePoint now) const {
  const HostAbsence* absence = find(host);
  return absence && !absence->slow && (!absence->preemptedUntil || now >= *absence->preemptedUntil);
}

bool HostAbsences::preempted(const std::string& host) const {
  const HostAbsence* absence = find(host);
  return absence && absence->preemptedUntil.has_value();
}

bool HostAbsences::retryDue(const std::string& host, TimePoint now) const {
  const HostAbsence* absence = find(host);
  return absence && absence->retryAt && now >= *absence->retryAt;
}

std::optional<HostAbsence> HostAbsences::back(const std::string& host, TimePoint now) {
  auto it = absent_.find(host);
  if (it == absent_.end()) return std::nullopt;
  HostAbsence absence = it->second;
  absent_.erase(it);
  // Only returns within policy_.most matter (flapping): older ones go.
  std::erase_if(returned_, [&](const auto& r) { return now - r.second.first >= policy_.most; });
  returned_[host] = {now, absence.backoff};
  return absence;
}

std::optional<std::string> HostAbsences::readmit(const std::string& host, TimePoint now) {
  HostAbsence* absence = find(host);
  if (!absence) return std::nullopt;
  absence->slow = false;
  absence->preemptedUntil.reset();
  absence->backoff = std::chrono::milliseconds(0);
  absence->retryAt = now;  // at the next look (the pool's retry), if its agent is not up
  return absence->why;
}

const HostAbsence* HostAbsences::find(const std::string& host) const {
  auto it = absent_.find(host);
  return it == absent_.end() ? nullptr : &it->second;
}

HostAbsence* HostAbsences::find(const std::string& host) {
  auto it = absent_.find(host);
  return it == absent_.end() ? nullptr : &it->second;
}

nlohmann::json HostAbsences::describe(const std::string& host, bool agentStarting, TimePoint now) const {
  const HostAbsence* absence = find(host);
  if (!absence) return nullptr;
  const char* backWhen = absence->slow                                                ? "the machine list is written"
                         : absence->preemptedUntil && now < *absence->preemptedUntil ? "the preemption deadline has passed"
                         : absence->retryAt || agentStarting                         ? "its agent is up"
                                                                                     : "the machine list is written";
  return {{"why", absence->why},
          {"for_s", secondsBetween(absence->since, now)},
          {"attempts", absence->attempts},
          {"back_when", backWhen},
          {"retry_in_s",
           absence->retryAt ? nlohmann::json(std::max(0.0, secondsBetween(now, *absence->retryAt))) : nlohmann::json()},
          {"deadline_in_s", absence->preemptedUntil
                                ? nlohmann::json(std::max(0.0, secondsBetween(now, *absence->preemptedUntil)))
                                : nlohmann::json()}};
}

}  // namespace varuna
