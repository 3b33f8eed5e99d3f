// Sets a thread_local variable for the lifetime of a scope and restores the
// previous value after, so that scopes nest (a task run inside a task, a
// Work's callbacks run inside another's).
#pragma once

namespace xdev::backend {

template <typename T>
class ScopedThreadLocal {
 public:
  ScopedThreadLocal(T& slot, T value) : slot_(slot), previous_(slot) { slot_ = value; }
  ~ScopedThreadLocal() { slot_ = previous_; }
  ScopedThreadLocal(const ScopedThreadLocal&) = delete;
  ScopedThreadLocal& operator=(const ScopedThreadLocal&) = delete;

 private:
  T& slot_;
  T previous_;
};

}  // namespace xdev::backend
