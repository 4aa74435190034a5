#include "varuna/common/profile.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "varuna/common/checkpoint_files.h"

namespace varuna::profile {
namespace {

using nlohmann::json;

double quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

json toJson(const Timing& t) {
  return {{"median_s", t.median}, {"min_s", t.min}, {"max_s", t.max}, {"spread", t.spread}, {"samples", t.samples}};
}

Timing timingFromJson(const json& j) {
  return Timing{j.at("median_s"), j.at("min_s"), j.at("max_s"), j.at("spread"), j.at("samples")};
}

// Linear through the two samples nearest to x (x sorted ascending in `points`).
double interpolate(const std::vector<std::pair<double, double>>& points, double x) {
  if (points.empty()) return 0;
  if (points.size() == 1) return points[0].second * (points[0].first > 0 ? std::max(x / points[0].first, 0.0) : 1.0);
  size_t hi = 1;
  while (hi + 1 < points.size() && points[hi].first < x) ++hi;
  const auto& [x0, y0] = points[hi - 1];
  const auto& [x1, y1] = points[hi];
  if (x1 == x0) return y1;
  return std::max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0));
}

}  // namespace

Timing summarize(std::vector<double> samples) {
  Timing t;
  if (samples.empty()) return t;
  std::sort(samples.begin(), samples.end());
  const double median = quantile(samples, 0.5);
  std::vector<double> deviations;
  for (double s : samples) deviations.push_back(std::abs(s - median));
  std::sort(deviations.begin(), deviations.end());
  const double mad = quantile(deviations, 0.5);
  std::vector<double> kept;
  for (double s : samples) {
    if (mad == 0 || std::abs(s - median) <= 3 * 1.4826 * mad) kept.push_back(s);
  }
  t.median = quantile(kept, 0.5);
  t.min = kept.front();
  t.max = kept.back();
  t.spread = t.median > 0 ? (quantile(kept, 0.9) - quantile(kept, 0.1)) / t.median : 0;
  t.samples = static_cast<int>(kept.size());
  return t;
}

std::vector<int64_t> Profile::microBatchSizes() const {
  std::vector<int64_t> sizes;
  if (pieces.empty()) return sizes;
  for (const auto& [size, _] : pieces.front().bySize) {
    const bool everywhere = std::all_of(pieces.begin(), pieces.end(),
                                        [size = size](const PieceProfile& p) { return p.bySize.count(size) > 0; });
    if (everywhere) sizes.push_back(size);
  }
  return sizes;
}

double Profile::p2pSeconds(int64_t bytes, bool sameHost) const {
  std::vector<std::pair<double, double>> points;
  for (const auto& s : p2p) {
    const double t = sameHost ? s.sameHostSeconds : s.crossHostSeconds;
    if (t >= 0) points.emplace_back(static_cast<double>(s.bytes), t);
  }
  if (points.empty() && !sameHost) return p2pSeconds(bytes, true);  // no second host measured: the same link
  std::sort(points.begin(), points.end());
  return interpolate(points, static_cast<double>(bytes));
}

double Profile::allreduceSeconds(int64_t bytes, int replicas, bool crossHost) const {
  if (replicas <= 1 || bytes <= 0) return 0;
  // The link kind asked for if it was measured, else the other one; then the
  // measured replica count closest to the one asked for.
  const bool kind = std::any_of(allreduce.begin(), allreduce.end(),
                                [&](const AllReduceSample& o) { return o.crossHost == crossHost; })
                        ? crossHost
                        : !crossHost;
  int best = -1;
  for (const auto& s : allreduce) {
    if (s.crossHost != kind) continue;
    if (best < 0 || std::abs(s.replicas - replicas) < std::abs(best - replicas)) best = s.replicas;
  }
  if (best < 0) return 0;
  std::vector<std::pair<double, double>> points;
  for (const auto& s : allreduce) {
    if (s.crossHost == kind && s.replicas == best) points.emplace_back(static_cast<double>(s.bytes), s.seconds);
  }
  std::sort(points.begin(), points.end());
  const double measured = interpolate(points, static_cast<double>(bytes));
  // Ring all-reduce moves 2(D-1)/D of the data per rank.
  const double scale = (2.0 * (replicas - 1) / replicas) / (2.0 * (best - 1) / best);
  return measured * scale;
}

std::string fingerprint(const std::vector<std::pair<std::string, std::vector<std::vector<int64_t>>>>& pieces) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  auto mix = [&hash](const std::string& text) {
    for (unsigned char c : text) {
      hash ^= c;
      hash *= 1099511628211ull;
    }
  };
  for (const auto& [name, shapes] : pieces) {
    mix(name + "{");
    for (const auto& shape : shapes) {
      for (int64_t d : shape) mix(std::to_string(d) + "x");
      mix(";");
    }
    mix("}");
  }
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

json toJson(const Profile& p) {
  json pieces = json::array();
  for (const auto& piece : p.pieces) {
    json sizes = json::object();
    for (const auto& [size, s] : piece.bySize) {
      sizes[std::to_string(size)] = {{"forward", toJson(s.forward)},
                                     {"backward", toJson(s.backward)},
                                     {"recompute", toJson(s.recompute)},
                                     {"output_bytes", s.outputBytes},
                                     {"saved_activation_bytes", s.savedActivationBytes},
                                     {"peak_bytes", s.peakBytes}};
      if (s.backwardInput.samples > 0 && s.backwardWeight.samples > 0) {
        sizes[std::to_string(size)]["backward_input"] = toJson(s.backwardInput);
        sizes[std::to_string(size)]["backward_weight"] = toJson(s.backwardWeight);
        sizes[std::to_string(size)]["split_kept_bytes"] = s.splitKeptBytes;
      }
    }
    pieces.push_back({{"name", piece.name}, {"param_count", piece.paramCount}, {"param_bytes", piece.paramBytes},
                      {"micro_batch", sizes}});
  }
  json p2p = json::array();
  for (const auto& s : p.p2p) {
    p2p.push_back({{"bytes", s.bytes}, {"same_host_s", s.sameHostSeconds}, {"cross_host_s", s.crossHostSeconds}});
  }
  json allreduce = json::array();
  for (const auto& s : p.allreduce) {
    allreduce.push_back({{"bytes", s.bytes}, {"replicas", s.replicas}, {"cross_host", s.crossHost}, {"seconds", s.seconds}});
  }
  return {{"format", "varuna-profile"},
          {"version", p.version},
          {"model_fingerprint", p.modelFingerprint},
          {"device", p.device},
          {"precision", p.precision},
          {"host", p.host},
          {"created_at", p.createdAt},
          {"optimizer_bytes_per_param", p.optimizerBytesPerParam},
          {"gradient_bytes_per_param", p.gradientBytesPerParam},
          {"optimizer_s_per_param", p.optimizerSecondsPerParam},
          {"pieces", pieces},
          {"p2p", p2p},
          {"allreduce", allreduce}};
}

Profile fromJson(const json& j, const std::string& source) {
  if (!j.is_object() || j.value("format", "") != "varuna-profile") {
    throw ProfileError(strCat(source, " is not a varuna profile (no \"format\": \"varuna-profile\")"));
  }
  const int version = j.value("version", 0);
  if (version != kVersion) {
    throw ProfileError(strCat(source, " is a version ", version, " profile; this build reads version ", kVersion,
                              ": profile the model again"));
  }
  try {
    Profile p;
    p.modelFingerprint = j.at("model_fingerprint");
    p.device = j.at("device");
    p.precision = j.at("precision");
    p.host = j.at("host");
    p.createdAt = j.at("created_at");
    p.optimizerBytesPerParam = j.at("optimizer_bytes_per_param");
    p.gradientBytesPerParam = j.at("gradient_bytes_per_param");
    p.optimizerSecondsPerParam = j.at("optimizer_s_per_param");
    for (const auto& piece : j.at("pieces")) {
      PieceProfile pp;
      pp.name = piece.at("name");
      pp.paramCount = piece.at("param_count");
      pp.paramBytes = piece.at("param_bytes");
      for (const auto& [size, s] : piece.at("micro_batch").items()) {
        const int64_t m = std::stoll(size);
        if (m < 1) {
          throw ProfileError(strCat(source, ": micro-batch size ", size, " of piece ", pp.name,
                                    " is not positive: profile the model again"));
        }
        pp.bySize[m] = PieceAtSize{timingFromJson(s.at("forward")), timingFromJson(s.at("backward")),
                                   timingFromJson(s.at("recompute")), s.at("output_bytes"),
                                   s.at("saved_activation_bytes"), s.at("peak_bytes")};
        if (s.contains("backward_input") && s.contains("backward_weight")) {
          pp.bySize[m].backwardInput = timingFromJson(s.at("backward_input"));
          pp.bySize[m].backwardWeight = timingFromJson(s.at("backward_weight"));
          pp.bySize[m].splitKeptBytes = s.value("split_kept_bytes", int64_t{0});
        }
      }
      p.pieces.push_back(std::move(pp));
    }
    for (const auto& s : j.at("p2p")) p.p2p.push_back({s.at("bytes"), s.at("same_host_s"), s.at("cross_host_s")});
    for (const auto& s : j.at("allreduce")) {
      p.allreduce.push_back({s.at("bytes"), s.at("replicas"), s.at("cross_host"), s.at("seconds")});
    }
    return p;
  } catch (const ProfileError&) {
    throw;
  } catch (const std::exception& e) {
    throw ProfileError(strCat(source, " is malformed (", e.what(), "): profile the model again"));
  }
}

void writeProfile(const Profile& profile, const std::string& path) {
  const std::filesystem::path file(path);
  const auto dir = file.has_parent_path() ? file.parent_path() : std::filesystem::path(".");
  std::filesystem::create_directories(dir);
  ckpt::writeFileAtomic(dir, file.filename().string(), toJson(profile).dump(1) + "\n");
}

Profile readProfile(const std::string& path, const std::string& expectedFingerprint) {
  std::ifstream in(path);
  if (!in) throw ProfileError(strCat("profile ", path, " cannot be read (run the profiler first)"));
  json j;
  try {
    j = json::parse(in);
  } catch (const std::exception& e) {
    throw ProfileError(strCat("profile ", path, " is not valid JSON (", e.what(), ")"));
  }
  Profile p = fromJson(j, "profile " + path);
  if (!expectedFingerprint.empty() && p.modelFingerprint != expectedFingerprint) {
    throw ProfileError(strCat("profile ", path, " is stale: the model changed since it was profiled (fingerprint ",
                              p.modelFingerprint, ", the model now ", expectedFingerprint, "); profile it again"));
  }
  return p;
}

Profile merge(Profile base, const Profile& added) {
  if (!base.modelFingerprint.empty() && base.modelFingerprint != added.modelFingerprint) {
    throw ProfileError("cannot add to a profile of another model (fingerprints differ): profile from scratch");
  }
  base.modelFingerprint = added.modelFingerprint;
  if (added.optimizerSecondsPerParam > 0) base.optimizerSecondsPerParam = added.optimizerSecondsPerParam;
  for (const auto& piece : added.pieces) {
    auto it = std::find_if(base.pieces.begin(), base.pieces.end(),
                           [&](const PieceProfile& p) { return p.name == piece.name; });
    if (it == base.pieces.end()) {
      base.pieces.push_back(piece);
      continue;
    }
    it->paramCount = piece.paramCount;
    it->paramBytes = piece.paramBytes;
    for (const auto& [size, figures] : piece.bySize) it->bySize[size] = figures;
  }
  for (const auto& s : added.p2p) {
    auto it = std::find_if(base.p2p.begin(), base.p2p.end(), [&](const P2PSample& o) { return o.bytes == s.bytes; });
    if (it == base.p2p.end()) {
      base.p2p.push_back(s);
    } else {
      if (s.sameHostSeconds >= 0) it->sameHostSeconds = s.sameHostSeconds;
      if (s.crossHostSeconds >= 0) it->crossHostSeconds = s.crossHostSeconds;
    }
  }
  for (const auto& s : added.allreduce) {
    auto it = std::find_if(base.allreduce.begin(), base.allreduce.end(), [&](const AllReduceSample& o) {
      return o.bytes == s.bytes && o.replicas == s.replicas && o.crossHost == s.crossHost;
    });
    if (it == base.allreduce.end()) {
      base.allreduce.push_back(s);
    } else {
      *it = s;
    }
  }
  return base;
}

}  // namespace varuna::profile
