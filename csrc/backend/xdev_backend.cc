#include "xdev_backend.h"

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <cstdio>
#include <optional>

#include "tensor_helpers.h"

namespace xdev::backend {
namespace {

// c10d's OpType gained REDUCE_SCATTER_TENSOR_COALESCED after torch 2.11; older
// releases label the coalesced reduce-scatter REDUCE_SCATTER.
template <typename OpType>
constexpr auto coalesced_reduce_scatter(int) -> decltype(OpType::REDUCE_SCATTER_TENSOR_COALESCED) {
  return OpType::REDUCE_SCATTER_TENSOR_COALESCED;
}
template <typename OpType>
constexpr OpType coalesced_reduce_scatter(long) {
  return OpType::REDUCE_SCATTER;
}
constexpr c10d::OpType reduce_scatter_coalesced_op_type() {
  return coalesced_reduce_scatter<c10d::OpType>(0);
}

}  // namespace

#ifndef XDEV_WITH_CUDA
std::unique_ptr<CudaCollectives> make_cuda_collectives(GroupContext&) {
  return nullptr;  // this build has no CUDA: CUDA tensors go to the fallback engines
}
#endif

XdevBackend::XdevBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         BackendConfig config, c10::intrusive_ptr<c10d::Backend> fallback,
                         c10::intrusive_ptr<c10d::Backend> cuda_fallback,
                         const EngineFactory& cross_host_engine)
    : c10d::Backend(rank, size),
      group_(store, rank, size, std::move(config)),
      cpu_(group_.channel() ? std::make_unique<CpuCollectives>(group_) : nullptr),
      gather_scatter_(std::make_unique<CpuGatherScatter>(group_, shared_)),
      cuda_(make_cuda_collectives(group_)),
      shared_(group_),
      fallbacks_(std::move(fallback), std::move(cuda_fallback), cuda_.get()) {
  const BackendConfig& c = group_.config();
  if (group_.num_hosts() > 1) {
    if (group_.host_channel() != nullptr && cross_host_engine) {
      // One engine per local index: the ranks of local rank l on every host.
      const c10::intrusive_ptr<c10d::Backend> engine =
          cross_host_engine("xdev/cross/" + std::to_string(group_.local_rank()) + "/",
                            group_.host_index(), group_.num_hosts());
      two_level_ = std::make_unique<TwoLevelAllreduce>(group_, shared_, engine);
      two_level_gather_scatter_ =
          std::make_unique<TwoLevelGatherScatter>(group_, shared_, engine, *two_level_);
      two_level_broadcast_ = std::make_unique<TwoLevelBroadcast>(group_, engine);
    } else if (group_.requested() == plan::Algorithm::kFallback) {
      two_level_note_ = "algorithm='fallback' requested";
    } else if (!group_.hosts_even()) {
      two_level_note_ = "hosts hold different numbers of ranks";
    } else if (group_.local_world_size() == 1) {
      two_level_note_ = "one rank per host: nothing to share inside a host";
    } else {
      two_level_note_ = "no engine across hosts was given";
    }
  }
  if (c.debug && rank == 0) {
    const plan::Selection small = selection_for(1, false);
    const plan::Selection large = selection_for(int64_t{1} << 30, false);
    std::fprintf(stderr,
                 "[xdev] group '%s': %d rank(s) on %d host(s), algorithm=%s, num_packs=%lld, "
                 "shared memory %s; CPU allreduce: small -> %s (%s), large -> %s (%s); "
                 "fallback engine: %s\n",
                 c.group_name.c_str(), size, group_.num_hosts(), c.algorithm.c_str(),
                 static_cast<long long>(c.num_packs), cpu_ ? "on" : "off",
                 plan::to_string(small.algorithm), small.reason.c_str(),
                 plan::to_string(large.algorithm), large.reason.c_str(), fallback_name().c_str());
  }
}

XdevBackend::~XdevBackend() {
  shutdown();
}

void XdevBackend::shutdown() {
  // Joining the worker and destroying Gloo wait on threads that may need the
  // GIL (to free tensors); never hold it while waiting for them.
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (Py_IsInitialized() && PyGILState_Check()) no_gil.emplace();
  if (!group_.stop_queue()) return;  // already shut down
  if (cuda_) cuda_->shutdown();      // its last barrier still needs the channel
  cpu_.reset();
  two_level_gather_scatter_.reset();  // runs the reduce-scatter's leader form on two_level_
  two_level_.reset();
  two_level_broadcast_.reset();  // the engine's last user: its destructor joins its threads
  gather_scatter_.reset();
  group_.close_channel();
  fallbacks_.shutdown();
}

std::string XdevBackend::single_copy_note() const {
  return cpu_ ? cpu_->single_copy_note()
              : "off: no shared memory (several hosts, or a world of one)";
}

std::string XdevBackend::shm_name() const {
  const transport::ShmChannel* channel = group_.channel();
  return channel ? channel->name() : std::string();
}

std::pair<std::string, std::string> XdevBackend::last_selection() const {
  std::lock_guard<std::mutex> lock(selection_mutex_);
  return last_selection_;
}

std::vector<std::string> XdevBackend::last_gather_scatter() const {
  std::lock_guard<std::mutex> lock(selection_mutex_);
  return last_gather_scatter_;
}

plan::SelectionInput XdevBackend::selection_input(int64_t payload, bool cuda) const {
  plan::SelectionInput in;
  in.requested = group_.requested();
  in.world_size = size_;
  in.num_hosts = group_.num_hosts();
  in.device = cuda ? plan::DeviceKind::kCuda : plan::DeviceKind::kCpu;
  if (cuda) {
    const CudaGroupInfo* info = cuda_ ? cuda_->info() : nullptr;
    // A world of one has no CUDA transport: its allreduce is NCCL's no-op.
    in.transport_available = info != nullptr && info->transport;
    if (info != nullptr) {
      in.topology = info->topology;
      if (info->model) {
        in.model = &*info->model;
        in.model_cache = &cuda_model_choices_;
        in.nccl_available = !info->ranks_share_gpu;
      }
    }
    // The note only explains a missing transport: no string copy on the per-call path.
    if (!in.transport_available) {
      in.transport_note = info != nullptr ? info->transport_note
                          : !cuda_        ? "this build has no CUDA path"
                          : size_ == 1    ? "one rank"
                                          : "decided by the group's first CUDA collective";
    }
  } else {
    in.transport_available = cpu_ != nullptr || size_ == 1;
    in.two_level_available = two_level_ != nullptr;
    in.two_level_note = two_level_note_;
    if (two_level_ != nullptr) {
      in.ranks_per_host = group_.local_world_size();
      in.host_model = &two_level_->host_model();
      in.network = &two_level_->network();
      in.two_level_pieces = static_cast<int>(group_.config().two_level_pieces);
    }
    if (cpu_ != nullptr) {
      in.single_copy_available = cpu_->single_copy_available();
      in.model = &cpu_->model();
      in.model_cache = &model_choices_;
    }
  }
  in.payload_bytes = payload;
  in.num_packs = group_.config().num_packs;
  return in;
}

void XdevBackend::log_choice(const plan::Selection& sel, bool cuda) {
  {
    std::lock_guard<std::mutex> lock(selection_mutex_);
    last_selection_ = {plan::to_string(sel.algorithm), sel.reason};
  }
  const char* device = cuda ? "CUDA" : "CPU";
  group_.log_once(std::string(device) + ":" + plan::to_string(sel.algorithm) + sel.reason,
                  std::string("allreduce on ") + device + " tensors -> " +
                      plan::to_string(sel.algorithm) + " (" + sel.reason + ")");
}

c10::intrusive_ptr<c10d::Work> XdevBackend::dispatch_allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts,
                                                               bool coalesced) {
  ++collectives_called_;
  TORCH_CHECK_VALUE(!tensors.empty(), "xdev allreduce: no tensors given");
  const c10::Device device = tensors[0].device();
  bool native_ok = native_op(opts.reduceOp).has_value();
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK_VALUE(t.device() == device,
                      "xdev allreduce: all tensors must be on one device; got ", device, " and ",
                      t.device());
    TORCH_CHECK_VALUE(t.layout() == at::kStrided,
                      "xdev allreduce: only dense (strided) tensors are supported");
    native_ok = native_ok && native_dtype(t.scalar_type()).has_value();
  }
  if (device.is_cuda() && cuda_ != nullptr && size_ > 1) {
    // Collective on first use: every rank learns the GPUs and the transport.
    cuda_->ensure_ready(device.index());
  }
  plan::SelectionInput in = selection_input(payload_bytes(tensors), device.is_cuda());
  in.op_supported = native_ok;
  in.num_tensors = static_cast<int64_t>(tensors.size());
  in.op_is_avg = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
  if (in.op_is_avg)
    in.fallback_has_avg = fallbacks_.has_native_avg(*fallbacks_.for_tensors(tensors));
  SharedPlacement shared;
  if (!device.is_cuda() && tensors.size() == 1) {
    shared = shared_.find(tensors[0]);
    if (shared.buffer != nullptr) in.shared_buffer_id = shared.buffer->id();
    in.in_symmetric_heap = shared.heap != nullptr;
  }
  if (in.two_level_available) {
    // One flat payload of one dtype, cut into the same slices on every host.
    for (const at::Tensor& t : tensors) {
      if (t.scalar_type() != tensors[0].scalar_type()) {
        in.two_level_available = false;
        in.two_level_note = "tensors of several dtypes";
      }
    }
  }
  const plan::Selection sel = plan::select_allreduce(in);
  if (!sel.in_place_shared) shared = {};
  log_choice(sel, device.is_cuda());
  if (sel.algorithm == plan::Algorithm::kFallback) {
    return fallbacks_.allreduce(group_, tensors, opts, coalesced, sel.avg_as_sum_then_divide);
  }
  if (sel.two_level) {
    return two_level_->allreduce(tensors, *native_op(opts.reduceOp), sel.two_level_pieces,
                                 sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  if (device.is_cuda()) {
    TORCH_CHECK(cuda_ != nullptr, "xdev: this build has no CUDA support");  // selection prevents it
    return cuda_->allreduce(tensors, *native_op(opts.reduceOp), sel, opts.timeout);
  }
  if (size_ == 1) {  // a world of one already holds its result
    return group_.enqueue(c10d::OpType::ALLREDUCE, "xdev:all_reduce", tensors, [] {}, opts.asyncOp);
  }
  return cpu_->allreduce(tensors, *native_op(opts.reduceOp), sel, opts.timeout, opts.asyncOp,
                         std::move(shared));
}

const char* XdevBackend::list_refusal(bool uneven, size_t num_lists) const {
  if (!uneven) return nullptr;
  // Across hosts every rank's block must be one size: the engine gathers
  // blocks of one size among the ranks of a local index.
  if (group_.num_hosts() > 1) return "uneven list sizes (the two-level form needs one size)";
  return num_lists > 1 ? "uneven sizes in several lists" : nullptr;
}

plan::GatherScatterSelection XdevBackend::select_gather_scatter(
    const char* name, const std::vector<at::Tensor>& tensors,
    const std::vector<at::Tensor>& full_tensors, const c10d::ReduceOp* op,
    const char* shape_refusal) {
  plan::GatherScatterInput in;
  in.requested = group_.requested();
  in.world_size = size_;
  in.num_hosts = group_.num_hosts();
  in.transport_available = group_.channel() != nullptr;
  in.op_supported = op == nullptr || native_op(*op).has_value();
  for (const at::Tensor& t : tensors) {
    if (t.device().is_cuda()) in.device = plan::DeviceKind::kCuda;
    in.op_supported = in.op_supported && t.device().is_cpu() && t.layout() == at::kStrided &&
                      (op == nullptr || native_dtype(t.scalar_type()).has_value());
  }
  if (shape_refusal != nullptr) {
    in.shapes_supported = false;
    in.unsupported_note = shape_refusal;
  }
  in.payload_bytes = payload_bytes(full_tensors);
  in.num_tensors = static_cast<int64_t>(full_tensors.size());
  in.single_copy_available = cpu_ != nullptr && cpu_->single_copy_available();
  // The CPU model chooses the form; a reduce-scatter predicts with its dtype's width.
  in.kind =
      op == nullptr ? plan::GatherScatterKind::kAllGather : plan::GatherScatterKind::kReduceScatter;
  if (!full_tensors.empty()) in.elem_bytes = full_tensors[0].element_size();
  if (cpu_ != nullptr) {
    in.model = &cpu_->model();
    in.model_cache = &gather_scatter_choices_;
    // The tensor peers would read in place: a reduce-scatter's input, an all-gather's output.
    in.in_symmetric_heap = full_tensors.size() == 1 && full_tensors[0].device().is_cpu() &&
                           shared_.find(full_tensors[0]).heap != nullptr;
  }
  in.two_level_note = two_level_note_;
  if (two_level_gather_scatter_ != nullptr) {
    in.two_level_available = true;
    in.two_level_note.clear();
    // A reduce-scatter reduces one dtype (the engine has no AVG: a division after its SUM).
    for (const at::Tensor& t : full_tensors) {
      if (op != nullptr && t.scalar_type() != full_tensors[0].scalar_type()) {
        in.two_level_available = false;
        in.two_level_note = "tensors of several dtypes";
      }
    }
    in.ranks_per_host = group_.local_world_size();
    in.host_model = &two_level_->host_model();
    in.network = &two_level_->network();
  }
  const plan::GatherScatterSelection sel = plan::select_gather_scatter(in);
  {
    std::lock_guard<std::mutex> lock(selection_mutex_);
    last_gather_scatter_ = {name, plan::to_string(sel.path), sel.reason};
  }
  const char* device = in.device == plan::DeviceKind::kCuda ? "CUDA" : "CPU";
  group_.log_once(std::string(name) + ":" + device + ":" + sel.reason,
                  std::string(name) + " on " + device + " tensors -> " + plan::to_string(sel.path) +
                      " (" + sel.reason + ")");
  if (sel.path != plan::GatherScatterPath::kFallback) ++collectives_called_;
  return sel;
}

at::Tensor XdevBackend::allocateTensor(long size, at::TensorOptions options) {
  TORCH_CHECK_VALUE(!options.has_device() || options.device().is_cpu(),
                    "xdev allocateTensor: only CPU tensors (supportsTensorAlloc is false for ",
                    options.device(), ")");
  const at::ScalarType dtype = options.has_dtype()
                                   ? c10::typeMetaToScalarType(options.dtype())
                                   : c10::typeMetaToScalarType(at::get_default_dtype());
  try {
    return shared_.allocate(size, dtype);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  return dispatch_allreduce(tensors, opts, false);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  return dispatch_allreduce(tensors, opts, true);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  ++collectives_called_;
  bool native = (cpu_ != nullptr || two_level_broadcast_ != nullptr) && opts.rootTensor == 0;
  for (const at::Tensor& t : tensors) {
    native = native && t.device().is_cpu() && t.layout() == at::kStrided;
  }
  if (!native) return fallbacks_.for_tensors(tensors)->broadcast(tensors, opts);
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "xdev broadcast: root rank ",
                    opts.rootRank, " is outside the group of ", size_);
  if (two_level_broadcast_ != nullptr) {  // across hosts: two levels or the engine's tree
    const plan::AcrossHostsChoice c =
        plan::choose_broadcast_across_hosts({group_.num_hosts(), group_.local_world_size()},
                                            plan::model_bucket_bytes(payload_bytes(tensors)),
                                            two_level_->network(), two_level_->host_model());
    const char* path = c.two_level ? "two_level" : "fallback";
    group_.log_once("broadcast:" + c.reason,
                    std::string("broadcast on CPU tensors -> ") + path + " (" + c.reason + ")");
    if (!c.two_level) return fallbacks_.cpu()->broadcast(tensors, opts);
    return two_level_broadcast_->broadcast(tensors, static_cast<int>(opts.rootRank), opts.timeout,
                                           opts.asyncOp);
  }
  return cpu_->broadcast(tensors, static_cast<int>(opts.rootRank), opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::barrier(const c10d::BarrierOptions& opts) {
  ++collectives_called_;
  // Like NCCL's barrier, it also waits for this rank's GPU collectives.
  CudaCollectives* cuda = cuda_.get();
  auto wait_for_gpu = [cuda] {
    if (cuda && cuda->info()) cuda->synchronize();
  };
  if (cpu_ != nullptr) return cpu_->barrier(opts.timeout, opts.asyncOp, wait_for_gpu);
  if (size_ == 1) {
    return group_.enqueue(c10d::OpType::BARRIER, "xdev:barrier", {}, wait_for_gpu, false);
  }
  return fallbacks_.cpu()->barrier(opts);
}

void XdevBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  ++collectives_called_;
  fallbacks_.cpu()->monitoredBarrier(opts, wait_all_ranks);
}

// ---- Delegated collectives (all-gather and reduce-scatter: native on one host) ----

c10::intrusive_ptr<c10d::Work> XdevBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  return delegate(tensors)->reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> all = inputs;
  std::vector<at::Tensor> full;  // every output: what the call moves
  bool uneven = false;
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (const at::Tensor& t : outputs[i]) {
      all.push_back(t);
      full.push_back(t);
      uneven = uneven || (i < inputs.size() && t.numel() != inputs[i].numel());
    }
  }
  const auto sel =
      select_gather_scatter("all_gather", all, full, nullptr, list_refusal(uneven, outputs.size()));
  if (sel.path == plan::GatherScatterPath::kFallback) {
    return delegate(inputs)->allgather(outputs, inputs, opts);
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->all_gather_list(
        outputs, inputs, c10d::OpType::ALLGATHER, sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  return gather_scatter_->all_gather_list(outputs, inputs, opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  const auto sel = select_gather_scatter("all_gather", {output, input}, {output}, nullptr, nullptr);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    return delegate(input)->_allgather_base(output, input, opts);
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->all_gather({output}, {input}, c10d::OpType::_ALLGATHER_BASE,
                                                 sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  return gather_scatter_->all_gather({output}, {input}, c10d::OpType::_ALLGATHER_BASE, opts.timeout,
                                     opts.asyncOp, sel);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  // outputs[r][i] receives rank r's inputs[i]. Checked here, as Gloo checks it,
  // so a wrong call is a ValueError on the rank that made it; a call that
  // differs between ranks is caught by the native path's descriptor check.
  TORCH_CHECK_VALUE(!inputs.empty(), "xdev all_gather_coalesced: no input tensors given");
  TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_,
                    "xdev all_gather_coalesced: needs one output list per rank (", size_, "); got ",
                    outputs.size());
  std::vector<at::Tensor> all = inputs;
  std::vector<at::Tensor> full;  // every output: what the call moves
  for (size_t r = 0; r < outputs.size(); ++r) {
    TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(), "xdev all_gather_coalesced: output list ",
                      r, " has ", outputs[r].size(), " tensor(s) for ", inputs.size(), " input(s)");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& out = outputs[r][i];
      TORCH_CHECK_VALUE(
          out.sizes() == inputs[i].sizes() && out.scalar_type() == inputs[i].scalar_type(),
          "xdev all_gather_coalesced: output ", r, "/", i, " (", out.scalar_type(), " ",
          out.sizes(), ") must match input ", i, " (", inputs[i].scalar_type(), " ",
          inputs[i].sizes(), ")");
      all.push_back(out);
      full.push_back(out);
    }
  }
  const auto sel = select_gather_scatter("all_gather_coalesced", all, full, nullptr);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    return delegate(inputs)->allgather_coalesced(outputs, inputs, opts);
  }
  // The list form with one list per input (lists[i][r] = outputs[r][i]): one
  // all-gather of every input's bytes, each rank's block the inputs in order.
  std::vector<std::vector<at::Tensor>> lists(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (const std::vector<at::Tensor>& per_rank : outputs) lists[i].push_back(per_rank[i]);
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->all_gather_list(
        std::move(lists), inputs, c10d::OpType::ALLGATHER_COALESCED, sel.two_level_leader,
        opts.timeout, opts.asyncOp);
  }
  return gather_scatter_->all_gather_list(std::move(lists), inputs, opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> all = outputs;
  all.insert(all.end(), inputs.begin(), inputs.end());
  const auto sel = select_gather_scatter("all_gather", all, outputs, nullptr, nullptr);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    return delegate(inputs)->allgather_into_tensor_coalesced(outputs, inputs, opts);
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->all_gather(outputs, inputs, c10d::OpType::COALESCED,
                                                 sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  return gather_scatter_->all_gather(outputs, inputs, c10d::OpType::COALESCED, opts.timeout,
                                     opts.asyncOp, sel);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::GatherOptions& opts) {
  return delegate(inputs)->gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  return delegate(outputs)->scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> all = outputs;
  std::vector<at::Tensor> full;  // every input: what the call moves
  bool uneven = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (const at::Tensor& t : inputs[i]) {
      all.push_back(t);
      full.push_back(t);
      uneven = uneven || (i < outputs.size() && t.numel() != outputs[i].numel());
    }
  }
  const auto sel = select_gather_scatter("reduce_scatter", all, full, &opts.reduceOp,
                                         list_refusal(uneven, inputs.size()));
  if (sel.path == plan::GatherScatterPath::kFallback) {
    return fallbacks_.reduce_scatter(
        group_, outputs, opts, c10d::OpType::REDUCE_SCATTER,
        [&](c10d::Backend& engine, const c10d::ReduceScatterOptions& o) {
          return engine.reduce_scatter(outputs, inputs, o);
        });
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->reduce_scatter_list(
        outputs, inputs, *native_op(opts.reduceOp), sel.two_level_leader, opts.timeout,
        opts.asyncOp);
  }
  return gather_scatter_->reduce_scatter_list(outputs, inputs, *native_op(opts.reduceOp),
                                              opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const auto sel =
      select_gather_scatter("reduce_scatter", {output, input}, {input}, &opts.reduceOp, nullptr);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    return fallbacks_.reduce_scatter(
        group_, {output}, opts, c10d::OpType::_REDUCE_SCATTER_BASE,
        [&](c10d::Backend& engine, const c10d::ReduceScatterOptions& o) {
          return engine._reduce_scatter_base(output, input, o);
        });
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->reduce_scatter(
        {output}, {input}, *native_op(opts.reduceOp), c10d::OpType::_REDUCE_SCATTER_BASE,
        sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  return gather_scatter_->reduce_scatter({output}, {input}, *native_op(opts.reduceOp),
                                         c10d::OpType::_REDUCE_SCATTER_BASE, opts.timeout,
                                         opts.asyncOp, sel);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> all = outputs;
  all.insert(all.end(), inputs.begin(), inputs.end());
  const auto sel = select_gather_scatter("reduce_scatter", all, inputs, &opts.reduceOp, nullptr);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    return fallbacks_.reduce_scatter(
        group_, outputs, opts, reduce_scatter_coalesced_op_type(),
        [&](c10d::Backend& engine, const c10d::ReduceScatterOptions& o) {
          return engine.reduce_scatter_tensor_coalesced(outputs, inputs, o);
        });
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->reduce_scatter(
        outputs, inputs, *native_op(opts.reduceOp), reduce_scatter_coalesced_op_type(),
        sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  return gather_scatter_->reduce_scatter(outputs, inputs, *native_op(opts.reduceOp),
                                         reduce_scatter_coalesced_op_type(), opts.timeout,
                                         opts.asyncOp, sel);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& output_split_sizes,
                                                          std::vector<int64_t>& input_split_sizes,
                                                          const c10d::AllToAllOptions& opts) {
  return delegate(input)->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  return delegate(inputs)->alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                 int tag) {
  return fallbacks_.for_point_to_point(tensors)->send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                 int tag) {
  return fallbacks_.for_point_to_point(tensors)->recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                          int tag) {
  return fallbacks_.for_point_to_point(tensors)->recvAnysource(tensors, tag);
}

}  // namespace xdev::backend
