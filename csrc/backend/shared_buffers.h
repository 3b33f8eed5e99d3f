// The buffers of torch_xdev.shared_empty: CPU tensors in memory that every
// rank of the group maps, so that their allreduce runs in place
// (transport/shared_buffer.h).
//
// Making one is collective and goes through the Store: each rank creates a
// segment (mode 0600, unguessable name) and publishes its name and size; every
// rank maps every segment; once all have (a Store barrier), each rank unlinks
// its own name, so the memory goes with the last mapping, crash or not. The
// tensor's storage owns the mappings; the registry keeps weak references and
// finds the buffer a tensor lies in by address.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "../transport/shared_buffer.h"
#include "group_context.h"

namespace xdev::backend {

// Where a tensor lies in a live shared buffer of this group.
struct SharedPlacement {
  std::shared_ptr<transport::SharedBuffer> buffer;  // null: not in one
  int64_t offset = 0;                               // bytes from the start of every rank's copy
};

class SharedBuffers {
 public:
  explicit SharedBuffers(GroupContext& group) : group_(group) {}

  // Collective: every rank calls it with the same sizes and dtype, in the
  // same order. Throws std::invalid_argument (ValueError) without shared
  // memory or on a size mismatch. In a world of one: an ordinary zero tensor.
  at::Tensor empty(const std::vector<int64_t>& sizes, at::ScalarType dtype);

  // How many buffers some tensor still holds.
  int64_t live() const;

  // The buffer a contiguous CPU tensor lies wholly in, if any.
  SharedPlacement find(const at::Tensor& t) const;

 private:
  GroupContext& group_;
  mutable std::mutex mutex_;
  int64_t next_id_ = 0;
  std::vector<std::weak_ptr<transport::SharedBuffer>> buffers_;
};

}  // namespace xdev::backend
