// XdevBackend: the c10d Backend behind backend="xdev".
//
// Thin by design: it turns c10d calls into plans (csrc/plan) and runs them on
// the shared-memory transport (csrc/transport) from one worker thread, or
// hands them to the fallback engine (Gloo, built in Python on a PrefixStore of
// our store). Native: allreduce, allreduce_coalesced, broadcast and barrier
// on CPU tensors of one host, and allreduce on CUDA tensors of one host whose
// GPUs reach each other (cuda_collectives.h); everything else is delegated,
// CUDA tensors to NCCL where it can run them.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/balanced_plan.h"
#include "../plan/cost_model.h"
#include "../plan/schedule.h"
#include "../plan/selection.h"
#include "../transport/shared_buffer.h"
#include "../transport/shm_executor.h"
#include "../transport/single_copy_executor.h"
#include "backend_config.h"
#include "cuda_collectives.h"
#include "tensor_helpers.h"
#include "work_queue.h"
#include "xdev_work.h"

namespace xdev::backend {

class XdevBackend : public c10d::Backend {
 public:
  // fallback runs CPU tensors (Gloo); cuda_fallback, when given, runs CUDA
  // tensors (NCCL) unless ranks share a GPU, where Gloo takes them too.
  XdevBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              BackendConfig config, c10::intrusive_ptr<c10d::Backend> fallback,
              c10::intrusive_ptr<c10d::Backend> cuda_fallback = {});
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
  // called on the group. Send and recv do not count: only two ranks call them.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return collectives_called_.load(); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Delegated to the fallback engine.
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

  // torch_xdev.shared_empty: a CPU tensor in memory every rank of the group
  // maps, whose allreduce runs in place (transport/shared_buffer.h).
  // Collective: every rank calls it with the same sizes and dtype, in the same
  // order. Throws std::invalid_argument (ValueError) without shared memory or
  // on a size mismatch. In a world of one: an ordinary zero tensor.
  at::Tensor shared_empty(const std::vector<int64_t>& sizes, at::ScalarType dtype);
  int64_t live_shared_buffers() const;

  // Introspection for torch_xdev.describe().
  const BackendConfig& config() const { return config_; }
  int num_hosts() const { return num_hosts_; }
  int local_world_size() const { return local_world_size_; }
  bool has_shared_memory() const { return executor_ != nullptr; }
  bool single_copy_available() const { return single_copy_ != nullptr; }
  const std::string& single_copy_note() const { return single_copy_note_; }
  std::string shm_name() const;
  const std::string& fallback_name() const { return fallback_name_; }
  // What the last allreduce ran and why ("" before the first).
  std::pair<std::string, std::string> last_selection() const;
  // The algorithm and reason an allreduce of this many bytes would get.
  plan::Selection selection_for(int64_t payload_bytes, bool cuda) const;
  // The model auto chooses CPU plans by; null without a native CPU path.
  const plan::MachineModel* cpu_model() const { return cpu_model_.get(); }
  // The CUDA side: null in builds without CUDA; info() null before the first
  // CUDA collective.
  CudaCollectives* cuda() const { return cuda_.get(); }
  // The engine that runs delegated collectives on CUDA tensors ("" before the
  // first CUDA collective decides it).
  std::string cuda_fallback_name() const;

 private:
  friend class CudaCollectivesImpl;  // the CUDA glue runs collectives through enqueue()

  enum class Collective : int32_t { kAllreduce = 1, kBroadcast = 2, kBarrier = 3 };

  void rendezvous_hosts(c10d::Store& store);
  void open_shared_memory(c10d::Store& store);
  void log_once(const std::string& key, const std::string& message);

  // Where a tensor lies in a live shared buffer of this group.
  struct SharedPlacement {
    std::shared_ptr<transport::SharedBuffer> buffer;  // null: not in one
    int64_t offset = 0;
  };
  SharedPlacement find_shared_buffer(const at::Tensor& t) const;

  // Native allreduce of tensors (may mix dtypes) on the worker thread; in
  // place when shared holds the one tensor's buffer.
  c10::intrusive_ptr<c10d::Work> native_allreduce(std::vector<at::Tensor> tensors,
                                                  kernels::ReduceOp op, plan::Selection sel,
                                                  std::chrono::milliseconds timeout, bool async_op,
                                                  SharedPlacement shared);
  // Runs an allreduce through the fallback; AVG is done as SUM then a divide
  // because Gloo has no AVG.
  c10::intrusive_ptr<c10d::Work> fallback_allreduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::AllreduceOptions& opts,
                                                    bool coalesced);
  c10::intrusive_ptr<c10d::Work> dispatch_allreduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::AllreduceOptions& opts,
                                                    bool coalesced);

  // Runs fn after every earlier collective of this group and completes the
  // returned Work with its outcome: on the worker thread, or inline when the
  // caller waits anyway (async_op false) and nothing is queued. Errors become
  // DistBackendError; a peer failure poisons the group.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title,
                                         std::vector<at::Tensor> outputs, std::function<void()> fn,
                                         bool async_op);
  // The same for a Work the caller made (the CUDA glue's, which knows streams).
  void enqueue_work(const c10::intrusive_ptr<XdevWork>& work, std::function<void()> fn,
                    bool async_op);

  transport::Clock::time_point deadline_for(std::chrono::milliseconds timeout) const;
  // The packing of an allreduce run by sel: the user's if they chose one,
  // else sel's pack count.
  plan::PackingOptions packing_for(const plan::Selection& sel) const;
  // The descriptor of one dtype group's allreduce; takes the next sequence
  // number (op thread only).
  transport::OpDescriptor allreduce_descriptor(kernels::ReduceOp op, int32_t dtype,
                                               const plan::Selection& sel, int64_t num_packs,
                                               int64_t num_tensors, int64_t total, uint64_t hash);
  std::string describe_op(const transport::OpDescriptor& d) const;
  transport::OpContext make_context(const transport::OpDescriptor& desc, const char* name,
                                    transport::Clock::time_point deadline) const;

  BackendConfig config_;
  plan::Algorithm requested_ = plan::Algorithm::kAuto;
  plan::PackingOptions packing_;
  c10d::Backend* fallback() const;  // throws once the group is shut down
  // The engine for a delegated collective on these tensors: NCCL for CUDA
  // tensors where it can run them, else Gloo.
  c10d::Backend* fallback_for(const std::vector<at::Tensor>& tensors);
  c10d::Backend* fallback_for(const at::Tensor& tensor);
  // The same for send/recv, which only two ranks call: no group rendezvous, so
  // before the first CUDA collective it assumes one GPU per rank.
  c10d::Backend* p2p_engine(const std::vector<at::Tensor>& tensors);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> cuda_fallback_;
  std::unique_ptr<CudaCollectives> cuda_;  // destroyed in shutdown(), before the queue

  c10::intrusive_ptr<c10d::Backend> fallback_;
  std::string fallback_name_;
  int num_hosts_ = 1;
  int local_world_size_ = 1;

  // Only touched by the collective-running thread (worker or inline caller).
  std::unique_ptr<transport::ShmChannel> channel_;
  std::unique_ptr<transport::ShmExecutor> executor_;
  std::unique_ptr<transport::SingleCopyExecutor> single_copy_;
  std::unique_ptr<transport::SharedBufferExecutor> shared_executor_;
  std::string single_copy_note_;  // why single-copy is on or off
  uint64_t next_seq_ = 0;         // worker thread only
  std::string poisoned_;          // worker thread only
  // Collective calls so far (getSequenceNumberForGroup), counted on the
  // caller's thread at each collective's entry.
  std::atomic<uint64_t> collectives_called_{0};

  // Model choices are cached per power-of-two payload size; balanced-plan
  // trees per pack count.
  std::unique_ptr<plan::MachineModel> cpu_model_;
  mutable std::mutex model_mutex_;
  mutable std::map<int64_t, plan::Selection> model_choices_;
  std::map<int64_t, std::vector<plan::PackTree>> pack_trees_;
  const std::vector<plan::PackTree>& pack_trees(int64_t num_packs);

  // Buffers from shared_empty; a buffer lives as long as its tensors do.
  mutable std::mutex shared_mutex_;
  int64_t next_shared_id_ = 0;
  std::vector<std::weak_ptr<transport::SharedBuffer>> shared_buffers_;

  mutable std::mutex log_mutex_;
  std::set<std::string> logged_;
  std::pair<std::string, std::string> last_selection_;

  std::mutex queue_mutex_;            // guards queue_ against shutdown()
  std::unique_ptr<WorkQueue> queue_;  // last member: joined first on destruction
};

}  // namespace xdev::backend
