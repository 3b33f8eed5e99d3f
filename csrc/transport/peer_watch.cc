#include "peer_watch.h"

#include <utility>

namespace xdev::transport {

PeerWatch::PeerWatch(FindGone find_gone, Report report, std::chrono::milliseconds period)
    : find_gone_(std::move(find_gone)), report_(std::move(report)), period_(period) {
  thread_ = std::thread([this] { run(); });
}

PeerWatch::~PeerWatch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

int PeerWatch::reported() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reported_;
}

void PeerWatch::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, period_, [this] { return stopping_; })) {
    lock.unlock();
    int gone = -1;
    try {
      gone = find_gone_();
    } catch (...) {
      return;  // nothing to watch with: the group's own calls still find a gone peer
    }
    if (gone >= 0) {
      try {
        report_(gone);
      } catch (...) {
      }
      lock.lock();
      reported_ = gone;
      return;
    }
    lock.lock();
  }
}

}  // namespace xdev::transport
