// The backend's CUDA side, behind an interface so that XdevBackend compiles
// (and CPU builds link) without CUDA. The implementation, CudaCollectivesImpl
// in csrc/backend/cuda/, is built only when torch has CUDA; it is the thin
// torch glue around the torch-free CUDA transport (csrc/transport/cuda_*).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/cost_model.h"
#include "../plan/gather_scatter_plan.h"
#include "../plan/selection.h"
#include "../plan/topology.h"

namespace xdev::backend {

class GroupContext;

// What every rank of the group agreed on about its GPUs (identical on all ranks).
struct CudaGroupInfo {
  int device = -1;                // this rank's CUDA device
  std::vector<std::string> gpus;  // PCI bus id of every rank's GPU, by rank
  plan::LinkMatrix nvlink;        // NVLinks between the ranks' GPUs (through switches too)
  std::vector<int> nvswitch;      // per rank, its GPU's NVLinks to NVSwitches (may be empty)
  plan::LinkMatrix reachable;     // 1 where the two ranks' GPUs can access each other
  plan::TopologyClass topology = plan::TopologyClass::kNone;
  std::string topology_source;   // "nvml", "XDEV_TOPO_FILE", or why there are no NVLinks
  bool ranks_share_gpu = false;  // NCCL refuses this: CUDA fallback is Gloo then
  bool mps = false;              // every rank sees a CUDA MPS control daemon
  // Ranks share a GPU without MPS: the driver time-slices their kernels, and
  // auto leaves collectives to the engine (plan::kGpuTimeSlicedReason).
  bool gpu_time_sliced = false;
  int ranks_on_this_gpu = 1;   // the group's ranks on this rank's GPU, itself included
  int compute_capability = 0;  // the lowest of the ranks' GPUs, major x 10 + minor
  // The machine auto weighs xdev's plans and NCCL's algorithms on: set where
  // every rank of the one host has a GPU of its own (ranks sharing a GPU
  // exchange through its memory, not its links: the fixed rule decides there).
  std::optional<plan::MachineModel> model;
  bool transport = false;      // the CUDA IPC channel is open on every rank
  std::string transport_note;  // why it is on or off
  // Why allocateTensor does or does not give tensors of `device` from the
  // group's CUDA heap (memory every rank maps, whose allreduce runs in place;
  // needs the transport). Whether it does: CudaCollectives::heap_state.
  std::string heap_note;
};

// Whether allocateTensor gives tensors from the group's CUDA heap, and why
// (CudaGroupInfo::heap_note), copied under the lock that
// destroy_process_group takes to turn the heap off.
struct CudaHeapState {
  bool on = false;
  std::string note;
};

// What the group's CUDA heap holds (describe()).
struct CudaHeapUsage {
  int64_t bytes_reserved = 0;
  int64_t bytes_in_use = 0;
  int64_t live_blocks = 0;
  int64_t in_place_allreduces = 0;  // allreduces that read the peers' copies in place
};

class CudaCollectives {
 public:
  virtual ~CudaCollectives() = default;

  // Collective over the group, through the Store only: learns every rank's
  // GPU, agrees on the topology and opens the IPC transport where every GPU
  // reaches every other. The first call does the work; later calls return
  // the same info (a call for another device throws). Thread-safe.
  virtual const CudaGroupInfo& ensure_ready(int device) = 0;

  // Null until ensure_ready has succeeded.
  virtual const CudaGroupInfo* info() const = 0;

  // Why the native path cannot take a call on device's current stream now
  // ("" when it can): the stream is capturing a CUDA graph.
  virtual std::string stream_refusal(int device) const = 0;

  // Native allreduce of CUDA tensors (one device, native dtypes; may mix
  // dtypes). Stream semantics as ProcessGroupNCCL.
  virtual c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> tensors,
                                                   kernels::ReduceOp op, plan::Selection sel,
                                                   std::chrono::milliseconds timeout) = 0;

  // Native reduce-scatter (kind kReduceScatter: `full` in, this rank's
  // `block` out) or all-gather (`block` in, `full` out) of CUDA tensors on the
  // group's device. `full` is one tensor holding every rank's block in rank
  // order, or (the list forms) one tensor per rank, each of the block's size
  // and dtype, packed into one on the group's stream (shapes checked by the
  // caller). An all-gather moves bytes, so any dtype; a reduce-scatter needs
  // a native dtype and op. Needs the transport (info()->transport). Stream
  // semantics as allreduce.
  virtual c10::intrusive_ptr<c10d::Work> gather_scatter(plan::GatherScatterKind kind,
                                                        std::vector<at::Tensor> full,
                                                        at::Tensor block, kernels::ReduceOp op,
                                                        c10d::OpType type,
                                                        std::chrono::milliseconds timeout) = 0;

  // c10d's allocateTensor for CUDA tensors on the group's device: numel
  // elements from the group's CUDA heap, for work on the current stream.
  // Throws std::invalid_argument on a bad size, or where the group has no
  // heap (heap_state's note says why).
  virtual at::Tensor allocate_tensor(int64_t numel, at::ScalarType dtype) = 0;
  // Read this, not info()'s heap_note, which destroy_process_group changes.
  virtual CudaHeapState heap_state() const = 0;
  virtual std::optional<CudaHeapUsage> heap_usage() const = 0;  // nullopt without a heap
  // Whether t is a contiguous tensor lying in this rank's CUDA heap.
  virtual bool in_heap(const at::Tensor& t) const = 0;

  // Blocks the host until every GPU collective launched so far has finished,
  // and throws if a GPU barrier gave up on a peer.
  virtual void synchronize() = 0;

  // Frees the transport (after synchronize); idempotent, never throws.
  virtual void shutdown() noexcept = 0;
};

// Null when this build has no CUDA (or torch sees no GPU).
std::unique_ptr<CudaCollectives> make_cuda_collectives(GroupContext& group);

}  // namespace xdev::backend
