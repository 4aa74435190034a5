// FramedConnection: one control-protocol connection (protocol.h) on an Asio
// io_context, used by run_varuna for every peer and by the agent for its link
// to the manager. It frames messages over a ByteStream: a TCP socket in
// production, an in-memory pair (memoryStreamPair) in the daemon's fake-clock
// tests, which then go through this same code with no socket. Owned through
// shared_ptr (handlers keep it alive); all callbacks run on the io_context's
// thread.
//
// No exception escapes a handler: a bad frame or a socket error closes the
// connection and calls onClose once (with a reason of at most
// proto::kMaxErrorTextBytes of valid UTF-8: a decoder's message may quote
// what the peer sent). An exception thrown by onMessage closes the connection
// too; one thrown by onClose is logged. With a HandlerGuard (setGuard), both
// are reported through it instead (rate-limited, counted).
//
// What a peer can make it buffer: a frame up to proto::kMaxFrameBytes, refused
// as soon as its 4-byte header announces more; with limitFirstFrame, the
// first frame (a hello) is held to a smaller bound the same way. After
// closeAfterSending nothing more is read or dispatched. What it buffers for a
// peer that does not read is capped too (maxQueuedBytes): past the cap the
// connection is closed, not grown without bound.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "varuna/common/protocol.h"
#include "varuna/manager/byte_stream.h"

namespace varuna {

class HandlerGuard;

class FramedConnection : public std::enable_shared_from_this<FramedConnection> {
 public:
  using OnMessage = std::function<void(const proto::Message&)>;
  using OnClose = std::function<void(const std::string& reason)>;

  // Over a connected TCP socket (loop/tcp_stream.h: Nagle off).
  explicit FramedConnection(boost::asio::ip::tcp::socket socket);
  // Over any byte stream, e.g. an in-memory end.
  explicit FramedConnection(std::unique_ptr<ByteStream> stream);

  // Starts the read loop, or (called again, e.g. from onMessage once a hello
  // says who the peer is) replaces the callbacks of the running one. Callbacks
  // may call send(), close() and start().
  void start(OnMessage onMessage, OnClose onClose);
  // Queues a frame; frames go out in order.
  void send(const proto::Message& message);
  // The same for a frame proto::encode made, e.g. once for many peers.
  void sendEncoded(std::string frame);
  // Closes now (queued frames are dropped) and calls onClose(reason) once.
  void close(const std::string& reason);
  // Sends what is queued, then closes. Stops reading at once.
  void closeAfterSending(const std::string& reason);
  bool open() const { return open_; }
  const std::string& peer() const { return stream_->peer(); }
  const ByteStream& stream() const { return *stream_; }

  // Call before start(): the connection's first frame may be at most
  // `maxBytes` long; a header announcing more closes the connection before
  // any of the body is buffered.
  void limitFirstFrame(size_t maxBytes) { firstFrameLimit_ = maxBytes; }
  // Frames queued for sending, in bytes, at most this (default 16 MiB, 16
  // frames of the protocol's largest); one more closes the connection ("the
  // peer does not read").
  static constexpr size_t kDefaultMaxQueuedBytes = 16u << 20;
  void limitQueuedBytes(size_t maxBytes) { maxQueuedBytes_ = maxBytes; }
  size_t queuedBytes() const { return queuedBytes_; }
  // Callbacks run under `guard` (which the connection keeps alive).
  void setGuard(std::shared_ptr<HandlerGuard> guard) { guard_ = std::move(guard); }

 private:
  void doRead();
  void onRead(const boost::system::error_code& ec, size_t bytes);
  // The first frame's header, once its 4 bytes are in: false (and closed) if
  // it announces more than firstFrameLimit_.
  bool checkFirstFrame(const char* data, size_t bytes);
  void deliver(const proto::Message& message);
  void doWrite();
  void onWrite(const boost::system::error_code& ec);

  std::unique_ptr<ByteStream> stream_;
  proto::FrameDecoder decoder_;
  std::array<char, 16384> readBuffer_{};
  std::deque<std::string> writeQueue_;
  size_t queuedBytes_ = 0;  // in writeQueue_
  size_t maxQueuedBytes_ = kDefaultMaxQueuedBytes;
  OnMessage onMessage_;
  OnMessage replacedOnMessage_;  // start() from inside onMessage_: kept alive until it returns
  OnClose onClose_;
  std::shared_ptr<HandlerGuard> guard_;
  size_t firstFrameLimit_ = 0;  // 0: only the protocol's limit
  uint32_t firstHeader_ = 0;
  int firstHeaderBytes_ = 0;
  bool open_ = true;
  // One read at a time: two would share readBuffer_, and the second would
  // overwrite bytes the first's handler has not consumed yet.
  bool reading_ = false;
  bool dispatching_ = false;
  bool closeWhenDrained_ = false;
  std::string pendingCloseReason_;
};

}  // namespace varuna
