// A symmetric heap: memory every rank of one host's group maps, handed out so
// that the same allocations and frees, made in the same order on every rank,
// land at the same place on every rank.
//
// Why: a collective whose tensor sits at the same place in every rank's heap
// can run in place. Each rank reads its peers' copies and writes the totals
// straight into them, nothing staged (SharedBufferExecutor). PyTorch's DDP
// allocates its gradient buckets through the backend (c10d's allocateTensor)
// in the same order on every rank, and FSDP2 can allocate its communication
// buffers the same way on every step, so allocation has to be cheap: no Store
// round trip, no new mapping per allocation.
//
// Layout. Each rank owns a list of arenas (memfd files, mode 0600, no name in
// any file system). An arena is published to peers as (pid, fd, bytes), which
// a peer opens through /proc/<pid>/fd/<fd> and maps once, on first use. So
// nothing can be left behind by a crash: the memory goes with the last
// process that maps it. Arenas grow geometrically and are never given back
// before the heap dies; freed blocks are reused (first fit, coalesced).
//
// Placement is a promise kept by callers, not checked here: ranks that
// allocate in different orders get different places, and the collective that
// finds its ranks' places differ stages instead (it compares them after its
// first barrier).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "heap_placement.h"

namespace xdev::transport {

// How a peer opens an arena of this process.
struct ArenaAddress {
  int32_t pid = 0;
  int32_t fd = -1;
  uint64_t bytes = 0;  // 0: no such arena
};

class SymmetricHeap {
 public:
  static constexpr int kMaxArenas = HeapPlacement::kMaxArenas;
  static constexpr int64_t kAlignBytes = HeapPlacement::kAlignBytes;
  static constexpr int64_t kMaxBlockBytes = HeapPlacement::kMaxBlockBytes;

  // Tells peers of a new arena (the channel's control block carries it).
  using Publish = std::function<void(int arena, const ArenaAddress& address)>;

  // The first arena holds first_arena_bytes; each later one at least as much
  // as all before it together (HeapPlacement::next_arena_bytes).
  SymmetricHeap(int rank, int world_size, size_t first_arena_bytes, Publish publish);
  ~SymmetricHeap();
  SymmetricHeap(const SymmetricHeap&) = delete;
  SymmetricHeap& operator=(const SymmetricHeap&) = delete;

  struct Block {
    char* data = nullptr;  // in this rank's arena
    HeapLocation where;
  };
  // Zero bytes get a block of kAlignBytes. Throws std::invalid_argument above
  // kMaxBlockBytes or once closed, std::runtime_error when all kMaxArenas are full or memory
  // cannot be had.
  Block allocate(size_t bytes);
  // The block allocate returned at `where`. Thread-safe, like allocate.
  void free(HeapLocation where);

  // Where [p, p + n) lies in this rank's arenas, or arena -1.
  HeapLocation locate(const void* p, size_t n) const;

  // Rank r's arena `arena` as mapped in this process, opened from `address`
  // on first use (this rank's own: no address needed). Throws
  // std::runtime_error naming the peer when it cannot be opened.
  char* arena_of(int r, int arena, const ArenaAddress& address);

  // Creates this rank's first arena (if none yet), publishes it, and returns its address.
  ArenaAddress first_arena();

  // The group is gone: unmaps the peers' arenas (no collective reads them any
  // more, and a tensor this rank keeps must not keep its peers' memory) and
  // refuses to grow (there is no one to publish to). Blocks already handed
  // out stay valid, and free() still takes them back.
  void close();
  bool closed() const;

  int rank() const { return rank_; }
  int arenas() const;
  size_t bytes_in_use() const;
  size_t bytes_reserved() const;
  int64_t live_blocks() const;

  // What the collectives that offered to run in place on this heap's blocks
  // did: ran in place, or staged (a peer's block at another place, or out of
  // reach). Counted by those collectives, so that a user can see that DDP's
  // buckets did run in place, not only that they could.
  void count_collective(bool in_place) {
    ++(in_place ? in_place_collectives_ : staged_collectives_);
  }
  int64_t in_place_collectives() const { return in_place_collectives_.load(); }
  int64_t staged_collectives() const { return staged_collectives_.load(); }

  // Opens and maps a peer's arena; throws std::runtime_error with the reason.
  // Exposed for the probe that decides whether a host allows it at all.
  static void* map_peer_arena(const ArenaAddress& address);

 private:
  struct Arena {
    int fd = -1;
    char* data = nullptr;
    size_t bytes = 0;
  };
  int add_arena(size_t at_least);  // mutex_ held
  void unmap_peers();              // mutex_ held, or in the destructor

  const int rank_;
  const int world_size_;
  const size_t first_arena_bytes_;
  Publish publish_;
  mutable std::mutex mutex_;
  HeapPlacement placement_;  // where blocks lie in own_
  std::vector<Arena> own_;
  std::vector<char*> own_data_;  // own_[i].data, for locate_in_arenas
  // [rank][arena]: peers' arenas as mapped here (bytes, address); own rank unused.
  std::vector<std::vector<std::pair<size_t, char*>>> peers_;
  bool closed_ = false;
  std::atomic<int64_t> in_place_collectives_{0};
  std::atomic<int64_t> staged_collectives_{0};
};

}  // namespace xdev::transport
