// One worker thread that runs native collectives in submission order. Every
// rank submits collectives in the same order, so a single FIFO keeps the ranks
// in step; the thread sleeps on a condition variable when idle.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace xdev::backend {

class WorkQueue {
 public:
  WorkQueue();
  ~WorkQueue();  // runs what is queued, then joins
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  void submit(std::function<void()> task);

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace xdev::backend
