// The torch glue of the CUDA path: streams, events, the caching allocator and
// the Store rendezvous. Built only when torch has CUDA (setup.py); everything
// that moves bytes is in csrc/transport/cuda_* and csrc/kernels/cuda_*.
#include <ATen/ops/cat.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "../../plan/machines.h"
#include "../../transport/cuda_executor.h"
#include "../../transport/cuda_ipc_channel.h"
#include "../../transport/gpu_barrier_word.h"
#include "../../transport/peer_watch.h"
#include "../../transport/shared_buffer.h"
#include "../allreduce_call.h"
#include "../cuda_collectives.h"
#include "../group_context.h"
#include "../setup_waits.h"
#include "../tensor_helpers.h"
#include "cuda_gpu_exchange.h"
#include "cuda_heap_tensors.h"
#include "cuda_work.h"

namespace xdev::backend {
namespace {

using transport::check_cuda;

// What identifies a staged allreduce's device programs in the executor's cache.
transport::CudaPlanKey allreduce_key(const plan::Selection& sel, const DtypeAllreduce& call,
                                     int64_t root, int64_t window_elems) {
  transport::CudaPlanKey key;
  key.algorithm = static_cast<int>(sel.algorithm);
  key.root = static_cast<int>(root);
  key.total = call.total();
  key.window_elems = window_elems;
  for (const plan::Range& r : call.packs) {
    key.pack_bounds.push_back(r.begin);
    key.pack_bounds.push_back(r.end);
  }
  if (sel.algorithm == plan::Algorithm::kHierarchicalBalanced) {
    key.tree_ids.push_back(static_cast<int>(call.packs.size()));
  }
  return key;
}

}  // namespace

class CudaCollectivesImpl : public CudaCollectives {
 public:
  explicit CudaCollectivesImpl(GroupContext& group) : g_(group) {}
  ~CudaCollectivesImpl() override { shutdown(); }

  const CudaGroupInfo& ensure_ready(int device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (info_) {
      TORCH_CHECK_VALUE(info_->device == device,
                        "xdev: this group runs CUDA collectives on cuda:", info_->device,
                        "; got a tensor on cuda:", device,
                        ". Use one GPU per rank (torch.cuda.set_device(local_rank)).");
      return *info_;
    }
    // Its store keys and counters serve one attempt: a second could read a
    // peer's handles from the first (memory since freed) or pass its barriers.
    TORCH_CHECK(rendezvous_failure_.empty(),
                "xdev: this group's CUDA transport failed to open at its first CUDA collective (",
                rendezvous_failure_, "); destroy the group and create a new one");
    // The rendezvous allocates and maps device memory and waits on the store:
    // calls a capture in CUDA's default (global) mode forbids, which would
    // spoil the user's graph with an error that names none of this.
    TORCH_CHECK(stream_refusal(device).empty(),
                "xdev: the first CUDA collective of a group opens its CUDA transport, which "
                "cannot happen while a CUDA graph is being captured. Call "
                "torch_xdev.prepare_cuda_graph_capture(group) on every rank before capturing: "
                "it opens the transport and NCCL's communicator, which runs captured calls "
                "(ranks that share a GPU cannot capture collectives: NCCL refuses them).");
    try {
      info_ = rendezvous(device);
    } catch (const std::exception& e) {
      rendezvous_failure_ = e.what();
      throw;
    }
    return *info_;
  }

  const CudaGroupInfo* info() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return info_ ? &*info_ : nullptr;
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> tensors, kernels::ReduceOp op,
                                           plan::Selection sel,
                                           std::chrono::milliseconds timeout) override {
    return launch(c10d::OpType::ALLREDUCE, "xdev:all_reduce", tensors, tensors,
                  [this, tensors, op, sel, timeout] { run_allreduce(tensors, op, sel, timeout); });
  }

  c10::intrusive_ptr<c10d::Work> gather_scatter(plan::GatherScatterKind kind,
                                                std::vector<at::Tensor> full, at::Tensor block,
                                                kernels::ReduceOp op, c10d::OpType type,
                                                std::chrono::milliseconds timeout) override {
    const bool reduce_scatter = kind == plan::GatherScatterKind::kReduceScatter;
    std::vector<at::Tensor> used = full;
    used.push_back(block);
    return launch(type, reduce_scatter ? "xdev:reduce_scatter" : "xdev:all_gather", used,
                  reduce_scatter ? std::vector<at::Tensor>{block} : full,
                  [this, kind, full, block, op, timeout] {
                    run_gather_scatter(kind, full, block, op, timeout);
                  });
  }

  std::string stream_refusal(int device) const override {
    if (!transport::stream_is_capturing(c10::cuda::getCurrentCUDAStream(device).stream())) {
      return {};
    }
    // A replay would run the kernels with the barrier epochs and slot sets
    // of the capture, which the host has moved past since.
    return "off for this call: the current stream is capturing a CUDA graph, which xdev's GPU "
           "barriers cannot be replayed in";
  }

  // These run on the caller's thread, which may race destroy_process_group
  // (shutdown): they read heap_ under the lock.
  at::Tensor allocate_tensor(int64_t numel, at::ScalarType dtype) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!heap_) {
      throw std::invalid_argument(
          "xdev allocateTensor: this group has no CUDA heap (" +
          (info_ ? info_->heap_note : std::string("no CUDA collective yet")) + ")");
    }
    return heap_->allocate(numel, dtype);
  }

  CudaHeapState heap_state() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!info_) return {false, "no CUDA collective has run on it yet"};
    return {heap_ != nullptr, info_->heap_note};
  }

  std::optional<CudaHeapUsage> heap_usage() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!heap_) return std::nullopt;
    const transport::CudaSymmetricHeap& h = heap_->heap();
    return CudaHeapUsage{static_cast<int64_t>(h.bytes_reserved()),
                         static_cast<int64_t>(h.bytes_in_use()), h.live_blocks(),
                         in_place_allreduces_.load()};
  }

  bool in_heap(const at::Tensor& t) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return heap_ != nullptr && heap_->locate(t).arena >= 0;
  }

  void synchronize() override {
    if (!stream_) return;
    stream_->synchronize();
    const std::string failed = executor_ ? executor_->device_error() : std::string();
    if (!failed.empty()) throw transport::PeerError("xdev: " + failed);
  }

  void shutdown() noexcept override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stream_) return;
    bool running = false;
    try {
      // The stream's device: info_ is empty when the rendezvous failed after making it.
      c10::cuda::CUDAGuard guard(stream_->device_index());
      // A kernel of ours waiting for a peer that has exited would hold
      // destroy_process_group until its GPU barrier's timeout (the group's,
      // 30 min by default): stop it, as the peer watch does, and give the
      // stream a moment to drain. A peer that has left without exiting (in
      // another pid namespace, say): stop waiting at once, as before.
      transport::ShmChannel* host = g_.channel();
      std::optional<transport::Clock::time_point> stopped_at;
      running = !wait_for_stream(stream_->stream(), [&] {
        if (host == nullptr) return false;
        if (!stopped_at) {
          const int exited = host->exited_peer_rank();
          if (exited < 0) return !host->gone_peer().empty();
          if (executor_) executor_->stop_kernels(transport::gpu_barrier::peer_gone(exited));
          stopped_at = transport::Clock::now();
        }
        return transport::Clock::now() - *stopped_at > std::chrono::seconds(2);
      });
      // Peers may still be reading our slots in their last phase: free the
      // buffer only once every rank's GPU work is done (bounded wait; a dead
      // peer reads nothing).
      if (!running && channel_ && host != nullptr) {
        const auto wait =
            std::min<std::chrono::milliseconds>(g_.config().timeout, std::chrono::seconds(30));
        host->barrier(transport::Clock::now() + wait, "CUDA transport shutdown");
      }
    } catch (...) {
      // A peer gone, or the CUDA context already torn down at interpreter exit.
    }
    watch_.reset();
    if (running) {
      // A kernel still waits for the peer that is gone, and reads and writes
      // these buffers until its GPU barrier times out: leave them allocated
      // (device memory, which this process's exit frees) rather than free
      // memory in use.
      (void)heap_.release();
      (void)executor_.release();
      (void)channel_.release();
    }
    heap_.reset();  // tensors from it keep its memory until they go
    if (info_) info_->heap_note = "off: the group has shut down";
    device_error_->detach();
    executor_.reset();
    channel_.reset();
    stream_.reset();
  }

 private:
  // Learns the group's GPUs (learn_gpus) and opens the IPC transport where
  // every GPU reaches every other. Every rank derives the same answer from the
  // same Store values.
  CudaGroupInfo rendezvous(int device) {
    c10d::Store& store = g_.store();
    const BackendConfig& config = g_.config();
    const int rank = g_.rank(), size = g_.size();
    const std::string key = "xdev/cuda/";
    c10::cuda::CUDAGuard guard(device);
    CudaGroupInfo info;
    info.device = device;
    stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);

    const bool all_reachable = learn_gpus(g_, key, device, &info);
    planner_.emplace(info.nvlink);

    info.transport_note = plan::cuda_transport_refusal(
        g_.num_hosts(), size, all_reachable, g_.channel() != nullptr, info.compute_capability);
    if (info.transport_note.empty()) open_transport(store, key, device, &info);
    if (!info.transport)
      info.heap_note = "off: needs the CUDA IPC transport (" + info.transport_note + ")";
    if (config.debug && rank == 0) {
      std::fprintf(
          stderr, "[xdev] group '%s': CUDA topology %s (%s), ranks %s a GPU, transport %s\n",
          config.group_name.c_str(), plan::to_string(info.topology), info.topology_source.c_str(),
          info.ranks_share_gpu ? "share" : "do not share", info.transport_note.c_str());
    }
    return info;
  }

  // A kernel waiting at a GPU barrier for a peer that has exited would wait
  // out the group's timeout (30 minutes by default), and the caller's stream
  // behind it: the host watches the peers instead, as its own waits do, and
  // stops the kernels within about kLivenessCheckPeriod. Their error reaches
  // the group's next call, as a timeout's does. Only an exit counts: a peer
  // that has left the group (its error, or destroy_process_group) still runs
  // the GPU work it queued before, which ours may be waiting for.
  void watch_peers() {
    transport::ShmChannel* host = g_.channel();
    if (host == nullptr) return;  // (the transport needs the channel: not reached)
    transport::CudaExecutor* executor = executor_.get();
    watch_ = std::make_unique<transport::PeerWatch>(
        [host] { return host->exited_peer_rank(); },
        [executor](int rank) { executor->stop_kernels(transport::gpu_barrier::peer_gone(rank)); },
        transport::ShmChannel::kLivenessCheckPeriod);
  }

  // Every rank opens its channel, then all vote: one failure anywhere turns
  // the transport off everywhere, so the ranks always choose alike.
  void open_transport(c10d::Store& store, const std::string& key, int device, CudaGroupInfo* info) {
    std::string why;
    try {
      channel_ = std::make_unique<transport::CudaIpcChannel>(
          g_.rank(), g_.size(), device, static_cast<size_t>(g_.config().cuda_slot_bytes),
          key + "ipc/", [&store](const std::string& k, const std::string& v) { store.set(k, v); },
          [&store](const std::string& k) { return store.get_to_str(k); });
      executor_ = std::make_unique<transport::CudaExecutor>(*channel_, info->ranks_on_this_gpu);
      device_error_->attach([executor = executor_.get()] { return executor->device_error(); });
    } catch (const std::exception& e) {
      why = e.what();
      device_error_->detach();
      executor_.reset();
      channel_.reset();
    }
    const int64_t failures =
        count_failures_across_ranks(store, key, !why.empty(), g_.rank(), g_.size(),
                                    g_.config().timeout, "opening the CUDA transport");
    if (failures == 0) {
      watch_peers();
      info->transport = true;
      info->transport_note = "on: CUDA IPC staging buffers, " +
                             std::to_string(g_.config().cuda_slot_bytes) + " bytes per slot";
      // The transport is open and watched: a failure now must not fail the
      // rendezvous, whose retry would replace the channel under the watch.
      // Ranks may differ in their heaps (a collective then stages).
      try {
        open_heap(device, info);
      } catch (const std::exception& e) {
        heap_.reset();
        info->heap_note = std::string("off: ") + e.what();
      }
      return;
    }
    device_error_->detach();
    executor_.reset();
    channel_.reset();
    info->transport_note = why.empty() ? "off: " + std::to_string(failures) +
                                             " rank(s) could not open CUDA IPC (see their log)"
                                       : "off: " + why;
    if (!why.empty()) {
      std::fprintf(stderr, "[xdev] group '%s' rank %d: CUDA IPC unavailable: %s\n",
                   g_.config().group_name.c_str(), g_.rank(), why.c_str());
    }
  }

  // The CUDA heap needs nothing from peers until its first in-place
  // collective: arenas are made and published on first allocation, and the
  // IPC transport just proved that every rank can open every other's memory.
  void open_heap(int device, CudaGroupInfo* info) {
    if (!g_.config().shared_buckets) {
      info->heap_note = "off: Options.shared_buckets / XDEV_SHARED_BUCKETS is off";
      return;
    }
    // Running in place needs the ranks' agreement on places, which the host
    // barrier carries: without it a heap tensor would only stage.
    if (!g_.config().cuda_host_check) {
      info->heap_note =
          "off: Options.cuda_host_check / XDEV_CUDA_HOST_CHECK is off (running in "
          "place needs the host barrier's agreement on places)";
      return;
    }
    // A Work's future records its CUDA tensors on the waiting streams through
    // the allocator, and the cudaMallocAsync backend asserts on memory it did
    // not allocate. (Ranks may differ here: a collective then stages.)
    if (c10::cuda::CUDACachingAllocator::name() == "cudaMallocAsync") {
      info->heap_note =
          "off: the cudaMallocAsync allocator (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) "
          "refuses to record streams for memory it did not allocate";
      return;
    }
    heap_ = std::make_unique<CudaHeapTensors>(g_, device, stream_->stream());
    info->heap_note =
        "on: CUDA tensors from allocateTensor (DDP's buckets) lie in device memory every rank "
        "maps (CUDA IPC); their allreduce reads the peers' copies in place";
  }

  // Queues `run` on the group's op thread with our stream current; the stream
  // starts after everything the caller queued before this call on `used`.
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, const char* title,
                                        const std::vector<at::Tensor>& used,
                                        std::vector<at::Tensor> outputs,
                                        std::function<void()> run) {
    const int device = info_->device;
    c10::cuda::CUDAGuard device_guard(device);
    auto ready = std::make_shared<StreamEvent>();
    ready->record(c10::cuda::getCurrentCUDAStream(device));
    // The caller may free these once its stream moves on; the allocator must
    // not hand their memory out before our stream is done with them. A CUDA
    // heap's tensors, this group's or another's, are not the allocator's:
    // their heap orders their reuse after our stream's work.
    const CudaHeapTensors::Heaps heaps = CudaHeapTensors::heaps_on(device);
    for (const at::Tensor& t : used) {
      if (CudaHeapTensors::note_use(heaps, t, stream_->stream())) continue;
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *stream_);
    }
    auto work = c10::make_intrusive<CudaWork>(g_.rank(), type, title, std::move(outputs), *stream_,
                                              device_error_);
    g_.enqueue_work(
        work,
        [this, work, ready, run = std::move(run)]() {
          c10::cuda::CUDAGuard guard(info_->device);
          c10::cuda::CUDAStreamGuard stream_guard(*stream_);
          ready->block(*stream_);
          try {
            run();
          } catch (...) {
            // Kernels this call launched before it failed (an earlier dtype's,
            // say) still write the caller's tensors, which the caller, told
            // the call failed, may touch at once: let them finish first. Each
            // passed its host barrier with every rank, or stops at its GPU
            // barrier's timeout. Their own error is not this call's.
            if (cudaStreamSynchronize(stream_->stream()) != cudaSuccess) (void)cudaGetLastError();
            throw;
          }
          work->record_done();
        },
        /*async_op=*/false);  // inline unless CPU work is queued: launching is quick
    return work;
  }

  // Runs `steps`: this rank's work on a call before its host barrier (packing
  // a list, making programs ready). Where they fail (out of memory, a CUDA
  // error left pending by earlier work) and the host barrier is on, this rank
  // still takes the call's place there with `d` (numbered) marked as failed,
  // so that its peers fail at this call with a mismatch that names it instead
  // of waiting for it, and the group stays usable. After a failed GPU
  // collective (the executor's device error), or with the CUDA context in an
  // error that does not clear (a kernel's illegal access), every later call
  // would fail the same way: the group becomes unusable, as before.
  template <typename Steps>
  void before_host_barrier(transport::OpDescriptor d, const char* what,
                           transport::Clock::time_point deadline, Steps&& steps) {
    try {
      steps();
    } catch (const std::exception& e) {
      if (!g_.config().cuda_host_check || !executor_->device_error().empty() ||
          cudaPeekAtLastError() != cudaSuccess) {
        throw;
      }
      const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
      const std::string why = torch_error ? torch_error->what_without_backtrace() : e.what();
      d.num_tensors = kFailedBeforePeers;
      try {
        g_.channel()->open_collective(g_.make_context(d, what, deadline));
      } catch (const transport::MismatchError&) {
        // Expected where the peers called validly: they fail here as well.
      } catch (const transport::PeerError& gone) {
        throw transport::PeerError(std::string(gone.what()) + " (this rank had failed before " +
                                   "it met its peers: " + why + ")");
      }
      throw CallError(std::string("xdev ") + what +
                      ": failed on this rank before it met its peers (" + why +
                      "); they fail at this call too, and the group stays usable");
    }
  }

  // On the op's thread, with our stream current. Both sides are made
  // contiguous for the kernel (the output copied back after, if it was not);
  // a list's tensors are packed into one full tensor (an all-gather's
  // unpacked after).
  void run_gather_scatter(plan::GatherScatterKind kind, const std::vector<at::Tensor>& full,
                          const at::Tensor& block, kernels::ReduceOp op,
                          std::chrono::milliseconds timeout) {
    const bool reduce_scatter = kind == plan::GatherScatterKind::kReduceScatter;
    const bool list = full.size() != 1;
    // A reduce-scatter reduces elements; an all-gather moves bytes.
    const kernels::DType dtype =
        reduce_scatter ? *native_dtype(block.scalar_type()) : kernels::DType::kUInt8;
    const int64_t unit = reduce_scatter ? 1 : block.element_size();
    const int64_t block_units = block.numel() * unit;
    const int64_t slot_units =
        g_.config().cuda_slot_bytes / (reduce_scatter ? block.element_size() : 1);
    const plan::GatherScatterPlan plan(kind, g_.size(), block_units, slot_units);

    transport::OpDescriptor d =
        g_.next_descriptor(reduce_scatter ? Collective::kReduceScatter : Collective::kAllGather);
    d.reduce_op = reduce_scatter ? static_cast<int32_t>(op) : 0;
    d.dtype = static_cast<int32_t>(dtype);
    d.num_tensors = 1;
    d.total_elems = block_units;
    std::vector<at::Tensor> shapes = full;
    shapes.push_back(block);
    d.counts_hash = counts_hash(shapes);
    d.device = 1;
    transport::CudaPlanKey key;
    key.collective = reduce_scatter ? transport::CudaPlanKey::kReduceScatter
                                    : transport::CudaPlanKey::kAllGather;
    key.total = block_units;
    key.window_elems = slot_units;
    key.pack_bounds = {block_units};
    const char* what = reduce_scatter ? "reduce_scatter" : "all_gather";
    const auto deadline = g_.deadline_for(timeout);
    std::optional<transport::CudaExecutor::Program> program;
    at::Tensor full_c;
    at::Tensor block_c;
    before_host_barrier(d, what, deadline, [&] {
      program = executor_->gather_scatter_program(key, plan);
      if (!list) {
        full_c = full[0].contiguous();
      } else if (reduce_scatter) {
        std::vector<at::Tensor> flat;
        for (const at::Tensor& t : full) flat.push_back(t.reshape({-1}));
        full_c = at::cat(flat);
      } else {
        full_c = at::empty({static_cast<int64_t>(full.size()) * block.numel()}, block.options());
      }
      block_c = block.contiguous();
      // Peers read what this rank lends while it writes, window by window: a lent tensor that
      // shares memory with the written one other than at this rank's own block is lent as a
      // copy (all-gather), or the result goes elsewhere first (reduce-scatter).
      if (!list && overlapping_elsewhere(full, {block_c}, g_.rank())[0]) {
        block_c = reduce_scatter ? at::empty_like(block_c) : block_c.clone();
      }
      executor_->prepare({&*program}, stream_->stream());
    });
    // As for the allreduce: every rank runs this very collective before any GPU waits.
    if (g_.config().cuda_host_check) {
      g_.channel()->open_collective(g_.make_context(d, what, deadline));
    }
    if (plan.num_windows() == 0) return;

    const at::Tensor& input = reduce_scatter ? full_c : block_c;
    const at::Tensor& output = reduce_scatter ? block_c : full_c;
    executor_->launch(*program, transport::call_hash(d), input.data_ptr(), output.data_ptr(), dtype,
                      op, g_.timeout_for(timeout), stream_->stream());
    if (reduce_scatter) {
      if (!output.is_same(block)) block.copy_(output);
    } else if (!list) {
      if (!output.is_same(full[0])) full[0].copy_(output);
    } else {
      const int64_t n = block.numel();
      for (size_t r = 0; r < full.size(); ++r) {
        full[r].copy_(output.narrow(0, static_cast<int64_t>(r) * n, n).view(full[r].sizes()));
      }
    }
  }

  // On the op's thread, with our stream current.
  void run_allreduce(const std::vector<at::Tensor>& tensors, kernels::ReduceOp op,
                     const plan::Selection& sel, std::chrono::milliseconds timeout) {
    const auto deadline = g_.deadline_for(timeout);
    for (DtypeAllreduce& call : prepare_allreduce(g_, tensors, op, sel)) {
      const int64_t total = call.total();
      std::vector<at::Tensor> members;
      for (size_t idx : call.group.tensor_indices) members.push_back(tensors[idx]);
      const bool in_place = members.size() == 1 && members[0].is_contiguous();
      const int64_t window_elems =
          g_.config().cuda_slot_bytes / static_cast<int64_t>(call.group.elem_size);
      const plan::CollectivePlan cp = planner_->plan(g_, sel, call, window_elems);

      g_.number(call.descriptor);
      call.descriptor.device = 1;
      const bool host_check = g_.config().cuda_host_check;
      // Both programs the call may run, ready before the host barrier (which
      // of them runs is known only after it): past it, a failure here would
      // leave the peers waiting in the GPU barrier.
      std::optional<transport::CudaExecutor::Program> staged;
      std::optional<transport::CudaExecutor::Program> in_heap;
      at::Tensor flat;
      transport::HeapLocation where;
      before_host_barrier(call.descriptor, "allreduce", deadline, [&] {
        staged = executor_->allreduce_program(
            allreduce_key(sel, call, g_.config().reduce_to_rank, window_elems), cp);
        in_heap = executor_->in_place_program(total, call.dtype);
        // One contiguous buffer per dtype: the tensor itself when it is one
        // contiguous tensor, else a packed copy (copied back at the end).
        if (in_place) {
          flat = members[0];
        } else {
          std::vector<at::Tensor> pieces;
          for (const at::Tensor& t : members) pieces.push_back(t.reshape({-1}));
          flat = at::cat(pieces);
        }
        // One contiguous tensor in the heap: every rank reads its peers'
        // copies in place if all lie at one place, which the host barrier
        // compares (there is no heap without it: open_heap).
        if (sel.in_place_shared && in_place && heap_) where = heap_->locate(flat);
        // A peer's arena this rank cannot open (yet): say the tensor is
        // elsewhere, so that every rank stages.
        if (where.arena >= 0 && !heap_->open_peers(where)) where = {};
        std::vector<const transport::CudaExecutor::Program*> programs;
        if (total > 0) programs.push_back(&*staged);
        if (total > 0 && where.arena >= 0) programs.push_back(&*in_heap);
        executor_->prepare(programs, stream_->stream());
      });
      call.descriptor.heap_arena = where.arena;
      call.descriptor.heap_offset = where.offset;

      // The host barrier checks that every rank runs this very collective
      // before any GPU waits for a peer, and names a missing rank on timeout.
      // Without it (cuda_host_check off) the kernels' GPU barrier compares the calls' hashes.
      if (host_check) {
        g_.channel()->open_collective(g_.make_context(call.descriptor, "allreduce", deadline));
      }
      if (total == 0) continue;
      const uint32_t hash = transport::call_hash(call.descriptor);
      if (where.arena >= 0 &&
          transport::same_heap_place_on_every_rank(*g_.channel(), call.descriptor)) {
        executor_->launch(*in_heap, hash, flat.data_ptr(), flat.data_ptr(), call.dtype, op,
                          g_.timeout_for(timeout), stream_->stream(), heap_->copies(where));
        ++in_place_allreduces_;
        continue;
      }
      if (where.arena >= 0) {
        g_.log_once("cuda-heap-places-differ",
                    "a tensor of the CUDA heap is not at the same place on every rank (ranks "
                    "allocated in different orders): its allreduce stages instead");
      }
      executor_->launch(*staged, hash, flat.data_ptr(), flat.data_ptr(), call.dtype, op,
                        g_.timeout_for(timeout), stream_->stream());
      if (in_place) continue;
      int64_t offset = 0;
      for (const at::Tensor& t : members) {
        const int64_t n = t.numel();
        // copy_ handles non-contiguous destinations.
        t.copy_(flat.narrow(0, offset, n).view(t.sizes()));
        offset += n;
      }
    }
  }

  GroupContext& g_;
  mutable std::mutex mutex_;
  std::optional<CudaGroupInfo> info_;
  std::string rendezvous_failure_;  // why the first rendezvous failed; empty: it did not
  std::optional<c10::cuda::CUDAStream> stream_;
  // The balanced plan's trees follow the GPUs' NVLinks (made once they are known).
  std::optional<AllreducePlanner> planner_;
  std::unique_ptr<transport::CudaIpcChannel> channel_;
  std::unique_ptr<transport::CudaExecutor> executor_;
  // Stops executor_'s kernels once a peer's process exits; gone before executor_.
  std::unique_ptr<transport::PeerWatch> watch_;
  std::unique_ptr<CudaHeapTensors> heap_;  // null without the transport or shared_buckets
  // executor_'s device_error() for the Works, which may outlive it.
  std::shared_ptr<DeviceErrorProbe> device_error_ = std::make_shared<DeviceErrorProbe>();
  std::atomic<int64_t> in_place_allreduces_{0};
};

std::unique_ptr<CudaCollectives> make_cuda_collectives(GroupContext& group) {
  if (c10::cuda::device_count() == 0) return nullptr;
  return std::make_unique<CudaCollectivesImpl>(group);
}

}  // namespace xdev::backend
