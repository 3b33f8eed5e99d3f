// Keeps a group's parts alive while calls use them. Every call into the
// backend enters the gate for as long as it runs on the caller's thread
// (choosing a path, handing work to the queue or to an engine); shutting the
// group down closes it, waits for the calls inside to leave, and only then
// destroys the parts. A call that arrives after the close raises at once. A
// plain counter rather than a reader-writer lock: a call may enter again from
// a callback it runs inline.
#pragma once

#include <c10/util/Exception.h>

#include <condition_variable>
#include <mutex>

namespace xdev::backend {

class CallGate {
 public:
  class Entry {
   public:
    explicit Entry(CallGate& gate) : gate_(&gate) {}
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    ~Entry() {
      std::lock_guard<std::mutex> lock(gate_->mutex_);
      if (--gate_->inside_ == 0) gate_->left_.notify_all();
    }

   private:
    CallGate* gate_;
  };

  // Throws (RuntimeError in Python) once the gate is closed.
  [[nodiscard]] Entry enter() {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!closed_, "xdev: this process group has been destroyed");
    ++inside_;
    return Entry(*this);
  }

  // Refuses later calls and waits for those inside to leave.
  void close() {
    std::unique_lock<std::mutex> lock(mutex_);
    closed_ = true;
    left_.wait(lock, [this] { return inside_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable left_;
  int inside_ = 0;
  bool closed_ = false;
};

}  // namespace xdev::backend
