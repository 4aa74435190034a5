#include "daemon/agent_launches.h"

#include <algorithm>

#include "varuna/common/secrets.h"
#include "varuna/manager/credentials.h"

namespace varuna {

std::string AgentLaunches::start(const std::string& host) {
  Host& h = hosts_[host];
  if (!h.latest.empty()) h.earlier.push_back(std::move(h.latest));
  if (h.earlier.size() > kMaxEarlier) h.earlier.erase(h.earlier.begin(), h.earlier.end() - kMaxEarlier);
  h.latest = credentials::newNonce();  // random: nobody can name a start before it is made
  return h.latest;
}

bool AgentLaunches::agentUp(const std::string& host, const std::string& nonce) {
  auto it = hosts_.find(host);
  if (it == hosts_.end() || it->second.earlier.empty() || it->second.latest.empty()) return false;
  if (!constantTimeEquals(nonce, it->second.latest)) return false;  // an earlier start's agent: the latest may still come
  it->second.earlier.clear();
  return true;
}

AgentLaunches::Standing AgentLaunches::standing(const std::string& host, const std::string& nonce) const {
  auto it = hosts_.find(host);
  if (it == hosts_.end() || nonce.empty()) return Standing::kRevoked;
  if (!it->second.latest.empty() && constantTimeEquals(nonce, it->second.latest)) return Standing::kLatest;
  const auto& earlier = it->second.earlier;
  const bool known = std::any_of(earlier.begin(), earlier.end(),
                                 [&](const std::string& e) { return constantTimeEquals(nonce, e); });
  return known ? Standing::kEarlier : Standing::kRevoked;
}

bool AgentLaunches::forget(const std::string& host) { return hosts_.erase(host) > 0; }

std::vector<std::string> AgentLaunches::hosts() const {
  std::vector<std::string> names;
  for (const auto& [host, h] : hosts_) names.push_back(host);
  return names;
}

nlohmann::json AgentLaunches::toJson() const {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [host, h] : hosts_) {
    nlohmann::json nonces = nlohmann::json::array();
    if (!h.latest.empty()) nonces.push_back(h.latest);
    for (auto e = h.earlier.rbegin(); e != h.earlier.rend(); ++e) nonces.push_back(*e);
    out[host] = std::move(nonces);
  }
  return out;
}

void AgentLaunches::restore(const nlohmann::json& saved) {
  if (!saved.is_object()) return;
  for (const auto& [host, nonces] : saved.items()) {
    if (!nonces.is_array()) continue;
    Host& h = hosts_[host];
    // Newest first in the file; the earliest are dropped past the bound.
    for (auto n = nonces.rbegin(); n != nonces.rend(); ++n) {
      if (n->is_string() && !n->get<std::string>().empty()) h.earlier.push_back(n->get<std::string>());
    }
    // As many as toJson writes (the latest and kMaxEarlier before it).
    if (h.earlier.size() > kMaxEarlier + 1) h.earlier.erase(h.earlier.begin(), h.earlier.end() - (kMaxEarlier + 1));
    if (h.earlier.empty() && h.latest.empty()) hosts_.erase(host);
  }
}

}  // namespace varuna
