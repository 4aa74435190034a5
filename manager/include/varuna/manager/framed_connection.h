// FramedConnection: one control-protocol connection (protocol.h) on an Asio
// io_context, used by run_varuna for every peer and by the agent for its link
// to the manager. Owned through shared_ptr (handlers keep it alive); all
// callbacks run on the io_context's thread; no exception escapes a handler:
// a bad frame or a socket error closes the connection and calls onClose once.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "varuna/common/protocol.h"

namespace varuna {

class FramedConnection : public std::enable_shared_from_this<FramedConnection> {
 public:
  using OnMessage = std::function<void(const proto::Message&)>;
  using OnClose = std::function<void(const std::string& reason)>;

  explicit FramedConnection(boost::asio::ip::tcp::socket socket);

  // Starts the read loop, or (called again, e.g. from onMessage once a hello
  // says who the peer is) replaces the callbacks of the running one. Callbacks
  // may call send(), close() and start().
  void start(OnMessage onMessage, OnClose onClose);
  // Queues a frame; frames go out in order.
  void send(const proto::Message& message);
  // Closes now (queued frames are dropped) and calls onClose(reason) once.
  void close(const std::string& reason);
  // Sends what is queued, then closes.
  void closeAfterSending(const std::string& reason);
  bool open() const { return open_; }
  const std::string& peer() const { return peer_; }

 private:
  void doRead();
  void onRead(const boost::system::error_code& ec, size_t bytes);
  void doWrite();
  void onWrite(const boost::system::error_code& ec);

  boost::asio::ip::tcp::socket socket_;
  std::string peer_;
  proto::FrameDecoder decoder_;
  std::array<char, 16384> readBuffer_{};
  std::deque<std::string> writeQueue_;
  OnMessage onMessage_;
  OnMessage replacedOnMessage_;  // start() from inside onMessage_: kept alive until it returns
  OnClose onClose_;
  bool open_ = true;
  // One read at a time: two would share readBuffer_, and the second would
  // overwrite bytes the first's handler has not consumed yet.
  bool reading_ = false;
  bool dispatching_ = false;
  bool closeWhenDrained_ = false;
  std::string pendingCloseReason_;
};

}  // namespace varuna
