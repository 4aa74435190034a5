// LocalNetwork: an in-process "network" with one listener, through which a
// test's simulated peers reach an in-process ManagerDaemon without a socket
// (DaemonOptions::localConnections). The daemon's ControlListener listens on
// it at start(); dial() hands the caller the client end of a fresh
// memoryStreamPair and the listener the server end, which then goes through
// exactly the path a TCP accept takes (the pending-connection cap, the hello
// deadline, the token check).
//
// Owned by the test, which keeps it alive longer than the daemon and its
// peers. Single-threaded: every call on the io_context's thread (the
// daemon's own).
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "varuna/manager/byte_stream.h"

namespace varuna {

class LocalNetwork {
 public:
  using OnAccept = std::function<void(std::unique_ptr<ByteStream> serverEnd)>;

  explicit LocalNetwork(boost::asio::io_context& io) : io_(io) {}

  // The listener (one at a time): onAccept gets each dialled connection, as a
  // handler of the io_context (after dial() has returned).
  void listen(OnAccept onAccept) { onAccept_ = std::move(onAccept); }
  void stopListening() { onAccept_ = nullptr; }
  bool listening() const { return static_cast<bool>(onAccept_); }

  // Connects `peerName` (how the listener's logs name it): the client end,
  // or nullptr when nobody listens (as a refused TCP connect).
  std::unique_ptr<ByteStream> dial(const std::string& peerName);

  // Connections dialled, accepted or refused: a test's proof that its peers
  // came this way.
  uint64_t dials() const { return dials_; }

 private:
  boost::asio::io_context& io_;
  OnAccept onAccept_;
  uint64_t dials_ = 0;
};

}  // namespace varuna
