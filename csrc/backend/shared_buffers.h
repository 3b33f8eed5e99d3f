// CPU tensors in memory that every rank of the group maps, so that their
// allreduce runs in place (transport/shared_buffer.h). Two kinds:
//
// torch_xdev.shared_empty: making one is collective and goes through the
// Store: each rank creates a segment (mode 0600, unguessable name) and
// publishes its name and size; every rank maps every segment; once all have
// (a Store barrier), each rank unlinks its own name, so the memory goes with
// the last mapping, crash or not. The tensor's storage owns the mappings; the
// registry keeps weak references and finds the buffer a tensor lies in by
// address.
//
// The symmetric heap (transport/symmetric_heap.h): c10d's allocateTensor,
// which PyTorch's DDP calls for its gradient buckets, takes blocks from it
// with no Store round trip. Whether this host lets ranks open each other's
// arenas is probed once, when the group is made, and agreed through the Store.
// A group on several hosts has one heap per host, shared by the host's ranks
// (the two-level allreduce's in-host steps read it).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "../transport/shared_buffer.h"
#include "../transport/symmetric_heap.h"
#include "group_context.h"

namespace xdev::backend {

// Where a tensor lies in memory every rank of this group maps, if it does.
struct SharedPlacement {
  std::shared_ptr<transport::SharedBuffer> buffer;  // a shared_empty buffer, or null
  int64_t offset = 0;                               // bytes from the start of every rank's copy
  std::shared_ptr<transport::SymmetricHeap> heap;   // or the group's heap, or null
  transport::HeapLocation heap_location;            // and the place in this rank's heap
};

// Every rank's copy of the tensor at `placement`, as mapped in this process,
// by rank (peers' heap arenas are mapped on first use).
std::vector<char*> copies_of(const SharedPlacement& placement,
                             const transport::ShmChannel& channel);

// Maps every peer's heap arena that holds its copy of a tensor at `placement`
// (at once where mapped before), and says whether all could be. Called before
// a collective's first barrier: a rank that cannot map a peer's copy, or whose
// peer has not published that arena yet (it grew its heap a moment ago),
// announces no heap place, and every rank stages that call; the next call
// tries again. Past that barrier a mapping could fail on this rank alone while
// its peers ran in place. Logs a failed mapping once per group.
bool map_peers_copies(GroupContext& group, const SharedPlacement& placement,
                      const transport::ShmChannel& channel);

class SharedBuffers {
 public:
  // Collective when the group has shared memory and Options.shared_buckets:
  // every rank probes whether it can map its peers' heap arenas.
  explicit SharedBuffers(GroupContext& group);

  // Collective: every rank calls it with the same sizes and dtype, in the
  // same order. Throws std::invalid_argument (ValueError) without shared
  // memory or on a size mismatch. In a world of one: an ordinary zero tensor.
  at::Tensor empty(const std::vector<int64_t>& sizes, at::ScalarType dtype);

  // How many buffers some tensor still holds.
  int64_t live() const;

  // The buffer or heap block a contiguous CPU tensor lies wholly in, if any.
  SharedPlacement find(const at::Tensor& t) const;

  // Whether allocate() can give CPU tensors from the symmetric heap, and why (not).
  bool heap_available() const {
    std::lock_guard<std::mutex> lock(mutex_);  // c10d asks outside the call gate
    return heap_ != nullptr;
  }
  // The channel whose ranks share the heap: the group's on one host; on
  // several, this host's (its ranks are the host's local ranks). Null once closed.
  transport::ShmChannel* heap_channel() const;
  const std::string& heap_note() const { return heap_note_; }
  // c10d's allocateTensor: a CPU tensor of numel elements in the symmetric
  // heap. Not collective; every rank should allocate the same sizes in the
  // same order (DDP does). Throws std::invalid_argument without a heap.
  at::Tensor allocate(int64_t numel, at::ScalarType dtype);
  // Null without a heap, or once closed. Held by the caller: close() may run
  // meanwhile on another thread.
  std::shared_ptr<const transport::SymmetricHeap> heap() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return heap_;
  }
  // Before the group's channels close (its collectives done): see
  // SymmetricHeap::close. Later allocations raise; tensors already made stay,
  // and hold the heap (its own arenas) until the last of them goes: the
  // group's object, which Python may keep long after, does not.
  void close();

 private:
  GroupContext& group_;
  std::shared_ptr<transport::SymmetricHeap> heap_;  // tensors share it; null once closed
  bool closed_ = false;
  std::string heap_note_;
  mutable std::mutex mutex_;  // guards buffers_, and heap_ against close()
  int64_t next_id_ = 0;
  std::vector<std::weak_ptr<transport::SharedBuffer>> buffers_;
};

}  // namespace xdev::backend
