// Teardown that cannot run on the thread letting go of a group (it would join itself) runs on
// a thread of its own, which nothing joins. These threads are counted, so that the process can
// wait for them before the interpreter finalizes (torch_xdev registers an atexit hook): one
// still destroying a group's worker or engines then would race with the interpreter's teardown
// and the process's static destructors.
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>

namespace xdev::backend {

struct DetachedTeardownCounts {
  int64_t started = 0;
  int64_t in_flight = 0;
};

void detached_teardown_began();
void detached_teardown_ended();
DetachedTeardownCounts detached_teardown_counts();

// Waits until no detached teardown is in flight, or `timeout` has passed; returns whether none
// is.
bool wait_for_detached_teardowns(std::chrono::milliseconds timeout);

// Runs `teardown` (movable; what it captures is destroyed before the thread counts as ended) on
// a detached thread.
template <typename Teardown>
void run_detached_teardown(Teardown teardown) {
  detached_teardown_began();
  std::thread([teardown = std::move(teardown)]() mutable {
    {
      Teardown local = std::move(teardown);
      local();
    }
    detached_teardown_ended();
  }).detach();
}

}  // namespace xdev::backend
