#include "daemon/metrics_server.h"

#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include "varuna/common/errors.h"

namespace varuna {
namespace {

std::string hostPort(const std::string& ip, int port) {
  return ip.find(':') != std::string::npos ? strCat("[", ip, "]:", port) : strCat(ip, ":", port);
}

// One scrape at a time is the usual load (a Prometheus or two); civetweb's
// master thread comes on top.
constexpr size_t kServerThreads = 2;

}  // namespace

MetricsServer::MetricsServer(const std::string& ip, int port, const std::shared_ptr<prometheus::Registry>& registry) {
  const std::string bind = hostPort(ip, port);
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(bind, kServerThreads);
  } catch (const std::exception& e) {
    // civetweb says only "Possible problem binding to port": a port in use,
    // or an address that is not this machine's.
    throw ConfigError(strCat("--metrics_port ", port, ": cannot serve metrics on ", bind, " (", e.what(),
                             "): is the port in use (another run_varuna, a node exporter)? Pick a free "
                             "--metrics_port, or 0 for any free port (state.json's \"metrics_address\" names it)"));
  }
  const auto ports = exposer_->GetListeningPorts();
  port_ = ports.empty() ? static_cast<uint16_t>(port) : static_cast<uint16_t>(ports.front());
  address_ = hostPort(ip, port_);
  exposer_->RegisterCollectable(registry, "/metrics");
}

MetricsServer::~MetricsServer() = default;

}  // namespace varuna
