// XdevBackend: the c10d Backend behind backend="xdev".
//
// Thin by design: it validates each call, selects the path (plan::
// select_allreduce) and routes it to the part that runs it:
//   - CpuCollectives: allreduce, broadcast and barrier of CPU tensors on one
//     host, over the group's shared memory;
//   - CpuGatherScatter: all-gather and reduce-scatter of CPU tensors on one
//     host, in their tensor, coalesced and list forms;
//   - CudaCollectives: allreduce of CUDA tensors on one host whose GPUs reach
//     each other (built only with CUDA);
//   - SharedBuffers: torch_xdev.shared_empty, whose tensors reduce in place;
//   - TwoLevelAllreduce, TwoLevelGatherScatter, TwoLevelBroadcast: allreduce,
//     all-gather, reduce-scatter and broadcast of CPU tensors across hosts,
//     shared memory inside each host and an engine across;
//   - FallbackEngines: Gloo, and NCCL for CUDA tensors, for everything else.
// What they share (rank, store, options, the channel, the op queue) is the
// GroupContext. The all-gather and reduce-scatter entry points are in
// xdev_backend_gather_scatter.cc, those of the collectives always delegated in
// xdev_backend_delegated.cc.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../plan/selection.h"
#include "backend_config.h"
#include "call_gate.h"
#include "cpu_collectives.h"
#include "cpu_gather_scatter.h"
#include "cuda_collectives.h"
#include "fallback_engines.h"
#include "group_context.h"
#include "shared_buffers.h"
#include "two_level_allreduce.h"
#include "two_level_broadcast.h"
#include "two_level_gather_scatter.h"

namespace xdev::backend {

// The c10d options of an xdev group (Backend.options): what c10d's
// split_group copies for a child, the group's timeout in it. xdev's own
// settings go to the child with the parent's torch_xdev.Options (see split).
struct XdevBackendOptions : c10d::Backend::Options {
  explicit XdevBackendOptions(std::chrono::milliseconds timeout) : Options("xdev", timeout) {}
};

class XdevBackend : public c10d::Backend {
 public:
  // Makes an engine (Gloo) for `size` ranks, this one being `rank`, on the
  // keys under `prefix` of the group's store.
  using EngineFactory = std::function<c10::intrusive_ptr<c10d::Backend>(const std::string& prefix,
                                                                        int rank, int size)>;

  // fallback runs CPU tensors (Gloo); cuda_fallback, when given, runs CUDA
  // tensors (NCCL) unless ranks share a GPU, where Gloo takes them too.
  // cross_host_engine, when given, makes the engine of the two-level plan's
  // part across hosts; it is called here (once) where the plan can run.
  XdevBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              BackendConfig config, c10::intrusive_ptr<c10d::Backend> fallback,
              c10::intrusive_ptr<c10d::Backend> cuda_fallback = {},
              const EngineFactory& cross_host_engine = {});
  ~XdevBackend() override;

  const std::string getBackendName() const override { return "xdev"; }

  // Called by destroy_process_group: finishes queued work, unmaps the shared
  // memory and shuts the fallback down. Idempotent (c10d calls it once per
  // device type, and one XdevBackend serves both).
  void shutdown() override;

  // Sequence numbers: c10d's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL)
  // stamps each collective with this number and checks that every rank sent the
  // same. As in Gloo, a group starts at 0 on every rank, so there is nothing to
  // agree on at creation; the number is how many collectives this rank has
  // called on the group, counted on the caller's thread as each call enters.
  // Send and recv do not count: only two ranks call them.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return collectives_called_.load(); }

  // c10d's split_group, which DeviceMesh calls where init_process_group was
  // given a device_id: a child group of `ranks` (this group's ranks, sorted),
  // or null on a rank outside them. The splitter makes it (torch_xdev's
  // creator, with this group's torch_xdev.Options) on the store it is given
  // (this group's, under a prefix of the split): this rank's place among
  // `ranks`, their count, the split's timeout and group name, and the
  // child's members as global ranks. c10d may ask once per device type, and
  // one XdevBackend serves both: a second ask of the same split (the same
  // store) gets the child the first made.
  using Splitter = std::function<c10::intrusive_ptr<c10d::Backend>(
      const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
      std::chrono::milliseconds timeout, const std::string& group_name,
      const std::vector<int64_t>& global_ranks)>;
  void set_splitter(Splitter splitter) { splitter_ = std::move(splitter); }
  bool supportsSplitting() const override { return splitter_ != nullptr; }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
      const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // dist.monitored_barrier: Gloo's, which names the ranks that did not arrive.
  // torch 2.14 asks the group's CPU backend for it; torch 2.13 refuses every
  // backend but Gloo by name before it gets here.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  // All-gather and reduce-scatter (every form) of CPU tensors run natively on
  // one host (CpuGatherScatter); the rest go to the fallback engines.
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // c10d's communication-memory allocator, which DDP uses for its gradient
  // buckets under DDP_DISABLE_COMM_MEM=0 (and FSDP2 for its buffers when asked):
  // tensors from the group's symmetric heap (CPU) or CUDA heap (the group's
  // GPU, once a CUDA collective has opened the transport: DDP's own checks
  // and broadcast at construction do), so that their allreduce runs in place.
  bool supportsTensorAlloc(c10::DeviceIndex device) override;
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;
  // torch_xdev.prepare_cuda_graph_capture: opens, outside any capture, what
  // the group's first CUDA call would open (xdev's CUDA transport and NCCL's
  // communicator on `device`), so that calls captured later find them.
  // Collective. Throws where captured calls could not run (ranks sharing a
  // GPU, which NCCL refuses; no NCCL).
  void prepare_cuda_graph_capture(int device);
  bool heap_available() const { return shared_.heap_available(); }
  const std::string& heap_note() const { return shared_.heap_note(); }
  std::shared_ptr<const transport::SymmetricHeap> heap() const { return shared_.heap(); }

  // torch_xdev.shared_empty (SharedBuffers::empty).
  at::Tensor shared_empty(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
    const CallGate::Entry entry = gate_.enter();
    return shared_.empty(sizes, dtype);
  }
  int64_t live_shared_buffers() const { return shared_.live(); }

  // Introspection for torch_xdev.describe(), which holds this while it reads
  // the parts below (throws once the group is destroyed).
  [[nodiscard]] CallGate::Entry enter_to_describe() const { return gate_.enter(); }
  const BackendConfig& config() const { return group_.config(); }
  int num_hosts() const { return group_.num_hosts(); }
  const std::string& options_note() const { return group_.options_note(); }
  int local_world_size() const { return group_.local_world_size(); }
  int host_cores() const { return group_.host_cores(); }
  bool worker_has_own_core() const { return group_.worker_has_own_core(); }
  bool has_shared_memory() const { return cpu_ != nullptr; }
  bool single_copy_available() const { return cpu_ && cpu_->single_copy_available(); }
  std::string single_copy_note() const;
  std::string shm_name() const;
  const std::string& fallback_name() const { return fallbacks_.cpu_name(); }
  // What the last allreduce ran and why ("" before the first).
  std::pair<std::string, std::string> last_selection() const;
  // How describe() shows a selection: its path (the algorithm; "two_level"
  // across hosts, the reason naming the plan inside each host) and why.
  static std::pair<std::string, std::string> shown_selection(const plan::Selection& sel);
  // The last all-gather or reduce-scatter: its name, path and why (empty before the first).
  std::vector<std::string> last_gather_scatter() const;
  // The last broadcast: its path ("native", "two_level" or "fallback") and why.
  std::pair<std::string, std::string> last_broadcast() const;
  // What select_allreduce weighs about this group for an allreduce of this
  // many bytes (the call's op, tensors and placement are the caller's to add),
  // and the selection an allreduce of supported op and dtype would get.
  plan::SelectionInput selection_input(int64_t payload_bytes, bool cuda) const;
  plan::Selection selection_for(int64_t payload_bytes, bool cuda) const {
    return plan::select_allreduce(selection_input(payload_bytes, cuda));
  }
  // Whether allreduces across hosts can run the two-level plan, and why not.
  bool two_level_available() const { return two_level_ != nullptr; }
  const std::string& two_level_note() const { return two_level_note_; }
  // The model auto chooses CPU plans by: the group's host's, or across hosts
  // each host's (two levels); null without a native CPU path.
  const plan::MachineModel* cpu_model() const {
    return cpu_ ? &cpu_->model() : two_level_ ? &two_level_->host_model() : nullptr;
  }
  // The network between hosts the two-level plans are chosen by; null on one host.
  const plan::NetworkParams* network_model() const {
    return two_level_ ? &two_level_->network() : nullptr;
  }
  // The CUDA side: null in builds without CUDA; info() null before the first
  // CUDA collective.
  CudaCollectives* cuda() const { return cuda_.get(); }
  // The engine that runs delegated collectives on CUDA tensors ("" before the
  // first CUDA collective decides it).
  std::string cuda_fallback_name() const { return fallbacks_.cuda_name(); }

 private:
  // shutdown(), and the destructor's (`last_reference`), which may run on the
  // group's worker at the end of a task that held the last reference.
  void shut_down(bool last_reference);
  // A CUDA call on a stream that is capturing a CUDA graph goes to the engine
  // (CudaCollectives::stream_refusal): turns transport_available off, with why.
  void refuse_during_capture(int device, bool& transport_available, std::string& note) const {
    if (!transport_available || cuda_ == nullptr) return;
    std::string why = cuda_->stream_refusal(device);
    if (why.empty()) return;
    transport_available = false;
    note = std::move(why);
  }
  // This rank's own checks of a call its peers run natively: a refusal still
  // meets the peers where they check each call (on one host
  // GroupContext::check_with_peers; across hosts, in two levels,
  // CrossHostCheck::check_with_peers), so that they fail at this call too;
  // without that check (cuda_host_check off) it takes its sequence number.
  void check_native_call(Collective collective, const char* name, bool cuda,
                         std::chrono::milliseconds timeout, const std::function<void()>& check);
  // `refuse` (this rank's refusal of a call's arguments, or nothing) as a
  // check of a native call: a rank that refuses a call its peers run, or also
  // refuse, meets them as a refused call, so that every rank fails this call
  // and the calls after it stay paired. Alone, it took no turn, and its next
  // call paired with the one its peers were in: both gave wrong sums.
  void refuse_with_peers(Collective collective, const char* name,
                         const std::vector<at::Tensor>& tensors, std::chrono::milliseconds timeout,
                         const std::function<void()>& refuse) {
    check_native_call(collective, name, !tensors.empty() && tensors[0].is_cuda(), timeout, refuse);
  }
  // A reduce-scatter handed to the engine, refused with the peers where
  // `also` (this rank's checks of its arguments) throws or no engine reduces
  // a tensor's dtype (FallbackEngines::refuse_what_gloo_cannot_reduce).
  void refuse_engine_reduce_scatter(const char* name, const std::vector<at::Tensor>& outputs,
                                    std::chrono::milliseconds timeout,
                                    const std::function<void()>& also = {}) {
    refuse_with_peers(Collective::kReduceScatter, name, outputs, timeout, [&] {
      if (also) also();
      fallbacks_.refuse_what_gloo_cannot_reduce(outputs, name);
    });
  }
  // Whether a ReduceOp.PREMUL_SUM on these tensors is multiplied here and then
  // run as a SUM: wherever their engine lacks it (Gloo), so that the native
  // paths and Gloo run it alike. NCCL runs its own.
  bool premultiplies_here(const c10d::ReduceOp& op, const std::vector<at::Tensor>& tensors);
  // Raises where premultiply_ would refuse these tensors (not floating point, float8), on this
  // rank and its peers alike: refused here alone, the call would leave the peers in its SUM,
  // which would pair with this rank's next call and give both wrong sums. Every rank votes
  // (a one-element MAX) before the SUM: one small collective per PREMUL_SUM that xdev scales.
  void refuse_premul_with_peers(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                                std::chrono::milliseconds timeout);
  c10::intrusive_ptr<c10d::Work> dispatch_allreduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::AllreduceOptions& opts,
                                                    bool coalesced);
  void log_choice(const plan::Selection& sel, bool cuda);
  // How a reduce-scatter (op given) or all-gather (op null) of these tensors
  // (inputs and outputs; full_tensors of them hold every rank's block, blocks
  // are this rank's own: a reduce-scatter's outputs, an all-gather's inputs)
  // runs, as plan::select_gather_scatter says; logs the choice once per reason
  // (XDEV_DEBUG=INFO) and counts a native call. uneven_list_sizes: a list form
  // whose lists hold sizes unlike this rank's block; one_list: a list form of
  // one list (full_tensors: one tensor per rank).
  plan::GatherScatterSelection select_gather_scatter(
      const char* name, const std::vector<at::Tensor>& tensors,
      const std::vector<at::Tensor>& full_tensors, const std::vector<at::Tensor>& blocks,
      const c10d::ReduceOp* op, bool uneven_list_sizes = false, bool one_list = false);
  // The native CUDA reduce-scatter (op given; full in, block out) or all-gather
  // (op null; block in, full out): `full` is one tensor, or one list entry per
  // rank of the block's size; `blocks` must hold one tensor (the caller's
  // other side, checked as the CPU path checks its arguments). Async by
  // nature, as every CUDA collective.
  c10::intrusive_ptr<c10d::Work> cuda_gather_scatter(plan::GatherScatterKind kind,
                                                     std::vector<at::Tensor> full,
                                                     const std::vector<at::Tensor>& blocks,
                                                     const c10d::ReduceOp* op, c10d::OpType type,
                                                     std::chrono::milliseconds timeout);
  // The engines, for a collective they are about to run; counts the call
  // (getSequenceNumberForGroup), as the native paths count theirs.
  FallbackEngines& delegated_call() {
    ++collectives_called_;
    return fallbacks_;
  }
  // The engine of a delegated collective on these tensors; counts the call.
  c10d::Backend* delegate(const std::vector<at::Tensor>& tensors) {
    return delegated_call().for_tensors(tensors);
  }
  c10d::Backend* delegate(const at::Tensor& tensor) { return delegated_call().for_tensor(tensor); }

  GroupContext group_;  // first member: everything below uses it
  // Every entry point enters it, describe() too: shut_down destroys the parts
  // below only once the calls on other threads that use them have left.
  mutable CallGate gate_;
  std::unique_ptr<CpuCollectives> cpu_;  // null without shared memory
  std::unique_ptr<CpuGatherScatter> gather_scatter_;
  std::unique_ptr<CudaCollectives> cuda_;  // null without CUDA
  // Null unless ranks span hosts evenly; they share one engine.
  std::unique_ptr<TwoLevelAllreduce> two_level_;
  std::unique_ptr<TwoLevelGatherScatter> two_level_gather_scatter_;
  std::unique_ptr<TwoLevelBroadcast> two_level_broadcast_;
  std::string two_level_note_;  // why they are null
  SharedBuffers shared_;
  FallbackEngines fallbacks_;

  mutable plan::ModelChoiceCache model_choices_;                // the CPU model's, per size class
  mutable plan::ModelChoiceCache cuda_model_choices_;           // the GPUs' model's, likewise
  plan::GatherScatterChoiceCache gather_scatter_choices_;       // the same for gather/scatter
  plan::GatherScatterChoiceCache cuda_gather_scatter_choices_;  // and on the GPUs' model

  std::atomic<uint64_t> collectives_called_{0};  // getSequenceNumberForGroup

  Splitter splitter_;  // none: this group cannot be split
  std::mutex split_mutex_;
  int64_t splits_made_ = 0;                           // the same count on every rank
  c10::intrusive_ptr<c10d::Store> last_split_store_;  // names the split under way
  std::optional<c10::weak_intrusive_ptr<c10d::Backend>> last_split_;  // its child here

  mutable std::mutex selection_mutex_;
  std::pair<std::string, std::string> last_selection_;
  std::vector<std::string> last_gather_scatter_;
  std::pair<std::string, std::string> last_broadcast_;
};

}  // namespace xdev::backend
