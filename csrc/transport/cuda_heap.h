// A symmetric heap of device memory: what SymmetricHeap is for CPU tensors,
// for CUDA tensors of one host's group whose GPUs reach each other. Each
// rank's arenas are cudaMalloc'd on its GPU, exported with a CUDA IPC handle
// (published in the group's shared-memory channel, no Store round trip) and
// opened by peers once, on first use. The same allocations and frees, made in
// the same order on every rank, land at the same place on every rank
// (HeapPlacement), so a collective on such a tensor reads the peers' copies
// straight from their memory (the executor's in-place program) with no
// staging copy. PyTorch's DDP allocates its gradient buckets this way
// (c10d's allocateTensor), once per bucket, reused every step.
//
// Streams follow the caching allocator's rule: a block belongs to the stream
// current when it was allocated. A freed block is placed again at once (so
// places stay a function of the calls alone, never of timing), but the next
// allocation that lands on its bytes first makes its stream wait, on the GPU,
// for the work queued before the free on every stream that used the block:
// the one it was allocated on, the group's collective stream, and the
// collective streams of other groups' xdev collectives that noted a use
// (note_use; NCCL's calls note none). No host
// wait, and no wait for frees elsewhere in the heap (heap_pending_frees.h).
// Other streams are the caller's to order: record_stream does nothing for
// memory the caching allocator does not own.
//
// Torch-free: CUDA runtime only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "heap_pending_frees.h"
#include "heap_placement.h"

namespace xdev::transport {

class CudaSymmetricHeap {
 public:
  static constexpr int kMaxArenas = HeapPlacement::kMaxArenas;
  using Publish = std::function<void(int arena, const DeviceArenaAddress& address)>;

  // Arenas are made on first use: the first holds first_arena_bytes, each
  // later one at least as much as all before it together
  // (HeapPlacement::next_arena_bytes).
  // collective_stream is where the group's collectives read and write blocks.
  CudaSymmetricHeap(int rank, int world_size, int device, size_t first_arena_bytes,
                    cudaStream_t collective_stream, Publish publish);
  ~CudaSymmetricHeap();  // frees arenas and events, closes peers' handles; never throws
  CudaSymmetricHeap(const CudaSymmetricHeap&) = delete;
  CudaSymmetricHeap& operator=(const CudaSymmetricHeap&) = delete;

  struct Block {
    char* data = nullptr;  // device memory of this rank
    HeapLocation where;
  };
  // A block of `bytes` for work on `stream` (which first waits for the work
  // that used the freed blocks it overlaps). Throws std::invalid_argument for a block
  // too large, std::runtime_error (CudaError from CUDA) when no arena can be
  // had. Thread-safe.
  Block allocate(size_t bytes, cudaStream_t stream);
  // Returns the block at `where`; never throws (it runs in a tensor's deleter,
  // possibly after CUDA has shut down at exit).
  void free(HeapLocation where) noexcept;

  // Notes that `stream` (another group's collective stream) works on the
  // block holding p: the block's free then waits for that stream's work too.
  // Returns whether p lies in this heap. Thread-safe.
  bool note_use(const void* p, cudaStream_t stream);

  // Unmaps every peer's arena (the group is done with them: its last
  // collective has passed its closing barrier). Later arena_of calls reopen.
  void close_peers() noexcept;

  // Where [p, p + n) lies in this rank's arenas, or arena -1.
  HeapLocation locate(const void* p, size_t n) const;

  // Rank r's arena as mapped in this process, opened from `address` on first
  // use (this rank's own: no address needed). Throws CudaError naming the
  // peer when it cannot be opened.
  char* arena_of(int r, int arena, const DeviceArenaAddress& address);

  int device() const { return device_; }
  size_t bytes_in_use() const;
  size_t bytes_reserved() const;
  int64_t live_blocks() const;

 private:
  int add_arena(size_t at_least);  // mutex_ held
  // An event to record, from the spares or new; nullptr when CUDA has none. mutex_ held.
  cudaEvent_t take_event();

  const int rank_;
  const int world_size_;
  const int device_;
  const size_t first_arena_bytes_;
  const cudaStream_t collective_stream_;
  Publish publish_;
  mutable std::mutex mutex_;
  HeapPlacement placement_;
  std::vector<char*> own_;  // this rank's arenas (cudaMalloc)
  struct LiveBlock {
    int64_t bytes = 0;
    cudaStream_t allocated = nullptr;     // current when it was allocated
    std::vector<cudaStream_t> also_used;  // other groups' collective streams (note_use)
  };
  std::map<std::pair<int, int64_t>, LiveBlock> blocks_;  // by (arena, offset)
  PendingFrees<cudaEvent_t> pending_frees_;
  std::vector<cudaEvent_t> spare_events_;
  // [rank][arena]: peers' arenas as opened here (IPC); own rank unused.
  std::vector<std::vector<char*>> peers_;
};

}  // namespace xdev::transport
