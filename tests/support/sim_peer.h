// SimPeer: one simulated connection to run_varuna's control port (an agent, a
// worker or a notifier of SimCluster). Connects, sends the hello first, then
// reads frames until closed. Writes go straight to the non-blocking socket;
// only what the kernel does not take waits in an outbox for the socket to
// become writable, so a thousand peers cost one thread nothing but syscalls.
// pause() models a frozen process (SIGSTOP): nothing more is read or handed to
// the callbacks and nothing is sent, but the socket stays open; resume()
// delivers what arrived meanwhile, including a close.
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

namespace varuna::sim {

class SimPeer : public std::enable_shared_from_this<SimPeer> {
 public:
  using OnMessage = std::function<void(const proto::Message&)>;
  // The connection ended without close() being called: by the manager (EOF,
  // reset), a failed connect, a bad frame. Called once.
  using OnClose = std::function<void(const std::string& reason)>;

  explicit SimPeer(boost::asio::io_context& io) : socket_(io) {}

  // Connects, sends `hello`, calls onConnected, then reads until closed.
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
  void doRead();
  void onRead(const boost::system::error_code& ec, size_t bytes);
  void deliver();
  void waitWritable();
  void fail(const std::string& reason);
  void shutdown();

  boost::asio::ip::tcp::socket socket_;
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
