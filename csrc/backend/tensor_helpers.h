// Small torch-side helpers shared by the CPU and CUDA halves of the backend.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../kernels/cpu_reduce.h"

namespace xdev::backend {

// The kernels' dtype for a torch dtype; nullopt where no native kernel exists.
std::optional<kernels::DType> native_dtype(at::ScalarType t);

// The kernels' op for a c10d op; nullopt for ops without a native kernel.
std::optional<kernels::ReduceOp> native_op(const c10d::ReduceOp& op);

// FNV-1a over every tensor's dtype and sizes: two ranks with equal hashes
// almost surely pass the same shapes, and a mismatch is caught on all ranks.
uint64_t shape_hash(const std::vector<at::Tensor>& tensors);

int64_t payload_bytes(const std::vector<at::Tensor>& tensors);

// Returns once all world_size ranks have called it with this key prefix (once
// each). Without a timeout the store's own applies.
void store_barrier(c10d::Store& store, const std::string& prefix, int world_size,
                   std::optional<std::chrono::milliseconds> timeout = std::nullopt);

// Every rank says whether its part of a setup failed; returns how many did,
// the same number on every rank, once all have voted. Keys under `prefix`.
int64_t count_failures_across_ranks(c10d::Store& store, const std::string& prefix, bool failed,
                                    int world_size);

}  // namespace xdev::backend
