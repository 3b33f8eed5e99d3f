// One worker thread that runs native collectives in submission order. Every
// rank submits collectives in the same order, so a single FIFO keeps the ranks
// in step; the thread sleeps on a condition variable when idle.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace xdev::backend {

class WorkQueue {
 public:
  WorkQueue();
  ~WorkQueue();  // runs what is queued, then joins
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Each task submitted (queued or run inline) takes the next number of
  // submitted_count(), from 1.
  void submit(std::function<void()> task);

  // Runs the task on the calling thread if nothing is queued or running (a
  // synchronous call then costs no thread handoff), else queues it behind the
  // rest. Order is kept either way. Returns true if it ran inline.
  bool run_inline_or_submit(std::function<void()> task);

  // The queue whose task this thread is running (the worker, or a caller
  // running one inline), or null.
  static const WorkQueue* running_on_this_thread();

  // How many tasks have been submitted so far. Shared, so that a Work can
  // read it after the queue is gone.
  std::shared_ptr<const std::atomic<uint64_t>> submitted_count() const { return submitted_; }

  static constexpr uint64_t kEverything = std::numeric_limits<uint64_t>::max();

  // For a task issued from inside one of this queue's tasks (a callback of a
  // Work's future, which runs where the Work completes, on the thread that
  // runs its task): that thread is the only one that may run tasks now, and
  // one that waits for this task (PowerSGD's hook waits inside its callback)
  // would wait forever if it were queued behind the running one. So this
  // thread runs the queued tasks numbered up to `after` (in order), then the
  // task, before it returns; later tasks stay queued.
  void run_nested(std::function<void()> task, uint64_t after);

  // For Work::wait() inside one of a queue's tasks (a future callback of an
  // earlier Work, waiting for a later collective of its group, as Gloo lets
  // it): the awaited task is queued behind the running one, and this thread
  // is the only one that may run tasks now. So it runs the queued tasks, in
  // order, until `done` holds or none is left. Does nothing on a thread that
  // runs no task of the queue counting with `submitted`.
  static void run_queued_while_waiting(const std::atomic<uint64_t>* submitted,
                                       const std::function<bool()>& done);

 private:
  void loop();
  // Runs queued tasks on this thread, in order, while `more(number)` holds
  // for the next one's number.
  void run_queued_while(const std::function<bool(uint64_t)>& more);

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<uint64_t, std::function<void()>>> tasks_;  // (number, task)
  std::shared_ptr<std::atomic<uint64_t>> submitted_ = std::make_shared<std::atomic<uint64_t>>(0);
  bool stopping_ = false;
  bool busy_ = false;  // a task is running, on the worker or inline
  std::thread thread_;
};

}  // namespace xdev::backend
