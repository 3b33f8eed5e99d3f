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

  // Runs the task on the calling thread if nothing is queued or running (a
  // synchronous call then costs no thread handoff), else queues it behind the
  // rest. Order is kept either way. Returns true if it ran inline.
  bool run_inline_or_submit(std::function<void()> task);

  // The queue whose task this thread is running (the worker, or a caller
  // running one inline), or null.
  static const WorkQueue* running_on_this_thread();

  // For a task submitted from inside one of this queue's tasks (a callback of
  // a Work's future, which runs where the Work completes, on the thread that
  // runs its task): that thread is the only one that may run tasks now, and
  // one that waits for this task (PowerSGD's hook waits inside its callback)
  // would wait forever if it were queued behind the running one. So this
  // thread runs what is queued, in order, then the task, before it returns.
  void run_nested(std::function<void()> task);

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  bool busy_ = false;  // a task is running, on the worker or inline
  std::thread thread_;
};

}  // namespace xdev::backend
