#include "loop/pending_connections.h"

#include "varuna/common/errors.h"

namespace varuna {

void PendingConnections::add(const std::shared_ptr<FramedConnection>& connection, TimePoint now,
                             size_t expectedPeers) {
  if (index_.count(connection.get())) return;
  connection->limitFirstFrame(limits_.maxHelloBytes);
  const size_t cap = limits_.maxPending + expectedPeers;
  while (cap > 0 && order_.size() >= cap) {
    ++evicted_;
    closeOldest(strCat("more than ", cap, " connections without a hello: the oldest is closed"));
  }
  order_.push_back(Entry{connection, now});
  index_[connection.get()] = std::prev(order_.end());
}

void PendingConnections::erase(const std::shared_ptr<FramedConnection>& connection) {
  auto it = index_.find(connection.get());
  if (it == index_.end()) return;
  order_.erase(it->second);
  index_.erase(it);
}

size_t PendingConnections::expire(TimePoint now) {
  size_t closed = 0;
  while (!order_.empty() && now - order_.front().acceptedAt >= limits_.helloDeadline) {
    ++expired_;
    ++closed;
    closeOldest(strCat("no hello within ", limits_.helloDeadline.count(), " ms"));
  }
  return closed;
}

bool PendingConnections::shedOldest(const std::string& reason) {
  if (order_.empty()) return false;
  closeOldest(reason);
  return true;
}

void PendingConnections::closeAll(const std::string& reason) {
  while (!order_.empty()) closeOldest(reason);
}

void PendingConnections::closeOldest(const std::string& reason) {
  auto connection = std::move(order_.front().connection);
  index_.erase(connection.get());
  order_.pop_front();
  connection->close(reason);  // its onClose may call erase(): it is gone already
}

}  // namespace varuna
