#include "xdev_backend.h"

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstdio>
#include <optional>

#include "tensor_helpers.h"

namespace xdev::backend {
namespace {

// Across hosts a selection's `algorithm` is the plan inside each host: the
// path is two levels, as describe() names it for every collective.
std::string inside_each_host(const plan::Selection& sel) {
  return std::string(plan::to_string(sel.algorithm)) + " inside each host";
}
std::string path_of(const plan::Selection& sel) {
  return sel.two_level ? "two_level, " + inside_each_host(sel) : plan::to_string(sel.algorithm);
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
      const auto engine = std::make_shared<CrossHostEngine>(
          cross_host_engine("xdev/cross/" + std::to_string(group_.local_rank()) + "/",
                            group_.host_index(), group_.num_hosts()));
      // An unusable group lets go of it, so that partners waiting there for
      // this rank fail at once (see CrossHostEngine).
      group_.on_poison([weak = std::weak_ptr<CrossHostEngine>(engine)] {
        if (const std::shared_ptr<CrossHostEngine> held = weak.lock()) held->close();
      });
      two_level_ = std::make_unique<TwoLevelAllreduce>(group_, shared_, engine);
      two_level_gather_scatter_ =
          std::make_unique<TwoLevelGatherScatter>(group_, shared_, engine, *two_level_);
      two_level_broadcast_ = std::make_unique<TwoLevelBroadcast>(group_, engine);
    } else if (group_.host_channel() == nullptr) {
      two_level_note_ = group_.no_channel_reason();
    } else {
      two_level_note_ = "no engine across hosts was given";
    }
  }
  if (c.debug && rank == 0) {
    const plan::Selection small = selection_for(1, false);
    const plan::Selection large = selection_for(int64_t{1} << 30, false);
    std::fprintf(stderr,
                 "[xdev] group '%s': %d rank(s) on %d host(s), algorithm=%s, num_packs=%lld, "
                 "shared memory %s; CPU allreduce: 1 B -> %s (%s), 1 GiB -> %s (%s); "
                 "fallback engine: %s\n",
                 c.group_name.c_str(), size, group_.num_hosts(), c.algorithm.c_str(),
                 static_cast<long long>(c.num_packs), cpu_ ? "on" : "off", path_of(small).c_str(),
                 small.reason.c_str(), path_of(large).c_str(), large.reason.c_str(),
                 fallback_name().c_str());
  }
  // Last: no task may take a reference before anything owns the backend.
  group_.set_owner(this);
}

XdevBackend::~XdevBackend() {
  shut_down(/*last_reference=*/true);
}

c10::intrusive_ptr<c10d::Backend::Options> XdevBackend::getBackendOptions() {
  auto options = c10::make_intrusive<XdevBackendOptions>(group_.config().timeout);
  options->group_name = group_.config().group_name;
  return options;
}

c10::intrusive_ptr<c10d::Backend> XdevBackend::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  const CallGate::Entry entry = gate_.enter();
  TORCH_CHECK(splitter_ != nullptr, "xdev: this group cannot be split");
  std::lock_guard<std::mutex> lock(split_mutex_);
  // Every rank of this group takes part in a split, in it or not, and c10d
  // hands each device type's backend the same store within one split: the
  // count of stores seen numbers the splits alike on every rank. (The store
  // is held, so that its address cannot come back for a later split.) The
  // child meets its peers under that number on this group's own store: the
  // store c10d gives is named after the child's group name, which torch
  // derives from how many groups each rank holds, and that may differ
  // between ranks (a new_group of a subset counts only on its members).
  if (store != last_split_store_) {
    ++splits_made_;
    last_split_store_ = store;
    last_split_.reset();
  }
  const auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) return {};
  if (last_split_) {
    // The same split asked again for another device type: the child it made.
    if (c10::intrusive_ptr<c10d::Backend> child = last_split_->lock()) return child;
  }
  std::string prefix = "xdev/split" + std::to_string(splits_made_) + "/";
  for (int r : ranks) prefix += std::to_string(r) + ",";  // PrefixStore adds the "/"
  const auto child_store = c10::make_intrusive<c10d::PrefixStore>(prefix, group_.store_ref());
  const std::chrono::milliseconds timeout = opts ? opts->timeout : group_.config().timeout;
  const std::string name = opts ? opts->group_name : std::string();
  // `ranks` number this group's members; the child's errors name global ranks.
  const std::vector<int64_t>& ours = group_.config().global_ranks;
  std::vector<int64_t> global_ranks;
  for (int r : ranks) global_ranks.push_back(ours.empty() ? r : ours.at(static_cast<size_t>(r)));
  c10::intrusive_ptr<c10d::Backend> child =
      splitter_(child_store, static_cast<int>(me - ranks.begin()), static_cast<int>(ranks.size()),
                timeout, name, global_ranks);
  last_split_.emplace(child);
  return child;
}

void XdevBackend::shutdown() {
  shut_down(/*last_reference=*/false);
}

void XdevBackend::shut_down(bool last_reference) {
  // Joining the worker and destroying Gloo wait on threads that may need the
  // GIL (to free tensors); never hold it while waiting for them.
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (Py_IsInitialized() && PyGILState_Check()) no_gil.emplace();
  if (!group_.stop_queue(last_reference)) return;  // already shut down
  // Calls from here on raise. Those already in (another thread's) leave
  // before the parts they use go: most at once (an enqueue now throws, and a
  // call handed to an engine is handed on at once), a few after waiting for
  // their peers (split, shared_empty, monitored_barrier, the first CUDA call's
  // rendezvous), within their timeout. (A callback an engine runs while
  // draining in its destructor finds the gate closed rather than the engine
  // going.)
  gate_.close();
  if (cuda_) cuda_->shutdown();  // its last barrier still needs the channel
  cpu_.reset();
  two_level_gather_scatter_.reset();  // runs the reduce-scatter's leader form on two_level_
  two_level_.reset();
  two_level_broadcast_.reset();  // the engine's last user: its destructor joins its threads
  gather_scatter_.reset();
  shared_.close();
  group_.close_channel();
  fallbacks_.shutdown();
}

std::string XdevBackend::single_copy_note() const {
  if (cpu_) return cpu_->single_copy_note();
  return "off: " + (group_.num_hosts() > 1 ? "the group spans hosts" : group_.no_channel_reason());
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

std::pair<std::string, std::string> XdevBackend::last_broadcast() const {
  std::lock_guard<std::mutex> lock(selection_mutex_);
  return last_broadcast_;
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
      in.gpu_time_sliced = info->gpu_time_sliced;
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

namespace {
// The transport is the selection's too: peers reading the tensor in place.
std::string reason_of(const plan::Selection& sel) {
  return sel.reason + (sel.single_copy ? "; on the single-copy transport" : "");
}
}  // namespace

std::pair<std::string, std::string> XdevBackend::shown_selection(const plan::Selection& sel) {
  if (!sel.two_level) return {plan::to_string(sel.algorithm), reason_of(sel)};
  return {"two_level", inside_each_host(sel) + "; " + reason_of(sel)};
}

void XdevBackend::log_choice(const plan::Selection& sel, bool cuda) {
  {
    std::lock_guard<std::mutex> lock(selection_mutex_);
    last_selection_ = shown_selection(sel);
  }
  if (!group_.config().debug) return;  // no strings built per call without the log
  const std::string reason = reason_of(sel);
  const char* device = cuda ? "CUDA" : "CPU";
  const std::string what = path_of(sel);
  group_.log_once(
      std::string(device) + ":" + what + reason,
      std::string("allreduce on ") + device + " tensors -> " + what + " (" + reason + ")");
}

bool XdevBackend::premultiplies_here(const c10d::ReduceOp& op,
                                     const std::vector<at::Tensor>& tensors) {
  return op.op_ == c10d::ReduceOp::PREMUL_SUM && !tensors.empty() &&
         !fallbacks_.has_premul_sum(*fallbacks_.for_tensors(tensors));
}

void XdevBackend::refuse_premul_with_peers(const std::vector<at::Tensor>& tensors,
                                           const c10d::ReduceOp& op,
                                           std::chrono::milliseconds timeout) {
  std::exception_ptr refusal;
  try {
    check_premultipliable(tensors, op);
  } catch (const std::exception&) {
    refusal = std::current_exception();
  }
  if (size_ > 1) {
    // The peers' SUM may take any path (natively, in two levels, on Gloo), so the refusal
    // cannot meet them there: every rank votes first.
    std::vector<at::Tensor> vote{at::full({1}, refusal ? 1 : 0, at::kInt)};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
    max.timeout = timeout;
    const std::pair<std::string, std::string> last_before = last_selection();
    dispatch_allreduce(vote, max, false)->wait();
    {
      // describe()'s last_allreduce is the last one the caller made, not this vote.
      std::lock_guard<std::mutex> lock(selection_mutex_);
      last_selection_ = last_before;
    }
    if (!refusal && vote[0].item<int>() != 0) {
      TORCH_CHECK_VALUE(false,
                        "xdev: ReduceOp.PREMUL_SUM refused by another rank of the group (its own "
                        "error says why: its tensors are not of a floating-point type it can "
                        "sum). The group stays usable.");
    }
  }
  if (refusal) std::rethrow_exception(refusal);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::dispatch_allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts,
                                                               bool coalesced) {
  if (premultiplies_here(opts.reduceOp, tensors)) {
    refuse_premul_with_peers(tensors, opts.reduceOp, opts.timeout);
    if (std::any_of(tensors.begin(), tensors.end(), elements_share_memory)) {
      // Scaling such a tensor in place fails on this rank alone, which would
      // leave its peers in this call and pair its next call with it. It takes
      // part with scaled copies, so every rank's sums stay right, then fails.
      std::vector<at::Tensor> scaled = premultiplied(tensors, opts.reduceOp);
      dispatch_allreduce(scaled, with_sum(opts), coalesced)->wait();
      check_written("all_reduce", tensors);
    }
    premultiply_(tensors, opts.reduceOp);  // the result overwrites them
    return dispatch_allreduce(tensors, with_sum(opts), coalesced);
  }
  ++collectives_called_;
  TORCH_CHECK_VALUE(!tensors.empty(), "xdev allreduce: no tensors given");
  const c10::Device device = tensors[0].device();
  const std::optional<kernels::ReduceOp> reduce_op = native_op(opts.reduceOp);
  bool native_ok = reduce_op.has_value();
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK_VALUE(t.device() == device,
                      "xdev allreduce: all tensors must be on one device; got ", device, " and ",
                      t.device());
    native_ok = native_ok && native_dtype(t.scalar_type()).has_value();
  }
  const bool dense = std::all_of(tensors.begin(), tensors.end(),
                                 [](const at::Tensor& t) { return t.layout() == at::kStrided; });
  const bool reduces_list_into_one = !coalesced && tensors.size() > 1;
  const bool engine_only = !dense || reduces_list_into_one;  // see SelectionInput::dense
  if (device.is_cuda() && cuda_ != nullptr && size_ > 1 && !engine_only) {
    // Collective on first use: every rank learns the GPUs and the transport.
    cuda_->ensure_ready(device.index());
  }
  plan::SelectionInput in = selection_input(payload_bytes(tensors), device.is_cuda());
  if (device.is_cuda() && !engine_only)
    refuse_during_capture(device.index(), in.transport_available, in.transport_note);
  in.dense = dense;
  in.reduces_list_into_one = reduces_list_into_one;
  in.op_supported = native_ok;
  in.num_tensors = static_cast<int64_t>(tensors.size());
  in.op_is_avg = opts.reduceOp.op_ == c10d::ReduceOp::AVG;
  // Where the two-level plan keeps a NaN the engine's ring can drop (one dtype: its condition).
  in.engine_may_drop_nan = reduce_op && gathers_across_hosts(*reduce_op, tensors[0].scalar_type());
  if (in.op_is_avg)
    in.fallback_has_avg = fallbacks_.has_native_avg(*fallbacks_.for_tensors(tensors));
  SharedPlacement shared;
  if (engine_only) {
    // Nothing more to learn: the selection gives these to the engine.
  } else if (!device.is_cuda() && tensors.size() == 1) {
    shared = shared_.find(tensors[0]);
    if (shared.buffer != nullptr) in.shared_buffer_id = shared.buffer->id();
    in.in_symmetric_heap = shared.heap != nullptr;
  } else if (cuda_ != nullptr && tensors.size() == 1) {
    in.in_symmetric_heap = cuda_->in_heap(tensors[0]);
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
    refuse_with_peers(Collective::kAllreduce, "all_reduce", tensors, opts.timeout,
                      [&] { fallbacks_.refuse_what_gloo_cannot_reduce(tensors, "all_reduce"); });
    return fallbacks_.allreduce(group_, tensors, opts, coalesced, sel.avg_as_sum_then_divide);
  }
  check_native_call(Collective::kAllreduce, "all_reduce", device.is_cuda(), opts.timeout,
                    [&] { check_written("all_reduce", tensors); });
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

bool XdevBackend::supportsTensorAlloc(c10::DeviceIndex device) {
  if (device < 0) return shared_.heap_available();
  const CudaGroupInfo* info = cuda_ ? cuda_->info() : nullptr;
  return info != nullptr && info->device == device && cuda_->heap_state().on;
}

at::Tensor XdevBackend::allocateTensor(long size, at::TensorOptions options) {
  const CallGate::Entry entry = gate_.enter();
  const bool cuda = options.has_device() && options.device().is_cuda();
  TORCH_CHECK_VALUE(!options.has_device() || options.device().is_cpu() || cuda,
                    "xdev allocateTensor: only CPU and CUDA tensors; got ", options.device());
  const at::ScalarType dtype = options.has_dtype()
                                   ? c10::typeMetaToScalarType(options.dtype())
                                   : c10::typeMetaToScalarType(at::get_default_dtype());
  if (cuda) {
    const CudaGroupInfo* info = cuda_ ? cuda_->info() : nullptr;
    // "cuda" without an index: the group's GPU.
    const int wanted = options.device().has_index() ? options.device().index()
                                                    : (info != nullptr ? info->device : -1);
    // The heap itself (on or off) is checked under its lock: allocate_tensor.
    TORCH_CHECK_VALUE(info != nullptr && info->device == wanted,
                      "xdev allocateTensor: this group has no CUDA heap for ", options.device(),
                      " (",
                      cuda_ == nullptr  ? "this build of torch_xdev has no CUDA path"
                      : info == nullptr ? "no CUDA collective has run on it yet"
                                        : "its GPU is cuda:" + std::to_string(info->device),
                      ")");
  }
  if (at::isComplexType(dtype)) {
    // PyTorch's Reducer (2.13, 2.14) takes the real view of a complex bucket only when it
    // allocates the bucket itself, and fails on one from allocateTensor. A complex tensor is
    // what the call asks for (FSDP2 uses it so), so it is returned; the warning names DDP's fix.
    TORCH_WARN_ONCE(
        "xdev allocateTensor: a complex tensor. If this is a DDP bucket, PyTorch's Reducer "
        "fails on it (\"setStorage: ... out of bounds\"): for a model with complex "
        "parameters set XDEV_SHARED_BUCKETS=0 (or DDP_DISABLE_COMM_MEM=1) before creating the "
        "process group, and DDP allocates its buckets itself.");
  }
  try {
    return cuda ? cuda_->allocate_tensor(size, dtype) : shared_.allocate(size, dtype);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

void XdevBackend::check_native_call(Collective collective, const char* name, bool cuda,
                                    std::chrono::milliseconds timeout,
                                    const std::function<void()>& check) {
  if (group_.channel() == nullptr) {
    // Across hosts the call runs in two levels, whose check meets the peers;
    // a world of one has none to meet, but its arguments are checked alike.
    if (two_level_ != nullptr) {
      two_level_->check_with_peers(collective, name, timeout, check);
    } else {
      check();
    }
    return;
  }
  if (cuda && !group_.config().cuda_host_check) {
    // Without the host's check the peers meet in the GPU barrier, which
    // compares call hashes that include the sequence number: a refusal
    // still takes its number, so this rank's next call cannot pass for the
    // one its peers wait in (they stop at a mismatch, or at the timeout).
    try {
      check();
    } catch (const std::exception&) {
      group_.pass_turn(collective, name);
      throw;
    }
    return;
  }
  group_.check_with_peers(collective, name, timeout, check);
}

void XdevBackend::prepare_cuda_graph_capture(int device) {
  const CallGate::Entry entry = gate_.enter();
  TORCH_CHECK_VALUE(cuda_ != nullptr, "xdev: this build of torch_xdev has no CUDA path");
  cuda_->ensure_ready(device);
  fallbacks_.open_cuda_engine(device);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  refuse_with_peers(Collective::kAllreduce, "all_reduce", tensors, opts.timeout,
                    [&] { refuse_avg_of_bool("all_reduce", opts.reduceOp, tensors); });
  return dispatch_allreduce(tensors, opts, false);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  refuse_with_peers(Collective::kAllreduce, "all_reduce_coalesced", tensors, opts.timeout,
                    [&] { refuse_avg_of_bool("all_reduce_coalesced", opts.reduceOp, tensors); });
  return dispatch_allreduce(tensors, opts, true);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  ++collectives_called_;
  const auto record = [this](const char* path, const std::string& reason) {
    if (group_.config().debug) {  // no strings built per call without the log
      group_.log_once(std::string("broadcast:") + path + reason,
                      std::string("broadcast -> ") + path + " (" + reason + ")");
    }
    std::lock_guard<std::mutex> lock(selection_mutex_);
    last_broadcast_ = {path, reason};
  };
  std::string refusal;
  if (cpu_ == nullptr && two_level_broadcast_ == nullptr) {
    // Why the group has no channel (algorithm='fallback', a world of one).
    const std::string no_channel = group_.no_channel_reason();
    refusal = group_.num_hosts() > 1 ? "across hosts: " + two_level_note_
              : !no_channel.empty()  ? no_channel
                                     : "no shared memory between the ranks";
  } else if (tensors.size() > 1 || opts.rootTensor != 0) {
    // c10d's rule for a list (Gloo's): the root's rootTensor goes to every
    // tensor of every rank. The native path broadcasts one tensor.
    refusal =
        tensors.size() > 1 ? "several tensors in one call" : "a root tensor other than the first";
  }
  for (const at::Tensor& t : tensors) {
    if (refusal.empty() && !(t.device().is_cpu() && t.layout() == at::kStrided)) {
      refusal = t.device().is_cuda() ? "CUDA tensors" : "tensors that are not strided CPU tensors";
    }
  }
  if (!refusal.empty()) {
    record("fallback", refusal);
    return fallbacks_.broadcast(group_, tensors, opts);
  }
  const auto check_root = [&] {
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "xdev broadcast: root rank ",
                      opts.rootRank, " is outside the group of ", size_);
  };
  const auto check = [&] {
    check_root();
    // The root's tensor too: the staged paths copy every rank's result back.
    check_written("broadcast (which writes the root's tensor too)", tensors);
  };
  if (two_level_broadcast_ != nullptr) {  // across hosts: two levels or the engine's tree
    const plan::AcrossHostsChoice c =
        plan::choose_broadcast_across_hosts({group_.num_hosts(), group_.local_world_size()},
                                            plan::model_bucket_bytes(payload_bytes(tensors)),
                                            two_level_->network(), two_level_->host_model());
    record(c.two_level ? "two_level" : "fallback", c.reason);
    if (!c.two_level) {
      check_root();  // alone: Gloo's peers would not meet a refusal
      return fallbacks_.broadcast(group_, tensors, opts);
    }
    check_native_call(Collective::kBroadcast, "broadcast", false, opts.timeout, check);
    return two_level_broadcast_->broadcast(tensors, static_cast<int>(opts.rootRank), opts.timeout,
                                           opts.asyncOp);
  }
  record("native", "one host: staged through shared memory");
  check_native_call(Collective::kBroadcast, "broadcast", false, opts.timeout, check);
  return cpu_->broadcast(tensors, static_cast<int>(opts.rootRank), opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::barrier(const c10d::BarrierOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  ++collectives_called_;
  // On the group's queue, so behind this rank's native collectives. Before
  // its barrier it waits for the work this rank handed to the engines before
  // it (not after: that may need a peer waiting in this barrier), as
  // Gloo's barrier waits for its work in progress, and, like NCCL's, for this
  // rank's GPU collectives.
  CudaCollectives* cuda = cuda_.get();
  auto before = [this, cuda, handed = fallbacks_.take_work_in_flight(), timeout = opts.timeout] {
    FallbackEngines::wait_for(handed, group_.deadline_for(timeout));
    if (cuda && cuda->info()) cuda->synchronize();
  };
  if (cpu_ != nullptr) return cpu_->barrier(opts.timeout, opts.asyncOp, before);
  if (size_ == 1) {
    return group_.enqueue(c10d::OpType::BARRIER, "xdev:barrier", {}, before, opts.asyncOp);
  }
  // No shared memory over the whole group (ranks on several hosts): Gloo's
  // barrier. It is handed to Gloo here, on the caller's thread, as every
  // collective xdev hands on is: Gloo pairs its calls across ranks in the
  // order they reach it, so a barrier handed on later, from the queue, could
  // cross a collective this thread hands on meanwhile (an async barrier, then
  // an all-to-all) on one rank and not on another. Gloo's barrier waits for
  // the work handed to Gloo before it. On the queue, behind this rank's
  // two-level collectives, the ranks then meet again over the paths those
  // use, so that no rank leaves the barrier while another still runs one.
  c10d::Backend* gloo = fallbacks_.gloo();
  c10d::BarrierOptions engine_opts = opts;
  engine_opts.asyncOp = true;
  c10::intrusive_ptr<c10d::Work> engine_barrier = fallbacks_.track(gloo->barrier(engine_opts));
  TwoLevelAllreduce* two_level = two_level_.get();
  return group_.enqueue(
      c10d::OpType::BARRIER, "xdev:barrier", {},
      [this, before, engine_barrier, two_level, timeout = opts.timeout] {
        before();
        if (two_level != nullptr) two_level->barrier(group_.deadline_for(timeout));
        engine_barrier->wait();
      },
      opts.asyncOp);
}

void XdevBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const CallGate::Entry entry = gate_.enter();
  delegated_call().gloo()->monitoredBarrier(opts, wait_all_ranks);
}

}  // namespace xdev::backend
