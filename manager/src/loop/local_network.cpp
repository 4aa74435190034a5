#include "varuna/manager/local_network.h"

#include <boost/asio/post.hpp>

namespace varuna {

std::unique_ptr<ByteStream> LocalNetwork::dial(const std::string& peerName) {
  ++dials_;
  if (!onAccept_) return nullptr;
  auto pair = memoryStreamPair(io_, "memory:" + peerName, "memory:manager");
  // Posted, as an acceptor's completion is: the dialler has its end (and
  // may have written its hello) before the listener sees the connection.
  // A listener that stopped meanwhile never gets it: the end closes (EOF).
  auto server = std::make_shared<std::unique_ptr<ByteStream>>(std::move(pair.b));
  boost::asio::post(io_, [this, server] {
    if (onAccept_) onAccept_(std::move(*server));
  });
  return std::move(pair.a);
}

}  // namespace varuna
