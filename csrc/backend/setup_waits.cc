#include "setup_waits.h"

#include <c10/util/Exception.h>

#include <exception>

#include "../transport/shm_segment.h"

namespace xdev::backend {

void remove_orphans_after_a_failed_wait() noexcept {
  try {
    transport::ShmSegment::remove_orphans();
  } catch (...) {
    // The wait's own error is the one to report.
  }
}

void wait_for_ranks(c10d::Store& store, const std::string& prefix, int world_size,
                    std::chrono::milliseconds timeout, const std::string& what,
                    const std::vector<int>& group_ranks) {
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(prefix + std::to_string(r));
  try {
    store.wait(keys, timeout);
  } catch (const c10::Error& e) {  // DistStoreError; a FileStore's timeout is a plain c10::Error
    const std::exception_ptr timed_out = std::current_exception();
    std::string missing;
    try {
      for (int r = 0; r < world_size; ++r) {
        if (store.check({keys[static_cast<size_t>(r)]})) continue;
        const int named = group_ranks.empty() ? r : group_ranks[static_cast<size_t>(r)];
        missing += (missing.empty() ? "" : ", ") + std::to_string(named);
      }
    } catch (const std::exception&) {
      std::rethrow_exception(timed_out);  // the store itself is gone: its error says so
    }
    if (missing.empty()) throw;  // all arrived just after the timeout
    C10_THROW_ERROR(
        DistStoreError,
        c10::str("xdev: ", what, " timed out after ", static_cast<double>(timeout.count()) / 1000.0,
                 " s waiting for rank(s) ", missing,
                 " of this group: each exited, is stuck, or is not making the same "
                 "call (",
                 e.what_without_backtrace(), ")"));
  }
}

void store_barrier(c10d::Store& store, const std::string& prefix, int rank, int world_size,
                   std::chrono::milliseconds timeout, const std::string& what,
                   const std::vector<int>& group_ranks) {
  store.set(prefix + "arrived/" + std::to_string(rank), "1");
  wait_for_ranks(store, prefix + "arrived/", world_size, timeout, what, group_ranks);
}

int64_t count_failures_across_ranks(c10d::Store& store, const std::string& prefix, bool failed,
                                    int rank, int world_size, std::chrono::milliseconds timeout,
                                    const std::string& what, const std::vector<int>& group_ranks) {
  store.add(prefix + "failures", failed ? 1 : 0);
  store_barrier(store, prefix, rank, world_size, timeout, what, group_ranks);
  return store.add(prefix + "failures", 0);
}

}  // namespace xdev::backend
