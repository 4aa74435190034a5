// ByteStream: the byte-stream seam under a control-protocol connection
// (FramedConnection, SimPeer). Production uses TCP (loop/tcp_stream.h,
// wrapping an accepted or connected socket); the daemon's fake-clock tests use
// memoryStreamPair, so that their simulated peers talk to the real daemon
// with no socket at all (LocalNetwork hands such pairs out).
//
// Semantics are those of an Asio stream socket, as FramedConnection relies on
// them: a read completes with some bytes (at least one), with
// boost::asio::error::eof once the other end closed and every byte it wrote
// was read, or with operation_aborted when this end was closed meanwhile; a
// write completes once every byte was taken. Handlers run as handlers of the
// stream's io_context, never inline in the call that started the operation.
// One read and one write in flight at a time; the buffers stay valid until
// their handler runs.
//
// Owned by one connection object (unique_ptr); used on its io_context's
// thread only. Public (varuna/manager/) because DaemonOptions carries a
// LocalNetwork and the test support (tests/support/sim_peer.h) dials it.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio/io_context.hpp>
#include <boost/system/error_code.hpp>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "varuna/common/control_tls.h"

namespace varuna {

class ByteStream {
 public:
  using Handler = std::function<void(const boost::system::error_code&, size_t bytes)>;

  virtual ~ByteStream() = default;
  // Reads at most `size` bytes into `data`.
  virtual void asyncReadSome(char* data, size_t size, Handler handler) = 0;
  // Writes all `size` bytes of `data`.
  virtual void asyncWrite(const char* data, size_t size, Handler handler) = 0;
  // Closes this end now: its pending operations complete with
  // operation_aborted; the other end reads what was already written, then EOF.
  // Idempotent.
  virtual void close() = 0;
  // Who is at the other end, for logs ("10.0.0.2:41234", "memory:agent 127.0.0.2").
  virtual const std::string& peer() const = 0;
  // The identity the peer proved in a TLS handshake (loop/tls_stream.h);
  // nullopt for a stream without one (plaintext TCP, in-memory).
  virtual std::optional<tls::PskIdentity> authenticatedIdentity() const { return std::nullopt; }
  // Why the TLS handshake failed, in words; "" if it did not (or there is none).
  virtual std::string handshakeFailure() const { return {}; }
};

// Two connected in-memory ends, a and b: what one writes, the other reads.
// Each direction holds at most `capacity` unread bytes, as a socket's buffers
// do: a write to a peer that stops reading stays pending until it reads.
// `nameA` and `nameB` are the ends' own names (a's peer() is nameB).
struct MemoryStreamPair {
  std::unique_ptr<ByteStream> a, b;
};
MemoryStreamPair memoryStreamPair(boost::asio::io_context& io, const std::string& nameA, const std::string& nameB,
                                  size_t capacity = 256 * 1024);

}  // namespace varuna
