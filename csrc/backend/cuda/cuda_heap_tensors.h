// CUDA tensors from the group's device-memory symmetric heap
// (transport/cuda_heap.h): c10d's allocateTensor for CUDA, which PyTorch's DDP
// calls for its gradient buckets, and the lookups the in-place allreduce needs.
// Built only when torch has CUDA.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "../../transport/cuda_heap.h"
#include "../group_context.h"

namespace xdev::backend {

class CudaHeapTensors {
 public:
  // The heap of this rank's GPU; arenas are published in the group's
  // shared-memory channel, which must be there.
  CudaHeapTensors(GroupContext& group, int device, cudaStream_t collective_stream);
  // Unmaps the peers' arenas; the heap itself lives on in its tensors.
  ~CudaHeapTensors();
  CudaHeapTensors(const CudaHeapTensors&) = delete;
  CudaHeapTensors& operator=(const CudaHeapTensors&) = delete;

  // A tensor of numel elements in the heap, for work on the device's current
  // stream. Not collective; every rank should allocate the same sizes in the
  // same order (DDP does). Throws std::invalid_argument on a bad size. When
  // the heap cannot grow (device memory, or its arena limit), an ordinary
  // tensor instead, logged once: a failure on one rank alone would leave its
  // peers waiting, and collectives on such tensors stage on every rank.
  at::Tensor allocate(int64_t numel, at::ScalarType dtype);

  using Heaps = std::vector<std::shared_ptr<transport::CudaSymmetricHeap>>;

  // Every CUDA heap of this process on `device`, this group's or another's (a
  // tensor of one group's heap may go to another group's collective): taken
  // once per call, for note_use on each of its tensors.
  static Heaps heaps_on(int device);

  // Whether t's storage is a block of one of `heaps`, whose free then waits
  // for the work `stream` has queued (a group's collective stream). Such
  // memory is not the caching allocator's: its recordStream would do nothing,
  // or refuse it (cudaMallocAsync).
  static bool note_use(const Heaps& heaps, const at::Tensor& t, cudaStream_t stream);

  // Where a contiguous tensor's bytes lie in this rank's heap (arena -1: not there).
  transport::HeapLocation locate(const at::Tensor& t) const;

  // Before a collective's host barrier: opens every peer's arena of `where`.
  // False when a peer has not published it yet (it allocated there after this
  // rank looked: a later call finds it) or one cannot be opened (logged once);
  // the caller then says its tensor is not in the heap, so that every rank
  // stages. Opening nothing after the barrier means no rank can fail alone
  // there, which would leave its peers waiting in the GPU barrier.
  bool open_peers(transport::HeapLocation where);

  // Every rank's copy of the bytes at `where`, as mapped here, by rank
  // (open_peers(where) returned true).
  std::vector<char*> copies(transport::HeapLocation where);

  const transport::CudaSymmetricHeap& heap() const { return *heap_; }

 private:
  GroupContext& g_;
  std::shared_ptr<transport::CudaSymmetricHeap>
      heap_;  // tensors share it: it may outlive the group
};

}  // namespace xdev::backend
