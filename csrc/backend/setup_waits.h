// Waits for a group's peers through its c10d Store while the group is set up
// (before its shared-memory barriers exist, or beside them): barriers, votes
// on whether every rank's part of a setup step worked, and the cleanup a
// failed wait owes. Their timeout errors name the ranks that did not come.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace xdev::backend {

// Removes the segments of exited creators (ShmSegment::remove_orphans). Never
// throws: it runs on the way out of a failed wait, whose error is the one to
// report.
void remove_orphans_after_a_failed_wait() noexcept;

// Returns wait(), a wait for peers through the store. A peer that died between
// creating a shared segment and unlinking its name (once every rank mapped it)
// leaves the name linked, and its crash unlinks nothing; so where the wait
// throws (a peer gone or stuck), the survivors remove the orphans before the
// wait's error goes on.
template <typename Wait>
decltype(auto) wait_for_peers(Wait&& wait) {
  try {
    return wait();
  } catch (...) {
    remove_orphans_after_a_failed_wait();
    throw;
  }
}

// Returns once the keys prefix + "0" to prefix + (world_size - 1) are all set.
// At the timeout raises the store's error type (DistStoreError in Python),
// naming the ranks whose keys are missing and `what` they were to do: the
// store's own message lists keys, which users cannot map to processes.
// `group_ranks`, where given, names index r as group rank group_ranks[r] (a
// host's channel numbers its ranks from 0).
void wait_for_ranks(c10d::Store& store, const std::string& prefix, int world_size,
                    std::chrono::milliseconds timeout, const std::string& what,
                    const std::vector<int>& group_ranks = {});

// Returns once all world_size ranks, rank being this one, have called it with
// this key prefix (once each); a rank missing at the timeout (the group's)
// raises wait_for_ranks' error.
void store_barrier(c10d::Store& store, const std::string& prefix, int rank, int world_size,
                   std::chrono::milliseconds timeout, const std::string& what,
                   const std::vector<int>& group_ranks = {});

// Every rank says whether its part of a setup failed; returns how many did,
// the same number on every rank, once all have voted. Keys under `prefix`.
int64_t count_failures_across_ranks(c10d::Store& store, const std::string& prefix, bool failed,
                                    int rank, int world_size, std::chrono::milliseconds timeout,
                                    const std::string& what,
                                    const std::vector<int>& group_ranks = {});

}  // namespace xdev::backend
