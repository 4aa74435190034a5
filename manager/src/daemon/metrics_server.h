// MetricsServer: serves a registry (JobMetrics') in Prometheus' text format at
// http://IP:PORT/metrics (run_varuna --metrics_port). prometheus-cpp's pull
// Exposer runs civetweb on threads of its own; a scrape reads the metric
// objects there (atomics) and never touches the daemon's event loop, which
// never waits on a scrape. Owned by the ManagerDaemon; destroyed before the
// registry's owner (its destructor stops and joins civetweb's threads).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace prometheus {
class Exposer;
class Registry;
}  // namespace prometheus

namespace varuna {

class MetricsServer {
 public:
  // Binds ip:port (port 0: any free one) and serves `registry` at /metrics.
  // Throws ConfigError naming --metrics_port and the fix when it cannot
  // (the port is in use, the address is not this machine's).
  MetricsServer(const std::string& ip, int port, const std::shared_ptr<prometheus::Registry>& registry);
  ~MetricsServer();

  uint16_t port() const { return port_; }
  // host:port as a URL's authority ("127.0.0.1:9400", "[::1]:9400").
  const std::string& address() const { return address_; }
  std::string url() const { return "http://" + address_ + "/metrics"; }

 private:
  std::unique_ptr<prometheus::Exposer> exposer_;
  uint16_t port_ = 0;
  std::string address_;
};

}  // namespace varuna
