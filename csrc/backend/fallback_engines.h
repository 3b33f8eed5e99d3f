// The engines xdev hands collectives to when it has no native path: Gloo
// (built in Python on a PrefixStore of the group's store) for CPU tensors, and
// PyTorch's NCCL for CUDA tensors where it can run them: NCCL refuses two
// ranks on one GPU, so then Gloo takes CUDA tensors too.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cuda_collectives.h"
#include "group_context.h"

namespace xdev::backend {

class FallbackEngines {
 public:
  // cuda may be null (no CUDA in this build, or no NCCL): CUDA tensors go to Gloo then.
  FallbackEngines(c10::intrusive_ptr<c10d::Backend> gloo, c10::intrusive_ptr<c10d::Backend> nccl,
                  CudaCollectives* cuda);

  // The Gloo engine (CPU tensors' and, where ranks share a GPU, CUDA
  // tensors'). Throws once the group is shut down.
  c10d::Backend* gloo() const;
  // The engine for a delegated collective on these tensors. Collective on the
  // first CUDA tensor (the CUDA side learns whether ranks share a GPU).
  c10d::Backend* for_tensors(const std::vector<at::Tensor>& tensors);
  c10d::Backend* for_tensor(const at::Tensor& tensor);
  // Opens the engine of CUDA tensors on `device` for calls captured in CUDA
  // graphs: NCCL makes its communicator at its first collective, which cannot
  // happen inside a capture. Collective: a one-element allreduce on NCCL.
  // Throws where CUDA tensors go to Gloo (ranks sharing a GPU), which a
  // capture refuses.
  void open_cuda_engine(int device);
  // The same for send/recv, which only two ranks call: no group rendezvous, so
  // before the first CUDA collective it assumes one GPU per rank.
  c10d::Backend* for_point_to_point(const std::vector<at::Tensor>& tensors);

  const std::string& cpu_name() const { return cpu_name_; }
  // The engine of delegated CUDA collectives ("" until the first CUDA collective decides).
  std::string cuda_name() const;
  // Whether the engine runs every ReduceOp.AVG itself: NCCL does. Gloo's,
  // where torch has one, refuses integers and adds float16 in float16 (a sum
  // whose mean fits can overflow): xdev runs those as a SUM, then a divide.
  bool has_native_avg(const c10d::Backend& engine) const { return &engine == nccl_.get(); }
  // Throws TypeError where these tensors' engine is Gloo and a dtype is one
  // it cannot reduce (int16, uint16/32/64, float8...): Gloo's own error says
  // only "Invalid scalar type". allreduce, reduce and reduce_scatter below do
  // not check it: their caller does, with its peers (a refusal alone would
  // pair its peers' call with this rank's next one).
  void refuse_what_gloo_cannot_reduce(const std::vector<at::Tensor>& tensors,
                                      const char* collective);
  // Whether it runs ReduceOp.PREMUL_SUM itself: NCCL does, Gloo does not.
  bool has_premul_sum(const c10d::Backend& engine) const { return &engine == nccl_.get(); }

  // An allreduce through the engine for these tensors. With
  // avg_as_sum_then_divide (an AVG the engine lacks) it runs SUM, then a
  // divide, completed on the group's queue for CPU tensors so that the
  // returned Work covers the division; float16 and bfloat16 add in float32.
  c10::intrusive_ptr<c10d::Work> allreduce(GroupContext& group, std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts, bool coalesced,
                                           bool avg_as_sum_then_divide);

  // An all-gather (list form) through the engine for these tensors. Gloo
  // gathers entries of one size only (NCCL any): where the entries' sizes
  // differ, each rank's input travels padded to the largest entry, behind a
  // header that lets every rank check every rank's list
  // (pad_uneven_all_gather), and the returned Work covers the check and
  // copying the entries out of the padded ones.
  c10::intrusive_ptr<c10d::Work> allgather(GroupContext& group,
                                           std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts);

  // all_gather_coalesced through the engine: every tensor as bytes (Gloo
  // packs the list into one buffer of one dtype, and lacks some dtypes), the
  // outputs contiguous. The caller has checked the shapes.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(GroupContext& group,
                                                     std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts);

  // A reduce-scatter through the engine for `outputs`: `call` runs it with
  // the options and the outputs it is given (contiguous copies of strided
  // ones, which Gloo would write as if they were contiguous; the returned
  // Work covers copying them back). An AVG on Gloo of integers runs as SUM,
  // then a truncating divide (the native path's result), like the allreduce;
  // of float16 or bfloat16, as a float32 SUM and divide: `call` is then told
  // to give the engine its inputs in float32 (in_float_if_reduced).
  using ReduceScatterCall = std::function<c10::intrusive_ptr<c10d::Work>(
      c10d::Backend&, const c10d::ReduceScatterOptions&, std::vector<at::Tensor>& outputs,
      bool inputs_in_float)>;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(GroupContext& group,
                                                const std::vector<at::Tensor>& outputs,
                                                const c10d::ReduceScatterOptions& opts,
                                                c10d::OpType type, const ReduceScatterCall& call);

  // The collectives that move data without reducing it, through the engine
  // for these tensors. Strided tensors go as contiguous copies (Gloo's scatter
  // wrote a strided output as if it were contiguous; the returned Work covers
  // copying outputs back), and a dtype the engines lack (int16, uint16/32/64,
  // float8, complex...) goes as bytes with its rows kept, so an all-to-all's
  // split sizes (in rows) still hold. Gloo's own error was "Invalid scalar type".
  c10::intrusive_ptr<c10d::Work> broadcast(GroupContext& group, std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts);
  c10::intrusive_ptr<c10d::Work> gather(GroupContext& group,
                                        std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> scatter(GroupContext& group, std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts);
  c10::intrusive_ptr<c10d::Work> alltoall_base(GroupContext& group, at::Tensor& output,
                                               at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts);
  c10::intrusive_ptr<c10d::Work> alltoall(GroupContext& group, std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts);

  // A reduce to opts.rootRank through the engine for these tensors (on
  // contiguous copies where they are not). An AVG on Gloo runs as SUM, then a
  // divide of the root's result, like the reduce-scatter.
  c10::intrusive_ptr<c10d::Work> reduce(GroupContext& group, std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts);

  // `call` (an engine's collective over these tensors, which it writes) on
  // contiguous tensors: Gloo's allreduce, reduce, broadcast and reduce-scatter
  // read and write a non-contiguous tensor as if it were contiguous, corrupting
  // the elements around it, and NCCL refuses one. Non-contiguous tensors, and
  // tensors that share bytes with another of the list, are replaced by
  // contiguous copies (contiguous()) for the engine, and the results are
  // copied back once it is done (the returned Work covers the copy). With
  // `avg_divisor` > 0 (an AVG run as the engine's SUM) each result is divided
  // by it first, once: memory listed twice is not divided twice. With
  // `in_float`, float16 and bfloat16 tensors go to the engine as float32
  // copies, rounded back once at the end (an AVG adds in float32, as the
  // native kernels do: a float16 sum whose mean fits may overflow).
  using TensorsCall =
      std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>& tensors)>;
  c10::intrusive_ptr<c10d::Work> on_contiguous(GroupContext& group,
                                               std::vector<at::Tensor>& tensors, c10d::OpType type,
                                               const char* profiling_name, const TensorsCall& call,
                                               int64_t avg_divisor = 0, bool in_float = false);

  // Remembers a Work handed to an engine until it is done, and returns it.
  // xdev's barrier waits for them, as Gloo's own barrier waits for its work in
  // progress. It also marks the engine's thread that completes it (see
  // shutdown()).
  c10::intrusive_ptr<c10d::Work> track(c10::intrusive_ptr<c10d::Work> work);
  // One tracked Work: whether it is done, learnt from its future's callback,
  // without holding it. (A weak reference to a Work keeps the object, and so
  // its tensors, until the reference goes: a large all-to-all's buffers would
  // outlive the caller's last use.) A Work without a future, or with a CUDA
  // one (done once queued), is held weakly and waited on itself.
  struct DoneFlag {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;
  };
  struct WorkInFlight {
    std::shared_ptr<DoneFlag> flag;                             // a CPU future's
    std::optional<c10::weak_intrusive_ptr<c10d::Work>> weakly;  // otherwise
    bool finished() const;
  };
  // The tracked Works, taken when a barrier is called: it waits for these
  // only, not for work handed to the engines after it (which may need a peer
  // that is itself in the barrier).
  std::vector<WorkInFlight> take_work_in_flight();
  // Waits for those not yet done, until `deadline`. Their errors are not
  // raised here (each reaches its own caller through its Work); one still
  // running at the deadline fails the barrier (CallError) instead of holding
  // it for good: a callback of its future may itself wait for a collective
  // queued behind the barrier.
  static void wait_for(const std::vector<WorkInFlight>& works,
                       transport::Clock::time_point deadline);

  // Shuts the engines down and drops them (without the GIL: their destructors
  // join threads). On an engine's own thread (marked by track()) they
  // are dropped on a thread of their own, which this call does not wait for.
  void shutdown();

 private:
  // Throws where the current stream of `device` is capturing a CUDA graph:
  // for a call that would go to Gloo.
  void refuse_gloo_during_capture(int device) const;
  // Whether the current stream of the group's GPU is capturing a CUDA graph
  // (false before the group's first CUDA collective).
  bool capturing() const;
  // How an AVG of these tensors runs on an engine without AVG of its own
  // (Gloo, whose reduce and reduce-scatter average in floating point): as its
  // SUM, then a division (integers: Gloo cannot write the quotient into them),
  // and in float32 for float16 or bfloat16 (avg_adds_in_float).
  struct AvgOnEngine {
    bool as_sum = false;
    bool in_float = false;
  };
  AvgOnEngine avg_on_engine(const c10d::ReduceOp& op, const c10d::Backend& engine,
                            const std::vector<at::Tensor>& tensors) const;
  // Completes `work` (an engine's, named `what` in errors), then runs
  // `finish`; the returned Work covers both. A failure of either fails this
  // call alone (CallError), not the group's native path: on CPU tensors on
  // the group's queue, on CUDA tensors here (wait() orders the caller's
  // current stream after the engine's work, so `finish` runs in order there).
  c10::intrusive_ptr<c10d::Work> then(GroupContext& group, c10::intrusive_ptr<c10d::Work> work,
                                      const std::vector<at::Tensor>& outputs, c10d::OpType type,
                                      const char* profiling_name, const std::string& what,
                                      std::function<void()> finish);

  c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<c10d::Backend> nccl_;
  std::mutex in_flight_mutex_;
  std::vector<WorkInFlight> in_flight_;
  CudaCollectives* cuda_;
  std::string cpu_name_;
};

}  // namespace xdev::backend
