// The frees of a device-memory heap (CudaSymmetricHeap) whose last uses may
// still be queued on the GPU. A freed block is placed again at once, so that
// places stay a function of the calls alone; the allocation that next lands
// on its bytes must first make its own stream wait for that work. Each free
// keeps the events recorded after it on every stream that used the block, and
// an allocation waits only for the frees whose bytes it overlaps: a buffer of
// one stream (FSDP's all-gather, say) never waits for the unrelated frees of
// another (its reduce-scatter).
//
// Bookkeeping only, generic in the event type so that it is tested without a
// GPU. Not thread-safe: its owner holds a lock.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace xdev::transport {

template <typename Event>
class PendingFrees {
 public:
  // Bytes [offset, offset + bytes) of one arena.
  struct Range {
    int arena = -1;
    int64_t offset = 0;
    int64_t bytes = 0;
    bool overlaps(const Range& o) const {
      return arena == o.arena && offset < o.offset + o.bytes && o.offset < offset + bytes;
    }
  };

  // A free of `range` whose last uses end at `events` (recorded on the
  // streams that used it, after the free was asked for).
  void add(const Range& range, std::vector<Event> events) {
    if (!events.empty()) pending_.push_back({range, std::move(events)});
  }

  // Before `range` is used again: wait(e) for every event of every pending
  // free that overlaps it. Then forgets every free, wherever it lies, all of
  // whose events have passed (passed(e)), handing its events to release(e).
  // A free that has not passed is kept even if waited for: an allocation on
  // another stream may land on its bytes later and must wait too. If wait
  // throws, nothing is forgotten.
  template <typename Wait, typename Passed, typename Release>
  void wait_for(const Range& range, Wait&& wait, Passed&& passed, Release&& release) {
    for (const Free& f : pending_) {
      if (!f.range.overlaps(range)) continue;
      for (const Event& e : f.events) wait(e);
    }
    // The passed frees' events are released once the list is whole again: a
    // release that throws (out of memory) then loses events, never leaves one
    // both released and still pending.
    // Each free judged once: an event may pass while this runs.
    std::vector<bool> gone(pending_.size());
    std::vector<Event> passed_events;
    for (size_t i = 0; i < pending_.size(); ++i) {
      const std::vector<Event>& events = pending_[i].events;
      gone[i] = std::all_of(events.begin(), events.end(), passed);
      if (gone[i]) passed_events.insert(passed_events.end(), events.begin(), events.end());
    }
    if (passed_events.empty()) return;
    size_t kept = 0;
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (gone[i]) continue;
      if (kept != i) pending_[kept] = std::move(pending_[i]);
      ++kept;
    }
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(kept), pending_.end());
    for (const Event& e : passed_events) release(e);
  }

  bool empty() const { return pending_.empty(); }

  // Hands every event to release(e) and forgets every free (the heap is going).
  template <typename Release>
  void clear(Release&& release) {
    for (const Free& f : pending_) {
      for (const Event& e : f.events) release(e);
    }
    pending_.clear();
  }

  size_t size() const { return pending_.size(); }

 private:
  struct Free {
    Range range;
    std::vector<Event> events;
  };
  std::vector<Free> pending_;
};

}  // namespace xdev::transport
