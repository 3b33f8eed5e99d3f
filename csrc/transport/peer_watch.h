// A thread that watches whether a group's peers are still there, for work the
// host does not wait on itself: a GPU kernel waiting at a barrier for a peer
// that has exited cannot tell, and would wait out the group's timeout (30
// minutes by default). Every `period` the thread asks find_gone() for a peer
// that is gone; the first one it finds it hands to report(), once, from the
// thread, and then it stops asking (the group is unusable from then on).
//
// Pure C++, no CUDA: the backend connects it to the shared-memory channel's
// view of the peers and to the CUDA executor's error word.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace xdev::transport {

class PeerWatch {
 public:
  using FindGone = std::function<int()>;  // a gone peer's rank, or -1
  using Report = std::function<void(int rank)>;

  PeerWatch(FindGone find_gone, Report report, std::chrono::milliseconds period);
  ~PeerWatch();  // stops the thread at once and joins it; never throws
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  // The rank reported, or -1.
  int reported() const;

 private:
  void run();

  FindGone find_gone_;
  Report report_;
  std::chrono::milliseconds period_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  int reported_ = -1;
  std::thread thread_;  // last: started once every other member is set
};

}  // namespace xdev::transport
