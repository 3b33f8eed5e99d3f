#include "detached_teardown.h"

#include <condition_variable>
#include <mutex>

namespace xdev::backend {
namespace {

struct Registry {
  std::mutex mutex;
  std::condition_variable all_ended;
  DetachedTeardownCounts counts;
};

// Never destroyed: a detached thread may end after static destructors have run.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

}  // namespace

void detached_teardown_began() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  ++r.counts.started;
  ++r.counts.in_flight;
}

void detached_teardown_ended() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (--r.counts.in_flight == 0) r.all_ended.notify_all();
}

DetachedTeardownCounts detached_teardown_counts() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.counts;
}

bool wait_for_detached_teardowns(std::chrono::milliseconds timeout) {
  Registry& r = registry();
  std::unique_lock<std::mutex> lock(r.mutex);
  return r.all_ended.wait_for(lock, timeout, [&r] { return r.counts.in_flight == 0; });
}

}  // namespace xdev::backend
