#include "xdev_backend.h"

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <thread>

#include "../plan/collective_plan.h"
#include "../plan/machines.h"
#include "../plan/packing.h"
#include "../plan/shared_buffer_plan.h"

namespace xdev::backend {
namespace {

std::exception_ptr as_dist_error(const std::string& msg) {
  try {
    C10_THROW_ERROR(DistBackendError, msg);
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace

std::optional<kernels::DType> native_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kDouble:
      return kernels::DType::kFloat64;
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    case at::kChar:
      return kernels::DType::kInt8;
    case at::kByte:
      return kernels::DType::kUInt8;
    case at::kInt:
      return kernels::DType::kInt32;
    case at::kLong:
      return kernels::DType::kInt64;
    default:
      return std::nullopt;
  }
}

std::optional<kernels::ReduceOp> native_op(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return kernels::ReduceOp::kSum;
    case c10d::ReduceOp::AVG:
      return kernels::ReduceOp::kAvg;
    case c10d::ReduceOp::MIN:
      return kernels::ReduceOp::kMin;
    case c10d::ReduceOp::MAX:
      return kernels::ReduceOp::kMax;
    case c10d::ReduceOp::PRODUCT:
      return kernels::ReduceOp::kProduct;
    default:
      return std::nullopt;
  }
}

uint64_t shape_hash(const std::vector<at::Tensor>& tensors) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const at::Tensor& t : tensors) {
    mix(static_cast<uint64_t>(t.scalar_type()));
    mix(static_cast<uint64_t>(t.dim()));
    for (int64_t s : t.sizes()) mix(static_cast<uint64_t>(s));
  }
  return h;
}

int64_t payload_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  return bytes;
}

void store_barrier(c10d::Store& store, const std::string& prefix, int world_size,
                   std::optional<std::chrono::milliseconds> timeout) {
  if (store.add(prefix + "arrived", 1) == world_size) store.set(prefix + "all", "1");
  if (timeout) {
    store.wait({prefix + "all"}, *timeout);
  } else {
    store.wait({prefix + "all"});
  }
}

int64_t count_failures_across_ranks(c10d::Store& store, const std::string& prefix, bool failed,
                                    int world_size) {
  store.add(prefix + "failures", failed ? 1 : 0);
  store_barrier(store, prefix, world_size);
  return store.add(prefix + "failures", 0);
}

#ifndef XDEV_WITH_CUDA
std::unique_ptr<CudaCollectives> make_cuda_collectives(XdevBackend&) {
  return nullptr;  // this build has no CUDA: CUDA tensors go to the fallback engines
}
#endif

XdevBackend::XdevBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         BackendConfig config, c10::intrusive_ptr<c10d::Backend> fallback,
                         c10::intrusive_ptr<c10d::Backend> cuda_fallback)
    : c10d::Backend(rank, size),
      config_(std::move(config)),
      store_(store),
      cuda_fallback_(std::move(cuda_fallback)),
      fallback_(std::move(fallback)) {
  TORCH_CHECK(fallback_, "xdev: a fallback backend is required");
  fallback_name_ = fallback_->getBackendName();
  requested_ = plan::algorithm_from_string(config_.algorithm);
  packing_.num_packs = config_.num_packs < 0 ? 0 : config_.num_packs;
  packing_.agg_small_grads_max_bytes = config_.agg_small_grads_max_bytes;
  packing_.agg_small_grads_max_group = config_.agg_small_grads_max_group;
  packing_.bytes_per_pack = config_.bytes_per_pack;
  packing_.validate();
  plan::check_root("reduce_to_rank", static_cast<int>(config_.reduce_to_rank), size);
  if (config_.shm_slot_bytes < 4096) {
    throw std::invalid_argument("shm_slot_bytes must be >= 4096; got " +
                                std::to_string(config_.shm_slot_bytes));
  }
  rendezvous_hosts(*store);
  plan::check_forced_algorithm(requested_, size, num_hosts_);
  if (num_hosts_ == 1 && size > 1 && requested_ != plan::Algorithm::kFallback) {
    open_shared_memory(*store);
  }
  if (executor_ != nullptr) {
    plan::CpuHostParams params;
    params.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    params.core_bytes_per_s = config_.cpu_core_gbps * 1e9;
    params.memory_bytes_per_s = config_.cpu_memory_gbps * 1e9;
    params.launch_latency_s = config_.cpu_launch_us * 1e-6;
    params.barrier_latency_s = config_.cpu_barrier_us * 1e-6;
    params.step_latency_s = config_.cpu_step_us * 1e-6;
    params.sleeping_barrier_latency_s = config_.cpu_sleeping_barrier_us * 1e-6;
    params.window_bytes = config_.shm_slot_bytes;
    cpu_model_ = std::make_unique<plan::MachineModel>(plan::cpu_host(size, params));
  }
  if (config_.cuda_slot_bytes < 4096 || config_.cuda_slot_bytes % 256 != 0) {
    throw std::invalid_argument("cuda_slot_bytes must be a multiple of 256 and >= 4096; got " +
                                std::to_string(config_.cuda_slot_bytes));
  }
  cuda_ = make_cuda_collectives(*this);
  queue_ = std::make_unique<WorkQueue>();
  if (config_.debug && rank == 0) {
    const plan::Selection small = selection_for(1, false);
    const plan::Selection large = selection_for(int64_t{1} << 30, false);
    std::fprintf(stderr,
                 "[xdev] group '%s': %d rank(s) on %d host(s), algorithm=%s, num_packs=%lld, "
                 "shared memory %s; CPU allreduce: small -> %s (%s), large -> %s (%s); "
                 "fallback engine: %s\n",
                 config_.group_name.c_str(), size, num_hosts_, config_.algorithm.c_str(),
                 static_cast<long long>(config_.num_packs), executor_ ? "on" : "off",
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
  std::unique_ptr<WorkQueue> queue;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    queue = std::move(queue_);
  }
  if (!queue) return;
  queue.reset();  // runs what is queued, then joins the worker
  if (cuda_) cuda_->shutdown();
  single_copy_.reset();
  shared_executor_.reset();
  executor_.reset();
  channel_.reset();
  fallback_->shutdown();
  if (cuda_fallback_) cuda_fallback_->shutdown();
  std::lock_guard<std::mutex> lock(queue_mutex_);
  // Gloo's destructor joins its threads (NCCL's its watchdog): do it without the GIL.
  fallback_.reset();
  cuda_fallback_.reset();
}

c10d::Backend* XdevBackend::fallback() const {
  TORCH_CHECK(fallback_, "xdev: this process group has been destroyed");
  return fallback_.get();
}

c10d::Backend* XdevBackend::fallback_for(const at::Tensor& tensor) {
  c10d::Backend* gloo = fallback();
  if (!tensor.is_cuda() || !cuda_fallback_) return gloo;
  if (cuda_ != nullptr) {
    // NCCL refuses two ranks on one GPU; the first CUDA collective finds out.
    const CudaGroupInfo& info = cuda_->ensure_ready(tensor.get_device());
    if (info.ranks_share_gpu) return gloo;
  }
  return cuda_fallback_.get();
}

c10d::Backend* XdevBackend::fallback_for(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.is_cuda()) return fallback_for(t);
  }
  return fallback();
}

c10d::Backend* XdevBackend::p2p_engine(const std::vector<at::Tensor>& tensors) {
  const bool any_cuda =
      std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.is_cuda(); });
  if (!any_cuda || !cuda_fallback_) return fallback();
  const CudaGroupInfo* info = cuda_ ? cuda_->info() : nullptr;
  return info != nullptr && info->ranks_share_gpu ? fallback() : cuda_fallback_.get();
}

std::string XdevBackend::cuda_fallback_name() const {
  if (!cuda_fallback_) return fallback_name_;
  const CudaGroupInfo* info = cuda_ ? cuda_->info() : nullptr;
  if (cuda_ && info == nullptr) return "";
  return info != nullptr && info->ranks_share_gpu ? fallback_name_
                                                  : cuda_fallback_->getBackendName();
}

void XdevBackend::rendezvous_hosts(c10d::Store& store) {
  store.set("xdev/host/" + std::to_string(rank_), config_.hostname);
  std::set<std::string> hosts;
  local_world_size_ = 0;
  for (int r = 0; r < size_; ++r) {
    const std::string host = store.get_to_str("xdev/host/" + std::to_string(r));
    hosts.insert(host);
    if (host == config_.hostname) ++local_world_size_;
  }
  num_hosts_ = static_cast<int>(hosts.size());
}

// Rank 0 creates the segment and publishes its name; once every rank has
// mapped it (counted through the store), rank 0 unlinks the name, so the
// memory disappears with the last process that maps it, crash or not.
void XdevBackend::open_shared_memory(c10d::Store& store) {
  const auto slot_bytes = static_cast<size_t>(config_.shm_slot_bytes);
  transport::ShmChannel channel;
  if (rank_ == 0) {
    transport::ShmSegment::remove_orphans();
    const std::string name = transport::ShmSegment::make_name();
    channel = transport::ShmChannel::create(name, size_, rank_, slot_bytes);
    store.set("xdev/shm/name", name);
  } else {
    const std::string name = store.get_to_str("xdev/shm/name");
    channel = transport::ShmChannel::attach(name, size_, rank_, slot_bytes);
  }
  store_barrier(store, "xdev/shm/attached/", size_);
  if (rank_ == 0) channel.unlink_name();
  channel_ = std::make_unique<transport::ShmChannel>(std::move(channel));
  executor_ = std::make_unique<transport::ShmExecutor>(*channel_);
  shared_executor_ = std::make_unique<transport::SharedBufferExecutor>(*channel_);

  // Single copy needs every rank to read every peer: each rank probes, then
  // all agree through the store, so the transport choice is the same on all.
  std::string why = "disabled by Options.single_copy / XDEV_SINGLE_COPY";
  const bool mine_ok = config_.single_copy && channel_->can_read_peers(&why);
  if (config_.single_copy && !mine_ok) {
    // Asked for explicitly, so say why it is refused, on the rank that knows.
    std::fprintf(stderr, "[xdev] group '%s' rank %d: single copy unavailable, staying staged: %s\n",
                 config_.group_name.c_str(), rank_, why.c_str());
  }
  if (count_failures_across_ranks(store, "xdev/cma/", !mine_ok, size_) == 0) {
    single_copy_ = std::make_unique<transport::SingleCopyExecutor>(*channel_);
    single_copy_note_ = "on: ranks read each other's tensors with process_vm_readv";
  } else {
    single_copy_note_ =
        mine_ok ? "off: a peer cannot read this host's ranks (see its log)" : "off: " + why;
  }
}

// Each rank makes its own segment and publishes its name through the store;
// every rank maps every segment, and once all have (counted through the
// store) each unlinks its own name, so the memory goes with the last mapping.
at::Tensor XdevBackend::shared_empty(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t d : sizes) {
    if (d < 0) {
      // Formatted here: c10::str of an int64 array crashed with torch 2.11 (C++17).
      std::string shape;
      for (int64_t e : sizes) shape += (shape.empty() ? "" : ", ") + std::to_string(e);
      throw std::invalid_argument("torch_xdev.shared_empty: negative dimension " +
                                  std::to_string(d) + " in size [" + shape + "]");
    }
    numel *= d;
  }
  // A world of one has no one to share with: an ordinary tensor does the same.
  if (size_ == 1) return at::zeros(sizes, at::TensorOptions().dtype(dtype).device(at::kCPU));
  if (channel_ == nullptr) {
    throw std::invalid_argument(
        "torch_xdev.shared_empty needs all ranks of the group on one host (this group's " +
        std::to_string(size_) + " ranks are on " + std::to_string(num_hosts_) +
        " hosts); use an ordinary tensor");
  }
  const auto bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  constexpr size_t kPage = 4096;
  const size_t segment_bytes = (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
  int64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(shared_mutex_);
    id = next_shared_id_++;
  }
  const std::string prefix = "xdev/shared/" + std::to_string(id) + "/";
  transport::ShmSegment mine =
      transport::ShmSegment::create(transport::ShmSegment::make_name(), segment_bytes);
  store_->set(prefix + std::to_string(rank_), mine.name() + " " + std::to_string(bytes));
  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) keys.push_back(prefix + std::to_string(r));
  store_->wait(keys, config_.timeout);  // a rank that never calls it: the group's timeout
  std::vector<std::string> names(static_cast<size_t>(size_));
  std::string asked;
  bool same = true;
  for (int r = 0; r < size_; ++r) {
    const std::string entry = store_->get_to_str(keys[static_cast<size_t>(r)]);
    const size_t space = entry.rfind(' ');
    names[static_cast<size_t>(r)] = entry.substr(0, space);
    const std::string their_bytes = entry.substr(space + 1);
    same = same && their_bytes == std::to_string(bytes);
    asked += (r ? ", rank " : "rank ") + std::to_string(r) + ": " + their_bytes + " bytes";
  }
  // Every rank read the same entries, so every rank refuses together.
  if (!same) {
    throw std::invalid_argument("torch_xdev.shared_empty #" + std::to_string(id) +
                                ": ranks asked for different sizes (" + asked +
                                "); every rank must call it with the same size and dtype");
  }
  std::vector<transport::ShmSegment> segments(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) {
      segments[static_cast<size_t>(r)] =
          transport::ShmSegment::open(names[static_cast<size_t>(r)], segment_bytes);
    }
  }
  store_barrier(*store_, prefix + "mapped/", size_, config_.timeout);
  mine.unlink();
  segments[static_cast<size_t>(rank_)] = std::move(mine);
  auto buffer = std::make_shared<transport::SharedBuffer>(id, rank_, std::move(segments));
  {
    std::lock_guard<std::mutex> lock(shared_mutex_);
    auto expired = [](const std::weak_ptr<transport::SharedBuffer>& w) { return w.expired(); };
    shared_buffers_.erase(std::remove_if(shared_buffers_.begin(), shared_buffers_.end(), expired),
                          shared_buffers_.end());
    shared_buffers_.push_back(buffer);
  }
  // The tensor's storage owns the buffer: the mappings go when it does.
  void* data = buffer->data(rank_);
  return at::from_blob(
      data, sizes, [buffer](void*) mutable { buffer.reset(); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

int64_t XdevBackend::live_shared_buffers() const {
  std::lock_guard<std::mutex> lock(shared_mutex_);
  return std::count_if(
      shared_buffers_.begin(), shared_buffers_.end(),
      [](const std::weak_ptr<transport::SharedBuffer>& w) { return !w.expired(); });
}

XdevBackend::SharedPlacement XdevBackend::find_shared_buffer(const at::Tensor& t) const {
  if (!t.is_cpu() || !t.is_contiguous()) return {};
  const auto bytes = static_cast<size_t>(t.numel()) * t.element_size();
  std::lock_guard<std::mutex> lock(shared_mutex_);
  for (const auto& weak : shared_buffers_) {
    std::shared_ptr<transport::SharedBuffer> b = weak.lock();
    if (!b) continue;
    const int64_t offset = b->offset_of(t.data_ptr(), bytes);
    if (offset >= 0) return {std::move(b), offset};
  }
  return {};
}

std::string XdevBackend::shm_name() const {
  return channel_ ? channel_->name() : std::string();
}

void XdevBackend::log_once(const std::string& key, const std::string& message) {
  std::lock_guard<std::mutex> lock(log_mutex_);
  if (!config_.debug || !logged_.insert(key).second) return;
  std::fprintf(stderr, "[xdev] group '%s' rank %d: %s\n", config_.group_name.c_str(), rank_,
               message.c_str());
}

std::pair<std::string, std::string> XdevBackend::last_selection() const {
  std::lock_guard<std::mutex> lock(log_mutex_);
  return last_selection_;
}

plan::Selection XdevBackend::selection_for(int64_t payload, bool cuda) const {
  plan::SelectionInput in;
  in.requested = requested_;
  in.world_size = size_;
  in.num_hosts = num_hosts_;
  in.device = cuda ? plan::DeviceKind::kCuda : plan::DeviceKind::kCpu;
  if (cuda) {
    const CudaGroupInfo* info = cuda_ ? cuda_->info() : nullptr;
    // A world of one has no CUDA transport: its allreduce is NCCL's no-op.
    in.transport_available = info != nullptr && info->transport;
    if (info != nullptr) in.topology = info->topology;
  } else {
    in.transport_available = executor_ != nullptr || size_ == 1;
  }
  in.payload_bytes = payload;
  in.num_packs = config_.num_packs;
  const bool by_model =
      !cuda && cpu_model_ != nullptr && requested_ == plan::Algorithm::kAuto && num_hosts_ == 1;
  if (!by_model) return plan::select_allreduce(in);
  // Predict at the power of two at or above the payload, once per size class.
  int64_t bucket = 4;
  while (bucket < payload) bucket *= 2;
  std::lock_guard<std::mutex> lock(model_mutex_);
  auto it = model_choices_.find(bucket);
  if (it == model_choices_.end()) {
    in.payload_bytes = bucket;
    in.model = cpu_model_.get();
    it = model_choices_.emplace(bucket, plan::select_allreduce(in)).first;
  }
  return it->second;
}

const std::vector<plan::PackTree>& XdevBackend::pack_trees(int64_t num_packs) {
  std::lock_guard<std::mutex> lock(model_mutex_);
  auto it = pack_trees_.find(num_packs);
  if (it == pack_trees_.end()) {
    it = pack_trees_
             .emplace(num_packs, plan::balanced_pack_trees(plan::LinkMatrix::fully_connected(size_),
                                                           std::max<int64_t>(1, num_packs)))
             .first;
  }
  return it->second;
}

plan::PackingOptions XdevBackend::packing_for(const plan::Selection& sel) const {
  // The plan's pack count applies unless the user chose a packing.
  plan::PackingOptions packing = packing_;
  const bool user_packing =
      packing_.num_packs > 0 || packing_.bytes_per_pack > 0 ||
      (packing_.agg_small_grads_max_bytes > 0 && packing_.agg_small_grads_max_group > 0);
  if (!user_packing && sel.num_packs > 0) packing.num_packs = sel.num_packs;
  return packing;
}

transport::OpDescriptor XdevBackend::allreduce_descriptor(kernels::ReduceOp op, int32_t dtype,
                                                          const plan::Selection& sel,
                                                          int64_t num_packs, int64_t num_tensors,
                                                          int64_t total, uint64_t hash) {
  transport::OpDescriptor desc;
  desc.seq = ++next_seq_;
  desc.collective = static_cast<int32_t>(Collective::kAllreduce);
  desc.reduce_op = static_cast<int32_t>(op);
  desc.dtype = dtype;
  desc.algorithm = static_cast<int32_t>(sel.algorithm);
  desc.root = config_.reduce_to_rank;
  desc.num_packs = num_packs;
  desc.num_tensors = num_tensors;
  desc.total_elems = total;
  desc.shape_hash = hash;
  return desc;
}

transport::Clock::time_point XdevBackend::deadline_for(std::chrono::milliseconds timeout) const {
  const auto t = timeout == c10d::kUnsetTimeout ? config_.timeout : timeout;
  return transport::Clock::now() + t;
}

std::string XdevBackend::describe_op(const transport::OpDescriptor& d) const {
  std::string s;
  switch (static_cast<Collective>(d.collective)) {
    case Collective::kAllreduce:
      s = std::string("allreduce ") +
          kernels::to_string(static_cast<kernels::ReduceOp>(d.reduce_op)) + " " +
          kernels::to_string(static_cast<kernels::DType>(d.dtype)) + " via " +
          plan::to_string(static_cast<plan::Algorithm>(d.algorithm)) +
          (d.device == 1 ? " on CUDA tensors"
           : d.shared_buffer >= 0
               ? " in place in shared buffer #" + std::to_string(d.shared_buffer) + " at byte " +
                     std::to_string(d.shared_offset)
           : d.single_copy ? " (single copy)"
                           : " (staged)");
      break;
    case Collective::kBroadcast:
      s = "broadcast from rank " + std::to_string(d.root);
      break;
    case Collective::kBarrier:
      return "barrier (op #" + std::to_string(d.seq) + ")";
    default:
      s = "unknown collective";
  }
  return s + ", " + std::to_string(d.num_tensors) + " tensor(s), " + std::to_string(d.total_elems) +
         " element(s), shape hash " + std::to_string(d.shape_hash % 100000) + " (op #" +
         std::to_string(d.seq) + ")";
}

transport::OpContext XdevBackend::make_context(const transport::OpDescriptor& desc,
                                               const char* name,
                                               transport::Clock::time_point deadline) const {
  transport::OpContext ctx;
  ctx.descriptor = desc;
  ctx.deadline = deadline;
  ctx.what = std::string(name) + " (op #" + std::to_string(desc.seq) + ")";
  ctx.describe = [this](const transport::OpDescriptor& d) { return describe_op(d); };
  return ctx;
}

c10::intrusive_ptr<c10d::Work> XdevBackend::enqueue(c10d::OpType type, const char* title,
                                                    std::vector<at::Tensor> outputs,
                                                    std::function<void()> fn, bool async_op) {
  auto work = c10::make_intrusive<XdevWork>(rank_, type, title, std::move(outputs));
  enqueue_work(work, std::move(fn), async_op);
  return work;
}

void XdevBackend::enqueue_work(const c10::intrusive_ptr<XdevWork>& work, std::function<void()> fn,
                               bool async_op) {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  TORCH_CHECK(queue_ != nullptr, "xdev: this process group has been destroyed");
  auto task = [this, work, fn = std::move(fn)] {
    if (!poisoned_.empty()) {
      work->fail(as_dist_error("xdev: this group is unusable after an earlier failure (" +
                               poisoned_ + "); destroy it and create a new one"));
      return;
    }
    try {
      fn();
      work->complete();
    } catch (const transport::MismatchError& e) {
      work->fail(as_dist_error(e.what()));  // every rank stopped at the same barrier
    } catch (const transport::PeerError& e) {
      poisoned_ = e.what();
      work->fail(as_dist_error(e.what()));
    } catch (const std::exception& e) {
      poisoned_ = e.what();
      work->fail(as_dist_error(std::string("xdev: ") + e.what()));
    }
  };
  if (async_op) {
    queue_->submit(std::move(task));
  } else {
    queue_->run_inline_or_submit(std::move(task));
  }
}

c10::intrusive_ptr<c10d::Work> XdevBackend::native_allreduce(
    std::vector<at::Tensor> tensors, kernels::ReduceOp op, plan::Selection sel,
    std::chrono::milliseconds timeout, bool async_op, SharedPlacement shared) {
  return enqueue(
      c10d::OpType::ALLREDUCE, "xdev:all_reduce", tensors,
      [this, tensors, op, sel, timeout, shared]() {
        // Work on contiguous tensors; copy back into non-contiguous ones at the end.
        std::vector<at::Tensor> flat;
        std::vector<plan::TensorDesc> descs;
        for (const at::Tensor& t : tensors) {
          flat.push_back(t.contiguous());
          descs.push_back({static_cast<int>(*native_dtype(t.scalar_type())),
                           static_cast<size_t>(t.element_size()), t.numel()});
        }
        const auto deadline = deadline_for(timeout);
        if (size_ > 1) {  // a world of one already holds its result
          const uint64_t hash = shape_hash(tensors);
          for (const plan::DtypeGroup& group : plan::group_by_dtype(descs)) {
            const auto dtype = static_cast<kernels::DType>(group.dtype);
            const int64_t total = group.layout.total();
            if (shared.buffer != nullptr) {  // the one tensor, in a shared buffer
              transport::OpDescriptor desc =
                  allreduce_descriptor(op, group.dtype, sel, 0, 1, total, hash);
              desc.shared_buffer = shared.buffer->id();
              desc.shared_offset = shared.offset;
              transport::SharedBufferRequest req;
              req.buffer = shared.buffer.get();
              req.offset_bytes = shared.offset;
              req.count = total;
              req.dtype = dtype;
              req.op = op;
              req.ctx = make_context(desc, "allreduce", deadline);
              shared_executor_->run(req);
              continue;
            }
            const auto packs = plan::make_packs(group.layout, group.elem_size, packing_for(sel));
            const bool single_copy =
                plan::use_single_copy(sel.algorithm, total * static_cast<int64_t>(group.elem_size),
                                      group.tensor_indices.size() == 1, single_copy_ != nullptr);
            // Single copy runs the whole payload as one window: no slots to fill.
            const int64_t window_elems =
                single_copy ? std::max<int64_t>(total, 1)
                            : config_.shm_slot_bytes / static_cast<int64_t>(group.elem_size);
            const plan::CollectivePlan cp = plan::CollectivePlan::allreduce(
                sel.algorithm, size_, static_cast<int>(config_.reduce_to_rank), packs, total,
                window_elems,
                sel.algorithm == plan::Algorithm::kHierarchicalBalanced
                    ? pack_trees(static_cast<int64_t>(packs.size()))
                    : std::vector<plan::PackTree>{});
            transport::OpDescriptor desc =
                allreduce_descriptor(op, group.dtype, sel, static_cast<int64_t>(packs.size()),
                                     static_cast<int64_t>(tensors.size()), total, hash);
            desc.single_copy = single_copy ? 1 : 0;
            const transport::OpContext ctx = make_context(desc, "allreduce", deadline);
            if (single_copy) {
              // use_single_copy implies a non-empty payload: window 0 exists.
              const plan::Schedule in_place = plan::in_place_variant(cp.window(0).schedule);
              transport::SingleCopyRequest req;
              req.schedule = &in_place;
              req.data = static_cast<char*>(flat[group.tensor_indices[0]].data_ptr());
              req.count = total;
              req.dtype = dtype;
              req.op = op;
              req.ctx = ctx;
              single_copy_->run(req);
              continue;
            }
            transport::CollectiveRequest req;
            req.plan = &cp;
            req.layout = &group.layout;
            for (size_t idx : group.tensor_indices) {
              req.tensors.push_back(static_cast<char*>(flat[idx].data_ptr()));
            }
            req.dtype = dtype;
            req.op = op;
            req.ctx = ctx;
            executor_->run(req);
          }
        }
        for (size_t i = 0; i < tensors.size(); ++i) {
          if (!flat[i].is_same(tensors[i])) tensors[i].copy_(flat[i]);
        }
      },
      async_op);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::fallback_allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts,
                                                               bool coalesced) {
  c10d::Backend* engine = fallback_for(tensors);
  auto call = [&](const c10d::AllreduceOptions& o) {
    if (coalesced) {
      c10d::AllreduceCoalescedOptions co;
      co.reduceOp = o.reduceOp;
      co.timeout = o.timeout;
      return engine->allreduce_coalesced(tensors, co);
    }
    return engine->allreduce(tensors, o);
  };
  const bool has_avg = engine->getBackendName() == "nccl";
  if (opts.reduceOp.op_ != c10d::ReduceOp::AVG || has_avg) return call(opts);
  // Gloo has no AVG: SUM through it, then divide.
  c10d::AllreduceOptions sum = opts;
  sum.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  auto inner = call(sum);
  const int world = size_;
  std::vector<at::Tensor> outs = tensors;
  auto wait_and_divide = [inner, outs, world]() {
    inner->wait();
    for (const at::Tensor& t : outs) {
      if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
        t.div_(world, "trunc");
      } else {
        t.div_(world);
      }
    }
  };
  const bool cuda =
      std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.is_cuda(); });
  if (cuda) {
    // On CUDA tensors, wait() orders the caller's current stream after the
    // SUM, so dividing right here on that stream is ordered too. Synchronous,
    // but rare (ranks sharing a GPU without a native path).
    wait_and_divide();
    return inner;
  }
  // On the worker thread, so the returned Work completes only once the
  // division is done.
  return enqueue(c10d::OpType::ALLREDUCE, "xdev:all_reduce", outs, wait_and_divide,
                 /*async_op=*/true);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::dispatch_allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts,
                                                               bool coalesced) {
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
  plan::Selection sel = selection_for(payload_bytes(tensors), device.is_cuda());
  if (!native_ok && sel.algorithm != plan::Algorithm::kFallback) {
    sel.algorithm = plan::Algorithm::kFallback;
    sel.reason = "no native kernel for this reduce op / dtype";
  }
  SharedPlacement shared;
  if (sel.algorithm != plan::Algorithm::kFallback && !device.is_cuda() && tensors.size() == 1 &&
      plan::use_shared_buffer(requested_)) {
    shared = find_shared_buffer(tensors[0]);
    if (shared.buffer != nullptr) {
      sel.algorithm = plan::Algorithm::kFlat;
      sel.num_packs = 0;
      sel.reason = "tensor in shared buffer #" + std::to_string(shared.buffer->id()) +
                   " (torch_xdev.shared_empty): reduced in place, nothing staged";
    }
  }
  {
    std::lock_guard<std::mutex> lock(log_mutex_);
    last_selection_ = {plan::to_string(sel.algorithm), sel.reason};
  }
  log_once(std::string(device.is_cuda() ? "cuda:" : "cpu:") + plan::to_string(sel.algorithm) +
               sel.reason,
           std::string("allreduce on ") + (device.is_cuda() ? "CUDA" : "CPU") + " tensors -> " +
               plan::to_string(sel.algorithm) + " (" + sel.reason + ")");
  if (sel.algorithm == plan::Algorithm::kFallback) {
    return fallback_allreduce(tensors, opts, coalesced);
  }
  if (device.is_cuda()) {
    TORCH_CHECK(cuda_ != nullptr, "xdev: this build has no CUDA support");  // selection prevents it
    return cuda_->allreduce(tensors, *native_op(opts.reduceOp), sel, opts.timeout);
  }
  return native_allreduce(tensors, *native_op(opts.reduceOp), sel, opts.timeout, opts.asyncOp,
                          std::move(shared));
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  ++collectives_called_;
  return dispatch_allreduce(tensors, opts, false);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  ++collectives_called_;
  return dispatch_allreduce(tensors, opts, true);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  ++collectives_called_;
  bool native = executor_ != nullptr && opts.rootTensor == 0;
  for (const at::Tensor& t : tensors) {
    native = native && t.device().is_cpu() && t.layout() == at::kStrided;
  }
  if (!native) return fallback_for(tensors)->broadcast(tensors, opts);
  TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "xdev broadcast: root rank ",
                    opts.rootRank, " is outside the group of ", size_);
  const int root = static_cast<int>(opts.rootRank);
  return enqueue(
      c10d::OpType::BROADCAST, "xdev:broadcast", tensors,
      [this, tensors, root, opts]() {
        // Broadcast moves bytes: any dtype works, tensors are laid out as bytes.
        std::vector<at::Tensor> flat;
        std::vector<int64_t> byte_counts;
        for (const at::Tensor& t : tensors) {
          flat.push_back(t.contiguous());
          byte_counts.push_back(t.numel() * static_cast<int64_t>(t.element_size()));
        }
        const plan::FlatLayout layout(byte_counts);
        const plan::CollectivePlan cp =
            plan::CollectivePlan::broadcast(size_, root, layout.total(), config_.shm_slot_bytes);
        transport::CollectiveRequest req;
        req.plan = &cp;
        req.layout = &layout;
        for (at::Tensor& t : flat) req.tensors.push_back(static_cast<char*>(t.data_ptr()));
        req.dtype = kernels::DType::kUInt8;
        transport::OpDescriptor desc;
        desc.seq = ++next_seq_;
        desc.collective = static_cast<int32_t>(Collective::kBroadcast);
        desc.root = root;
        desc.num_tensors = static_cast<int64_t>(tensors.size());
        desc.total_elems = layout.total();
        desc.shape_hash = shape_hash(tensors);
        req.ctx = make_context(desc, "broadcast", deadline_for(opts.timeout));
        executor_->run(req);
        for (size_t i = 0; i < tensors.size(); ++i) {
          if (!flat[i].is_same(tensors[i])) tensors[i].copy_(flat[i]);
        }
      },
      opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::barrier(const c10d::BarrierOptions& opts) {
  ++collectives_called_;
  if (executor_ == nullptr) {
    if (size_ == 1) {
      return enqueue(
          c10d::OpType::BARRIER, "xdev:barrier", {},
          [this] {
            if (cuda_ && cuda_->info()) cuda_->synchronize();
          },
          false);
    }
    return fallback()->barrier(opts);
  }
  // Queued behind every earlier native collective of this rank, so when it
  // completes they have completed too.
  return enqueue(
      c10d::OpType::BARRIER, "xdev:barrier", {},
      [this, opts]() {
        // Like NCCL's barrier, it also waits for this rank's GPU collectives.
        if (cuda_ && cuda_->info()) cuda_->synchronize();
        transport::OpDescriptor desc;
        desc.seq = ++next_seq_;
        desc.collective = static_cast<int32_t>(Collective::kBarrier);
        executor_->barrier(make_context(desc, "barrier", deadline_for(opts.timeout)));
      },
      opts.asyncOp);
}

// ---- Delegated collectives -------------------------------------------------

c10::intrusive_ptr<c10d::Work> XdevBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  ++collectives_called_;
  return fallback_for(tensors)->reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  ++collectives_called_;
  return fallback_for(inputs)->allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  ++collectives_called_;
  return fallback_for(input)->_allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  ++collectives_called_;
  return fallback_for(inputs)->allgather_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  ++collectives_called_;
  return fallback_for(inputs)->allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::GatherOptions& opts) {
  ++collectives_called_;
  return fallback_for(inputs)->gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  ++collectives_called_;
  return fallback_for(outputs)->scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  ++collectives_called_;
  return fallback_for(outputs)->reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  ++collectives_called_;
  return fallback_for(input)->_reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  ++collectives_called_;
  return fallback_for(inputs)->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& output_split_sizes,
                                                          std::vector<int64_t>& input_split_sizes,
                                                          const c10d::AllToAllOptions& opts) {
  ++collectives_called_;
  return fallback_for(input)->alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                            opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  ++collectives_called_;
  return fallback_for(inputs)->alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                 int tag) {
  return p2p_engine(tensors)->send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                 int tag) {
  return p2p_engine(tensors)->recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                          int tag) {
  return p2p_engine(tensors)->recvAnysource(tensors, tag);
}

}  // namespace xdev::backend
