// Runs a CollectivePlan's allreduce, or a GatherScatterPlan's reduce-scatter
// or all-gather, on GPUs over a CudaIpcChannel: one kernel launch per window,
// which stages the rank's input into its slot, runs the rank's steps reading
// peers' slots straight over NVLink / PCIe (no copy into a local buffer
// first), and passes a barrier of every rank between phases.
//
// The barrier lives on the GPU (flags in IPC memory), so the host only
// launches: no host round trip per phase. Its memory-ordering argument is
// next to the kernel in cuda_executor.cu.
//
// Torch-free; the caller owns streams and the ordering with its own work.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/collective_plan.h"
#include "../plan/device_program.h"
#include "../plan/gather_scatter_plan.h"
#include "cuda_ipc_channel.h"
#include "deadline.h"

namespace xdev::transport {

// What identifies a plan's device programs in the cache: everything
// CollectivePlan::allreduce or the GatherScatterPlan was built from (programs
// are in elements, so the dtype does not matter, only the slot's capacity in
// its elements).
struct CudaPlanKey {
  enum Collective { kAllreduce, kReduceScatter, kAllGather, kAllreduceInPlace };
  int collective = kAllreduce;
  int algorithm = 0;
  int root = 0;
  int64_t total = 0;
  int64_t window_elems = 0;  // a gather/scatter: the slot's capacity; in place: element bytes
  std::vector<int64_t> pack_bounds;  // begin, end of every pack; a gather/scatter: every block
  std::vector<int> tree_ids;         // the balanced plan's trees, flattened; empty otherwise

  bool operator<(const CudaPlanKey& o) const {
    return std::tie(collective, algorithm, root, total, window_elems, pack_bounds, tree_ids) <
           std::tie(o.collective, o.algorithm, o.root, o.total, o.window_elems, o.pack_bounds,
                    o.tree_ids);
  }
};

class CudaExecutor {
 public:
  // ranks_on_this_gpu counts the group's ranks whose kernels run on this
  // rank's GPU (itself included): they split its SMs
  // (plan::device_blocks_per_rank).
  CudaExecutor(CudaIpcChannel& channel, int ranks_on_this_gpu);
  ~CudaExecutor();  // never throws
  CudaExecutor(const CudaExecutor&) = delete;
  CudaExecutor& operator=(const CudaExecutor&) = delete;

  // A collective's device programs: what prepare() compiles and uploads (once
  // per key: cached) and launch() runs. Made by the three functions below,
  // whose plan must outlive it. Every rank must launch the same programs in the
  // same order.
  struct Program {
    CudaPlanKey key;
    int64_t num_windows = 0;
    std::function<plan::DeviceProgram(int64_t)> compile;
  };

  // An allreduce by plan of a contiguous tensor, read and written in place
  // (launch's input and output are the tensor).
  Program allreduce_program(const CudaPlanKey& key, const plan::CollectivePlan& plan) const;

  // The in-place allreduce of a tensor that lies at the same place in every
  // rank's CudaSymmetricHeap: launch's copies[r] is rank r's copy as mapped
  // here (this rank's own among them), its input and output this rank's copy.
  // One kernel, no slot (plan::compile_in_place_program).
  Program in_place_program(int64_t total, kernels::DType dtype) const;

  // A reduce-scatter (input: the full tensor, output: this rank's block) or an
  // all-gather (the other way round); both contiguous. key.collective says
  // which, key.pack_bounds holds every rank's block. An all-gather's input may
  // lie inside its output, at its own block.
  Program gather_scatter_program(const CudaPlanKey& key, const plan::GatherScatterPlan& plan) const;

  // Everything that can fail on this rank alone before a launch: compiles and
  // uploads every program of a call that the cache lacks, and throws if an
  // earlier kernel of this rank gave up (device_error). Callers run it before
  // the collective's host barrier, with every program the call may launch: a
  // rank that throws after the barrier leaves its peers waiting in the GPU
  // barrier until the timeout. A full cache is emptied here, before any of
  // them is compiled, so that all of them stay until their launch.
  void prepare(const std::vector<const Program*>& programs, cudaStream_t stream);

  // Enqueues every window of program, which prepare() made ready since the
  // last call's launch, on stream and returns (std::logic_error if it did
  // not: launching compiles nothing, since nothing may fail here alone).
  // call_hash (call_hash() of the call's descriptor) goes with every barrier's
  // epoch: a peer whose hash differs stops every rank's kernel (device_error).
  // timeout: the call's, which bounds each of its kernels' waits for a peer;
  // a kernel that gives up records it (device_error) and exits. copies: every
  // rank's copy of the tensor for in_place_program, else empty.
  void launch(const Program& program, uint32_t call_hash, const void* input, void* output,
              kernels::DType dtype, kernels::ReduceOp op, std::chrono::milliseconds timeout,
              cudaStream_t stream, const std::vector<char*>& copies = {});

  // Empty while healthy; otherwise what a kernel reported (which peer it gave
  // up waiting for, or found running another call). Once set, the channel's
  // barrier counters disagree across ranks: the group must be recreated.
  std::string device_error() const;
  // Leaves `code` (gpu_barrier::peer_gone) in the error word unless a cause is
  // there already: every kernel of this rank waiting at a barrier stops within
  // a few tens of microseconds, and so does each later one at its first wait
  // that is not ready at once. For the host's watch of the peers (PeerWatch),
  // from any thread.
  void stop_kernels(unsigned int code);

 private:
  struct DeviceWindow {
    plan::DeviceOp* ops = nullptr;  // device memory
    int32_t num_phases = 0;
    std::vector<int32_t> phase_begin;
  };
  // Compiles program's windows and uploads them on stream.
  std::vector<DeviceWindow> compile(const Program& program, cudaStream_t stream) const;
  // Frees every cached window (the caller knows no kernel still reads them).
  void release_cache() noexcept;

  CudaIpcChannel& channel_;
  int num_blocks_ = 0;
  void* grid_sync_ = nullptr;             // device: this rank's block counters
  unsigned int* error_host_ = nullptr;    // pinned, mapped: a kernel's report
  unsigned int* error_device_ = nullptr;  // the same word as the device sees it
  uint64_t epoch_ = 0;                    // barriers passed by every kernel so far
  int64_t windows_run_ = 0;               // slot sets alternate by window
  std::map<CudaPlanKey, std::vector<DeviceWindow>> cache_;
  size_t cached_windows_ = 0;
};

}  // namespace xdev::transport
