#include "work_queue.h"

#include <c10/util/ScopeExit.h>

#include "scoped_thread_local.h"

namespace xdev::backend {
namespace {

thread_local WorkQueue* t_running_queue = nullptr;

// Marks this thread as running a task of `queue` for its lifetime (nests).
class RunningTask : public ScopedThreadLocal<WorkQueue*> {
 public:
  explicit RunningTask(WorkQueue* queue) : ScopedThreadLocal(t_running_queue, queue) {}
};

}  // namespace

const WorkQueue* WorkQueue::running_on_this_thread() {
  return t_running_queue;
}

void WorkQueue::run_queued_while(const std::function<bool(uint64_t)>& more) {
  // busy_ is still set by the running task, so no other thread takes tasks meanwhile.
  for (;;) {
    std::function<void()> next;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (tasks_.empty() || !more(tasks_.front().first)) return;
      next = std::move(tasks_.front().second);
      tasks_.pop_front();
    }
    RunningTask running(this);
    next();
  }
}

void WorkQueue::run_nested(std::function<void()> task, uint64_t after) {
  run_queued_while([after](uint64_t number) { return number <= after; });
  RunningTask running(this);
  task();
}

void WorkQueue::run_queued_while_waiting(const std::atomic<uint64_t>* submitted,
                                         const std::function<bool()>& done) {
  WorkQueue* queue = t_running_queue;
  if (queue == nullptr || submitted == nullptr || queue->submitted_.get() != submitted) return;
  queue->run_queued_while([&done](uint64_t) { return !done(); });
}

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
    tasks_.emplace_back(++*submitted_, std::move(task));
  }
  cv_.notify_one();
}

bool WorkQueue::run_inline_or_submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t number = ++*submitted_;
    if (busy_ || !tasks_.empty()) {
      tasks_.emplace_back(number, std::move(task));
      cv_.notify_one();
      return false;
    }
    busy_ = true;
  }
  // Tasks report their errors through their Work; should one throw all the
  // same, the queue must not stay busy (every later task would wait forever).
  auto done = c10::make_scope_exit([this] {
    bool worker_has_news = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
      worker_has_news = !tasks_.empty() || stopping_;
    }
    // Wake the worker only if it has something to do now: a needless notify
    // still costs a system call and a wake-up of the worker thread, which on
    // every synchronous call takes a core from the ranks at their barriers.
    if (worker_has_news) cv_.notify_one();
  });
  RunningTask running(this);
  task();
  return true;
}

void WorkQueue::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [this] { return (stopping_ && !busy_) || (!busy_ && !tasks_.empty()); });
    if (tasks_.empty()) return;  // stopping and drained
    std::function<void()> task = std::move(tasks_.front().second);
    tasks_.pop_front();
    busy_ = true;
    lock.unlock();
    {
      RunningTask running(this);
      task();  // tasks catch their own errors and report them through their Work
    }
    lock.lock();
    busy_ = false;
  }
}

}  // namespace xdev::backend
