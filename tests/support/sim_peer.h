// SimPeer: one simulated connection to run_varuna's control port (an agent, a
// worker or a notifier of SimCluster). Connects, sends the hello first, then
// reads frames until closed. Two transports, one behaviour:
//  - TCP (the bench's thousand peers), in TLS with the hello's credential as
//    run_varuna's peers speak (loop/tls_stream.h) through the stream path
//    below; in plaintext (tls::plaintextRequested(): a manager with
//    --insecure_plaintext_control) writes go straight to the non-blocking
//    socket and only what the kernel does not take waits in an outbox for the
//    socket to become writable;
//  - a LocalNetwork (the daemon's fake-clock tests): an in-memory stream to
//    the in-process daemon, no socket; the outbox goes out one write at a
//    time.
// pause() models a frozen process (SIGSTOP): nothing more is read or handed to
// the callbacks and nothing is sent, but the connection stays open (the
// manager's writes pile up unread, then stall, as in a full socket buffer);
// resume() delivers what arrived meanwhile, including a close.
// Owned by shared_ptr (handlers keep it alive); single-threaded: every call
// and callback on the io_context's thread.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <array>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "varuna/common/protocol.h"
#include "varuna/manager/byte_stream.h"
#include "varuna/manager/local_network.h"

namespace varuna::sim {

class SimPeer : public std::enable_shared_from_this<SimPeer> {
 public:
  using OnMessage = std::function<void(const proto::Message&)>;
  // The connection ended without close() being called: by the manager (EOF,
  // reset), a failed connect, a bad frame. Called once.
  using OnClose = std::function<void(const std::string& reason)>;

  // Over TCP, or (`network` set) over `network`, which outlives the peer.
  explicit SimPeer(boost::asio::io_context& io, LocalNetwork* network = nullptr)
      : io_(io), socket_(io), network_(network) {}

  // Connects (to `endpoint`, or dials the local network, where the address
  // means nothing), sends `hello`, calls onConnected, then reads until closed.
  void connect(const boost::asio::ip::tcp::endpoint& endpoint, const proto::Hello& hello, OnMessage onMessage,
               OnClose onClose, std::function<void()> onConnected);

  // Sends an encoded frame (dropped when closed or paused). Returns false if
  // it was dropped.
  bool send(std::string_view frame);
  bool send(const proto::Message& message) { return send(proto::encode(message)); }

  // Closes without calling onClose (the simulation chose to).
  void close();
  // The same once what was sent has left (an agent's last reports before it exits).
  void closeAfterSending();
  void pause();
  void resume();

  bool open() const { return open_; }
  bool paused() const { return paused_; }
  uint64_t framesSent() const { return framesSent_; }

 private:
  void onConnect(const boost::system::error_code& ec, const proto::Hello& hello,
                 const std::function<void()>& onConnected);
  void doRead();
  void onRead(const boost::system::error_code& ec, size_t bytes);
  void deliver();
  // The outbox's next part towards the manager: a wait for the socket to be
  // writable, or the in-memory stream's next write.
  void flush();
  void waitWritable();
  void writeToStream();
  void fail(const std::string& reason);
  void shutdown();

  boost::asio::io_context& io_;
  boost::asio::ip::tcp::socket socket_;  // TCP: open once connected
  LocalNetwork* network_;
  std::unique_ptr<ByteStream> stream_;  // the local network's: set once dialled
  std::string inFlight_;                // the stream's write under way (outbox_ moved in)
  bool open_ = false;
  bool closed_ = false;  // by close()
  bool closing_ = false;  // closeAfterSending(): close once the outbox is empty
  bool paused_ = false;
  bool reading_ = false;  // a read is in flight
  std::string closedWhilePaused_;  // the close that arrived while paused (delivered on resume)
  std::string outbox_;
  proto::FrameDecoder decoder_;
  std::array<char, 4096> readBuffer_{};
  uint64_t framesSent_ = 0;
  OnMessage onMessage_;
  OnClose onClose_;
};

}  // namespace varuna::sim
