#include "fallback_engines.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <thread>

#include "detached_teardown.h"
#include "moved_tensors.h"
#include "tensor_helpers.h"

namespace xdev::backend {
namespace {

// The FallbackEngines whose engine runs this thread (a Gloo worker), as an
// identity only: set by the callbacks track() adds, null elsewhere.
thread_local const void* t_engine_thread_of = nullptr;

}  // namespace

FallbackEngines::FallbackEngines(c10::intrusive_ptr<c10d::Backend> gloo,
                                 c10::intrusive_ptr<c10d::Backend> nccl, CudaCollectives* cuda)
    : gloo_(std::move(gloo)), nccl_(std::move(nccl)), cuda_(cuda) {
  TORCH_CHECK(gloo_, "xdev: a fallback backend is required");
  cpu_name_ = gloo_->getBackendName();
}

c10d::Backend* FallbackEngines::gloo() const {
  TORCH_CHECK(gloo_, "xdev: this process group has been destroyed");
  return gloo_.get();
}

c10d::Backend* FallbackEngines::for_tensor(const at::Tensor& tensor) {
  c10d::Backend* engine = gloo();
  if (!tensor.is_cuda() || !nccl_) return engine;
  if (cuda_ != nullptr) {
    // NCCL refuses two ranks on one GPU; the first CUDA collective finds out.
    const CudaGroupInfo& info = cuda_->ensure_ready(tensor.get_device());
    if (info.ranks_share_gpu) {
      refuse_gloo_during_capture(tensor.get_device());
      return engine;
    }
  }
  return nccl_.get();
}

void FallbackEngines::refuse_gloo_during_capture(int device) const {
  // Gloo copies through host memory and waits for it, which a capture forbids.
  TORCH_CHECK(cuda_ == nullptr || cuda_->stream_refusal(device).empty(),
              "xdev: a CUDA call captured in a CUDA graph must go to NCCL, and these ranks "
              "share a GPU, which NCCL refuses (Gloo, their engine, cannot be captured). "
              "Capture collectives with one GPU per rank.");
}

bool FallbackEngines::capturing() const {
  const CudaGroupInfo* info = cuda_ ? cuda_->info() : nullptr;
  try {
    return info != nullptr && !cuda_->stream_refusal(info->device).empty();
  } catch (const std::exception&) {
    return false;  // a CUDA error left by earlier work: the call's own path reports it
  }
}

void FallbackEngines::open_cuda_engine(int device) {
  at::Tensor probe = at::zeros({1}, at::TensorOptions().device(at::kCUDA, device));
  c10d::Backend* engine = for_tensor(probe);
  TORCH_CHECK(engine == nccl_.get(),
              "xdev: these ranks cannot capture CUDA collectives in CUDA graphs: captured calls "
              "must go to NCCL, and ",
              nccl_ ? "these ranks share a GPU, which NCCL refuses"
                    : "this process has no NCCL (torch without it, or no GPU seen)",
              ".");
  // NCCL makes a device's communicator at its first collective there.
  std::vector<at::Tensor> probes{probe};
  engine->allreduce(probes)->wait();
}

c10d::Backend* FallbackEngines::for_tensors(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.is_cuda()) return for_tensor(t);
  }
  return gloo();
}

c10d::Backend* FallbackEngines::for_point_to_point(const std::vector<at::Tensor>& tensors) {
  const bool any_cuda =
      std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.is_cuda(); });
  if (!any_cuda || !nccl_) return gloo();
  const CudaGroupInfo* info = cuda_ ? cuda_->info() : nullptr;
  if (info == nullptr || !info->ranks_share_gpu) return nccl_.get();
  refuse_gloo_during_capture(info->device);
  return gloo();
}

std::string FallbackEngines::cuda_name() const {
  if (!nccl_) return cpu_name_;
  const CudaGroupInfo* info = cuda_ ? cuda_->info() : nullptr;
  if (cuda_ && info == nullptr) return "";
  return info != nullptr && info->ranks_share_gpu ? cpu_name_ : nccl_->getBackendName();
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::allreduce(GroupContext& group,
                                                          std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts,
                                                          bool coalesced,
                                                          bool avg_as_sum_then_divide) {
  c10d::Backend* engine = for_tensors(tensors);
  c10d::AllreduceOptions o = opts;
  if (avg_as_sum_then_divide) o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  const int64_t divisor = avg_as_sum_then_divide ? group.size() : 0;
  const auto run = [&](std::vector<at::Tensor>& some) {
    const bool in_float = avg_as_sum_then_divide && avg_adds_in_float(some);
    return on_contiguous(
        group, some, c10d::OpType::ALLREDUCE, "xdev:all_reduce",
        [engine, &o, coalesced](std::vector<at::Tensor>& ts) {
          if (!coalesced) return engine->allreduce(ts, o);
          c10d::AllreduceCoalescedOptions co;
          co.reduceOp = o.reduceOp;
          co.timeout = o.timeout;
          return engine->allreduce_coalesced(ts, co);
        },
        divisor, in_float);
  };
  // Gloo's coalesced allreduce takes one dtype (NCCL's any), where the native
  // path takes several: one call per dtype, in the order they first appear.
  std::vector<plan::DtypeGroup> by_dtype;
  if (coalesced && engine == gloo_.get()) by_dtype = group_by_scalar_type(tensors);
  if (by_dtype.size() > 1) {
    const auto run_group = [&](const plan::DtypeGroup& g) {
      std::vector<at::Tensor> some;
      for (size_t i : g.tensor_indices) some.push_back(tensors[i]);
      return run(some);
    };
    std::vector<c10::intrusive_ptr<c10d::Work>> earlier;
    for (size_t i = 0; i + 1 < by_dtype.size(); ++i) earlier.push_back(run_group(by_dtype[i]));
    return then(group, run_group(by_dtype.back()), tensors, c10d::OpType::ALLREDUCE,
                "xdev:all_reduce", "coalesced allreduce of several dtypes", [earlier] {
                  for (const auto& w : earlier) w->wait();
                });
  }
  return run(tensors);
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::on_contiguous(
    GroupContext& group, std::vector<at::Tensor>& tensors, c10d::OpType type,
    const char* profiling_name, const TensorsCall& call, int64_t avg_divisor, bool in_float) {
  // Sparse tensors (DDP's sparse gradients) are the engine's own business.
  const bool strided = std::all_of(tensors.begin(), tensors.end(),
                                   [](const at::Tensor& t) { return t.layout() == at::kStrided; });
  if (!strided) {
    c10::intrusive_ptr<c10d::Work> work = track(call(tensors));
    if (avg_divisor == 0) return work;
    return then(group, work, tensors, type, profiling_name, "SUM before the AVG's division",
                [tensors, avg_divisor] {
                  for (const at::Tensor& t : tensors) divide_for_avg(t, avg_divisor);
                });
  }
  std::vector<at::Tensor> flat = contiguous(tensors);
  if (in_float) {
    for (at::Tensor& t : flat) t = in_float_if_reduced(t);
  }
  bool as_given = true;
  for (size_t i = 0; i < tensors.size(); ++i) as_given = as_given && flat[i].is_same(tensors[i]);
  c10::intrusive_ptr<c10d::Work> work = track(call(as_given ? tensors : flat));
  if (as_given && avg_divisor == 0) return work;
  const char* what = avg_divisor > 0 ? "SUM before the AVG's division" : "collective";
  return then(group, work, tensors, type, profiling_name, what,
              [flat, tensors, as_given, avg_divisor] {
                if (avg_divisor > 0) {
                  for (const at::Tensor& t : flat) divide_for_avg(t, avg_divisor);
                }
                if (!as_given) copy_back(flat, tensors);
              });
}

FallbackEngines::AvgOnEngine FallbackEngines::avg_on_engine(
    const c10d::ReduceOp& op, const c10d::Backend& engine,
    const std::vector<at::Tensor>& tensors) const {
  if (op.op_ != c10d::ReduceOp::AVG || has_native_avg(engine)) return {};
  const bool integers = std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
    return at::isIntegralType(t.scalar_type(), /*includeBool=*/false);
  });
  const bool in_float = avg_adds_in_float(tensors);
  return {integers || in_float, in_float};
}

void FallbackEngines::refuse_what_gloo_cannot_reduce(const std::vector<at::Tensor>& tensors,
                                                     const char* collective) {
  if (tensors.empty() || for_tensors(tensors) != gloo_.get()) return;
  for (const at::Tensor& t : tensors) {
    // Complex tensors reach Gloo as real views (c10d's and xdev's).
    TORCH_CHECK_TYPE(engines_take(t.scalar_type()) || t.is_complex(), "xdev: ", collective, " of ",
                     t.scalar_type(),
                     " tensors: xdev has no kernel for them, and Gloo, which runs what it does "
                     "not, reduces only float32, float64, float16, bfloat16, int8, uint8, int32, "
                     "int64 and bool: convert them (int16 to int32, say)");
  }
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::reduce(GroupContext& group,
                                                       std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  c10d::Backend* engine = for_tensors(tensors);
  const AvgOnEngine avg = avg_on_engine(opts.reduceOp, *engine, tensors);
  c10d::ReduceOptions o = opts;
  if (avg.as_sum) o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  // Only the root's tensors hold the sum (the others', as the engine left them).
  const int64_t divisor = avg.as_sum && group.rank() == opts.rootRank ? group.size() : 0;
  return on_contiguous(
      group, tensors, c10d::OpType::REDUCE, "xdev:reduce",
      [engine, &o](std::vector<at::Tensor>& ts) { return engine->reduce(ts, o); }, divisor,
      avg.in_float);
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::reduce_scatter(
    GroupContext& group, const std::vector<at::Tensor>& outputs,
    const c10d::ReduceScatterOptions& opts, c10d::OpType type, const ReduceScatterCall& call) {
  c10d::Backend* engine = for_tensors(outputs);
  const AvgOnEngine avg = avg_on_engine(opts.reduceOp, *engine, outputs);
  c10d::ReduceScatterOptions o = opts;
  if (avg.as_sum) o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  // Gloo writes a strided output as if it were contiguous: it gets contiguous copies.
  std::vector<at::Tensor> targets = outputs;
  return on_contiguous(
      group, targets, type, "xdev:reduce_scatter",
      [engine, &o, &call, avg](std::vector<at::Tensor>& outs) {
        return call(*engine, o, outs, avg.in_float);
      },
      avg.as_sum ? group.size() : 0, avg.in_float);
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::then(GroupContext& group,
                                                     c10::intrusive_ptr<c10d::Work> work,
                                                     const std::vector<at::Tensor>& outputs,
                                                     c10d::OpType type, const char* profiling_name,
                                                     const std::string& what,
                                                     std::function<void()> finish) {
  auto wait_and_finish = [work, what, finish = std::move(finish)]() {
    try {
      work->wait();
    } catch (const std::exception& e) {
      // The engine's failure, which the engine reports again on its next call
      // if it is broken: this call fails, not the group's native path.
      throw CallError("the engine's " + what + " failed: " + e.what());
    }
    try {
      finish();
    } catch (const std::exception& e) {
      // The division or the copy back, which fails on this rank alone.
      throw CallError(std::string("after the engine's ") + what + ": " + e.what());
    }
  };
  const bool cuda =
      std::any_of(outputs.begin(), outputs.end(), [](const at::Tensor& t) { return t.is_cuda(); });
  if (cuda) {
    // Synchronous, but rare: a non-contiguous CUDA tensor, or ranks sharing a
    // GPU (which NCCL refuses) handing Gloo an AVG it lacks or an uneven
    // all-gather list. The engine's Work is returned: its result() holds what
    // the engine wrote (the contiguous or padded tensors).
    wait_and_finish();
    return work;
  }
  // On the worker thread, so the returned Work completes only once `finish` is
  // done; also in a group made unusable, which the engine's call never uses.
  return group.enqueue(type, profiling_name, outputs, wait_and_finish, /*async_op=*/true,
                       /*runs_when_unusable=*/true);
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::track(c10::intrusive_ptr<c10d::Work> work) {
  // A call captured in a CUDA graph runs at its replays, not now: nothing to
  // wait for. And asking the tracked ones whether they are done queries CUDA
  // events, which a capture forbids.
  if (capturing()) return work;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work->getFuture();
  } catch (const std::exception&) {
    // A Work without a future (Gloo's send and recv) runs no callbacks.
  }
  WorkInFlight tracked;
  // A CPU future completes once the engine's call has: the flag says when. A
  // CUDA future (NCCL's) completes when the kernels are queued, not run: the
  // barrier waits on that Work itself, held weakly, as on one without a future.
  if (future && future->devices().empty()) {
    tracked.flag = std::make_shared<DoneFlag>();
  } else {
    tracked.weakly = work;
  }
  if (future) {
    // Added before the caller sees the Work, so it runs before any of the
    // caller's callbacks, on the thread that completes the Work: it marks
    // that thread as this group's engine's (see shutdown()). A Work already
    // complete runs it here at once, which marks nothing.
    const void* engines = this;
    const std::thread::id issuer = std::this_thread::get_id();
    // uses_future false: the callback reads nothing of the result, so a CUDA
    // future needs no stream synchronized for it.
    future->addCallback(
        [engines, issuer, flag = tracked.flag](c10::ivalue::Future&) {
          if (std::this_thread::get_id() != issuer) t_engine_thread_of = engines;
          if (!flag) return;
          {
            std::lock_guard<std::mutex> lock(flag->mutex);
            flag->done = true;
          }
          flag->changed.notify_all();
        },
        /*uses_future=*/false);
  }
  std::lock_guard<std::mutex> lock(in_flight_mutex_);
  in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(),
                                  [](const WorkInFlight& w) { return w.finished(); }),
                   in_flight_.end());
  in_flight_.push_back(std::move(tracked));
  return work;
}

bool FallbackEngines::WorkInFlight::finished() const {
  if (flag) {
    std::lock_guard<std::mutex> lock(flag->mutex);
    return flag->done;
  }
  const c10::intrusive_ptr<c10d::Work> w = weakly ? weakly->lock() : nullptr;
  return !w || w->isCompleted();
}

std::vector<FallbackEngines::WorkInFlight> FallbackEngines::take_work_in_flight() {
  std::vector<WorkInFlight> works;
  std::lock_guard<std::mutex> lock(in_flight_mutex_);
  works.swap(in_flight_);
  return works;
}

void FallbackEngines::wait_for(const std::vector<WorkInFlight>& works,
                               transport::Clock::time_point deadline) {
  for (const WorkInFlight& tracked : works) {
    bool finished = true;
    if (tracked.flag) {
      std::unique_lock<std::mutex> lock(tracked.flag->mutex);
      finished = tracked.flag->changed.wait_until(lock, deadline,
                                                  [&tracked] { return tracked.flag->done; });
    } else if (const c10::intrusive_ptr<c10d::Work> w =
                   tracked.weakly ? tracked.weakly->lock() : nullptr) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - transport::Clock::now());
      try {
        w->wait(std::max(left, std::chrono::milliseconds(1)));
      } catch (const std::exception&) {
        // Its own error reaches its own caller; a wait that timed out leaves it unfinished.
        finished = w->isCompleted();
      }
    }
    if (!finished) {
      throw CallError(
          "xdev: barrier: a collective this rank handed to Gloo or NCCL before the barrier did "
          "not finish within the barrier's timeout (a peer never joined it, or a callback of its "
          "future waits for a collective issued after the barrier)");
    }
  }
}

void FallbackEngines::shutdown() {
  if (gloo_) gloo_->shutdown();
  if (nccl_) nccl_->shutdown();
  if (t_engine_thread_of == this) {
    // The group's last reference went in a callback of a Work an engine ran,
    // on that engine's thread, which the engine's destructor joins: it would
    // join itself (std::terminate). So the engines go on a thread of their
    // own, which joins this one once its callback has returned.
    run_detached_teardown([gloo = std::move(gloo_), nccl = std::move(nccl_)]() mutable {
      gloo.reset();
      nccl.reset();
    });
    return;
  }
  // Moved out first: while an engine's destructor drains its queue, a callback
  // there that calls this group again must find no engine, not the dying one.
  c10::intrusive_ptr<c10d::Backend> gloo = std::move(gloo_), nccl = std::move(nccl_);
  gloo.reset();
  nccl.reset();
}

}  // namespace xdev::backend
