// Where blocks go in a symmetric heap's arenas: first fit, lowest arena and
// offset first, frees coalesced. A deterministic function of the sequence of
// calls, which is what keeps every rank's places equal when every rank makes
// the same calls in the same order.
//
// Bookkeeping only: it never touches memory. SymmetricHeap (shared memory of
// one host's CPU ranks) and CudaSymmetricHeap (device memory shared through
// CUDA IPC) own the arenas; this decides where in them each block lies.
// Not thread-safe: its owner holds a lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace xdev::transport {

// Where a block lies in every rank's heap: arena index and byte offset.
struct HeapLocation {
  int arena = -1;  // -1: not in the heap
  int64_t offset = 0;
  bool operator==(const HeapLocation& o) const { return arena == o.arena && offset == o.offset; }
};

// How a peer opens an arena of device memory (CudaSymmetricHeap): the
// arena's CUDA IPC handle, opaque here, and its size. Kept apart from CUDA's
// headers so that the shared-memory channel can carry it.
struct DeviceArenaAddress {
  static constexpr size_t kHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
  uint64_t bytes = 0;                         // 0: not published
  unsigned char handle[kHandleBytes] = {};
};

class HeapPlacement {
 public:
  // Every block starts on this boundary, so slices that start on cache-line
  // multiples of the tensor also start on cache lines of memory.
  static constexpr int64_t kAlignBytes = 256;
  // The largest block place() hands out: sizes stay far from overflowing.
  static constexpr int64_t kMaxBlockBytes = int64_t{1} << 56;
  // Arenas one rank's heap may have (the shared-memory channel publishes this many).
  static constexpr int kMaxArenas = 16;
  // The first arena the backends ask for: DDP's default buckets (25 MiB, and
  // 1 MiB for the first) fit.
  static constexpr size_t kFirstArenaBytes = size_t{32} << 20;

  // The bytes a block of `bytes` takes (zero takes kAlignBytes). Throws
  // std::invalid_argument above kMaxBlockBytes, naming `owner`.
  static int64_t block_bytes(size_t bytes, const char* owner);

  // The size of the next arena, for when no free range holds `need` bytes:
  // at least `need` and at least all arenas so far together (the first: at
  // least first_arena_bytes), in whole 2 MiB granules (a huge page, so THP can
  // back host arenas). Throws std::runtime_error, naming `owner` and `rank`,
  // when the heap has all kMaxArenas.
  size_t next_arena_bytes(size_t need, size_t first_arena_bytes, const char* owner, int rank) const;
  // A new, empty arena of `bytes`; returns its index.
  int add_arena(size_t bytes);
  // The first free range of the arenas that holds `need` bytes (from
  // block_bytes), now live; nullopt when none does (the owner adds an arena).
  std::optional<HeapLocation> place(int64_t need);
  // Returns the live block at `where` to the free ranges; false (and nothing
  // changes) when no block is live there.
  bool free(HeapLocation where);

  int arenas() const { return static_cast<int>(arenas_.size()); }
  size_t arena_bytes(int arena) const { return arenas_[static_cast<size_t>(arena)].bytes; }
  size_t bytes_reserved() const;
  size_t bytes_in_use() const;
  int64_t live_blocks() const;

 private:
  struct Arena {
    size_t bytes = 0;
    std::map<int64_t, int64_t> free_blocks;  // offset -> bytes, coalesced
    std::map<int64_t, int64_t> live_blocks;  // offset -> bytes
  };
  std::vector<Arena> arenas_;
};

// Where [p, p + n) lies among arenas whose data start at bases[i] with
// arena_bytes(i) bytes, or arena -1.
HeapLocation locate_in_arenas(const HeapPlacement& placement, const std::vector<char*>& bases,
                              const void* p, size_t n);

}  // namespace xdev::transport
