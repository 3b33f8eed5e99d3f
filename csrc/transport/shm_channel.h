// The shared-memory channel of one process group on one host: a control block
// (barrier words, per-rank op descriptors, pids) and two sets of staging
// slots, one slot per rank in each set.
//
// Slot sets alternate by window (double buffering): a rank writes set p again
// only in window w + 2, after passing window w + 1's first barrier, which no
// rank reaches before it has finished reading set p in window w. So no barrier
// is needed at the end of a window.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "deadline.h"
#include "shm_segment.h"
#include "symmetric_heap.h"

namespace xdev::transport {

// A peer did not arrive in time, or exited.
class PeerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Ranks disagree about the collective (shape, dtype, op, algorithm, order).
// Raised on every rank at the same point; the channel stays usable.
class MismatchError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What one rank is about to run. Every rank publishes one before the first
// barrier of a collective; after it, every rank compares all of them, so a
// mismatch fails on every rank at the same point and the group stays usable.
struct OpDescriptor {
  uint64_t seq = 0;
  int32_t collective = 0;  // backend's enum
  int32_t reduce_op = 0;
  int32_t dtype = 0;
  int32_t algorithm = 0;
  int32_t single_copy = 0;  // 1: peers read tensors in place, 0: staged
  int32_t device = 0;       // 0: CPU tensors, 1: CUDA tensors
  int64_t root = 0;
  int64_t num_packs = 0;
  int64_t num_tensors = 0;
  int64_t total_elems = 0;
  uint64_t counts_hash = 0;    // of every tensor's dtype and element count
  int64_t shared_buffer = -1;  // the shared buffer the tensor is in (shared_empty), or -1
  int64_t shared_offset = 0;   // and its byte offset there
  // Where the tensor lies in this rank's symmetric heap (arena -1: not there).
  // Not compared by ==: ranks read every rank's after the first barrier and
  // run in place only if all are at one place (SharedBufferExecutor).
  int64_t heap_arena = -1;
  int64_t heap_offset = 0;

  bool operator==(const OpDescriptor& o) const;
  bool operator!=(const OpDescriptor& o) const { return !(*this == o); }
};

// A hash of exactly the fields == compares: descriptors that are equal hash
// alike on every rank. The GPU barrier carries it (gpu_barrier_word.h).
uint32_t call_hash(const OpDescriptor& d);

// What every native collective carries besides its data: its descriptor for
// the mismatch check, its deadline, and how to name it in errors.
struct OpContext {
  OpDescriptor descriptor;
  Clock::time_point deadline;
  std::string what;  // e.g. "allreduce (op #12)"
  std::function<std::string(const OpDescriptor&)> describe;
};

class ShmChannel {
 public:
  ShmChannel() = default;

  // Bytes the segment needs for world_size ranks with slots of slot_bytes.
  static size_t segment_bytes(int world_size, size_t slot_bytes);

  // The creator initialises the control block; everyone then attaches.
  static ShmChannel create(const std::string& name, int world_size, int rank, size_t slot_bytes);
  static ShmChannel attach(const std::string& name, int world_size, int rank, size_t slot_bytes);

  void unlink_name() { segment_.unlink(); }
  // Tells peers this rank takes part in no more barriers (its group is being
  // destroyed, or `failure`, non-empty, made it unusable): a peer waiting for
  // it fails at its next liveness check, within 200 ms, instead of at its
  // deadline, and its message quotes `failure` (cut to 511 bytes). Only the
  // first call says anything.
  void mark_left(const std::string& failure = "");
  const std::string& name() const { return segment_.name(); }
  size_t slot_bytes() const { return slot_bytes_; }
  int world_size() const { return world_size_; }
  int rank() const { return rank_; }

  // How errors name this channel's ranks. A channel over part of a process
  // group (one host's ranks) numbers them from 0; given the group ranks they
  // stand for (group_ranks[r] for channel rank r), messages name those. Given
  // the group's members as global ranks (global_ranks[g] for group rank g),
  // a rank whose global number differs is named by both: in a subgroup,
  // "rank 0" alone reads as global rank 0.
  void name_ranks(std::vector<int> group_ranks, std::vector<int64_t> global_ranks = {}) {
    group_ranks_ = std::move(group_ranks);
    global_ranks_ = std::move(global_ranks);
  }
  // Rank r of this channel as the group numbers it, and "rank N" for messages.
  int group_rank(int r) const;
  std::string rank_name(int r) const;

  char* slot(int64_t window_parity, int rank) const;

  // Blocks until every rank has reached the same number of barriers. Spins for
  // at most the spin budget, then sleeps on a futex. Throws PeerError naming
  // the missing ranks at the deadline, or as soon as a missing rank's process
  // is gone or it has left the group (mark_left).
  void barrier(Clock::time_point deadline, const std::string& what);

  // How long barrier() spins before it sleeps; zero (the default) sleeps at
  // once. The owner sets it before each collective: a spin only pays when the
  // waiting thread has a core that nothing else of this host's job needs.
  void set_spin_budget(Clock::duration budget) { spin_budget_ = budget; }

  // Opens a collective: publishes ctx.descriptor, takes the slot set of its
  // first window, runs prepare(parity) (this rank's part before peers may
  // look: staging its input, lending its buffer), passes the first barrier and
  // checks that every rank published the same descriptor. Returns the slot
  // set's parity. On a mismatch every rank throws MismatchError here, at the
  // same barrier and with the same slot-set count, so the channel stays usable.
  // Every collective, even one that uses no slot, opens with this.
  template <typename Prepare>
  int64_t open_collective(const OpContext& ctx, Prepare&& prepare) {
    publish(ctx.descriptor);
    const int64_t parity = open_window(ctx, prepare);
    check_same_descriptor(ctx.descriptor, ctx.describe, ctx.what);
    return parity;
  }
  int64_t open_collective(const OpContext& ctx) {
    return open_collective(ctx, [](int64_t) {});
  }

  // Each later window of a collective opened by open_collective: takes the
  // next slot set, runs prepare(parity), passes the window's first barrier.
  template <typename Prepare>
  int64_t open_window(const OpContext& ctx, Prepare&& prepare) {
    const int64_t parity = next_slot_set();
    prepare(parity);
    barrier(ctx.deadline, ctx.what);
    return parity;
  }

  OpDescriptor descriptor_of(int rank, uint64_t seq) const;

  // The buffer this rank lends to peers for op seq (single-copy transport).
  struct PeerBuffer {
    int32_t pid = 0;
    uint64_t address = 0;
    uint64_t bytes = 0;
  };
  void publish_buffer(uint64_t seq, const void* address, uint64_t bytes);
  PeerBuffer buffer_of(int rank, uint64_t seq) const;

  // Whether this process may read every peer's memory with process_vm_readv
  // (same user, no ptrace restriction). Call once every rank has attached.
  // On false, *why says what failed.
  bool can_read_peers(std::string* why) const;

  // The arenas of this rank's symmetric heap, for peers to map (SymmetricHeap).
  void publish_arena(int index, const ArenaAddress& address);
  ArenaAddress arena_of(int rank, int index) const;
  // Likewise for the arenas of this rank's device-memory heap (CUDA tensors).
  void publish_device_arena(int index, const DeviceArenaAddress& address);
  DeviceArenaAddress device_arena_of(int rank, int index) const;

  uint64_t barriers_passed() const { return epoch_; }

  // A peer whose process has exited or that has left the group, said in
  // words ("" if none): it takes part in nothing more.
  std::string gone_peer() const;
  // The rank of a peer whose process has exited (the lowest), or -1: unlike
  // one that has left, its GPU work queued before it went never runs. Safe to
  // call from any thread. Peers in another pid namespace are never found.
  int exited_peer_rank() const;
  // How often a wait asks whether the ranks it waits for are gone (it reads
  // /proc for each): a dead peer is reported within about this long.
  static constexpr std::chrono::milliseconds kLivenessCheckPeriod{200};

  // Whether rank's pid names its process here (the same pid namespace). A
  // container that shares /dev/shm but not its pids does not: its liveness
  // cannot be tested by pid, nor its memory reached through /proc/<pid>.
  bool shares_pid_namespace(int rank) const;

 private:
  struct Header;
  struct RankControl;

  // The slot set for the next window. Every collective takes one before its
  // first barrier (the staged path one per window), so after a mismatch,
  // which all ranks detect at that first barrier, the counts still agree.
  int64_t next_slot_set() { return slot_sets_taken_++; }

  void publish(const OpDescriptor& d);

  // After a barrier that follows publish(): throws MismatchError, with every
  // rank's descriptor rendered by describe, unless all ranks published mine.
  void check_same_descriptor(const OpDescriptor& mine,
                             const std::function<std::string(const OpDescriptor&)>& describe,
                             const std::string& what) const;

  // Records this rank's place in the segment and publishes its pid and probe.
  void init_local_rank(int world_size, int rank, size_t slot_bytes);
  Header* header() const;
  RankControl* control(int rank) const;
  bool all_arrived(uint64_t epoch) const;
  bool settle_barrier(uint64_t epoch, bool every_rank_arrived);
  // Every rank arrived: settles the barrier as passed and returns, or throws
  // PeerError naming the peer that settled it as failed first (at its deadline).
  void pass_barrier(uint64_t epoch, const std::string& what);
  std::string missing_ranks(uint64_t epoch) const;
  // A rank that has not reached `epoch` and never will, said in words ("" if
  // none), as gone() says it.
  std::string gone_rank(uint64_t epoch, const std::string& what) const;
  // Rank r's process has exited or it has left the group, said in words ("" if
  // not), with "during `what`" where `what` is given.
  std::string gone(int r, const std::string& what = "") const;
  bool exited(int r) const;

  ShmSegment segment_;
  int world_size_ = 0;
  int rank_ = 0;
  size_t slot_bytes_ = 0;
  size_t data_offset_ = 0;
  uint64_t epoch_ = 0;
  int64_t slot_sets_taken_ = 0;
  Clock::duration spin_budget_{0};
  std::vector<int> group_ranks_;       // empty: channel ranks are the group's
  std::vector<int64_t> global_ranks_;  // empty: group ranks are global
  // Peers read this through process_vm_readv to test access; on the heap so
  // its address survives moves of the channel.
  std::unique_ptr<uint64_t> probe_token_;
};

}  // namespace xdev::transport
