// Tensors in memory that every rank of a group maps, and their allreduce.
//
// Two kinds of such memory: torch_xdev.shared_empty gives each rank a tensor
// in its own segment and maps every peer's segment too (SharedBuffer); the
// group's symmetric heap (symmetric_heap.h) gives DDP its gradient buckets.
// An allreduce of such a tensor stages nothing: rank r sums its slice
// (plan::shared_buffer_slices) straight from every rank's copy and writes the
// total into every copy. Each byte of input is then read once and each total
// written once per rank, where the staged path also copies every byte
// through a slot and back; on the 2-core development machine that halves the
// time at 16 MiB (README, "Tensors every rank maps").
//
// Lifetime: segment names are unlinked as soon as every rank has mapped them
// (ShmSegment), so the memory lives exactly as long as some rank maps it,
// whatever way the processes end.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "shm_channel.h"
#include "shm_segment.h"

namespace xdev::transport {

class SharedBuffer {
 public:
  // segments[r] is rank r's segment as mapped in this process; all the same size.
  SharedBuffer(int64_t id, int rank, std::vector<ShmSegment> segments);

  // Equal on every rank: buffers are made collectively, in the same order.
  int64_t id() const { return id_; }
  size_t bytes() const { return segments_[static_cast<size_t>(rank_)].size(); }
  // Rank r's copy, as mapped in this process.
  char* data(int r) const { return static_cast<char*>(segments_[static_cast<size_t>(r)].data()); }
  // Where [p, p + n) starts in this rank's copy, or -1 when it is not wholly inside.
  int64_t offset_of(const void* p, size_t n) const;

 private:
  int64_t id_;
  int rank_;
  std::vector<ShmSegment> segments_;
};

struct SharedBufferRequest {
  int64_t count = 0;
  kernels::DType dtype = kernels::DType::kFloat32;
  kernels::ReduceOp op = kernels::ReduceOp::kSum;
  // Its descriptor says where the tensor is: in a shared_empty buffer
  // (shared_buffer, shared_offset: compared, so ranks that differ fail), or
  // in the symmetric heap (heap_arena, heap_offset: ranks that differ stage).
  OpContext ctx;
  // Every rank's copy of the tensor as mapped in this process, by rank.
  // Called after the first barrier, once every rank's place is known to agree
  // (a peer's heap arena is mapped on first use).
  std::function<std::vector<char*>()> copies;
};

// After the first barrier of the collective `mine` describes: whether every
// rank's descriptor puts its tensor at mine's place of the symmetric heap
// (heap_arena, heap_offset). The same answer on every rank, so all run in
// place or all stage. False when mine is not in the heap.
bool same_heap_place_on_every_rank(const ShmChannel& channel, const OpDescriptor& mine);

class SharedBufferExecutor {
 public:
  // The channel (its barriers and descriptor check) must outlive the executor.
  explicit SharedBufferExecutor(ShmChannel& channel) : channel_(channel) {}

  // Opens the collective (its first barrier), then run_opened.
  bool run(const SharedBufferRequest& req);

  // The rest, once every rank has passed the collective's first barrier (by
  // any path: the staged flat plan's first window calls it there). Returns
  // false, having touched nothing, when the tensor is in the symmetric heap
  // and not at the same place on every rank (or not in it on some): every
  // rank returns the same, and the caller stages.
  bool run_opened(const SharedBufferRequest& req);

 private:
  ShmChannel& channel_;
};

}  // namespace xdev::transport
