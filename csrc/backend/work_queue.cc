#include "work_queue.h"

namespace xdev::backend {

WorkQueue::WorkQueue() : thread_([this] { loop(); }) {}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void WorkQueue::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

bool WorkQueue::run_inline_or_submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_ || !tasks_.empty()) {
      tasks_.push_back(std::move(task));
      cv_.notify_one();
      return false;
    }
    busy_ = true;
  }
  task();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
  }
  cv_.notify_one();  // the worker may hold tasks queued while we ran
  return true;
}

void WorkQueue::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [this] { return (stopping_ && !busy_) || (!busy_ && !tasks_.empty()); });
    if (tasks_.empty()) return;  // stopping and drained
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    busy_ = true;
    lock.unlock();
    task();  // tasks catch their own errors and report them through their Work
    lock.lock();
    busy_ = false;
  }
}

}  // namespace xdev::backend
