// Python bindings of torch_xdev._C.
//
// The backend is exposed as a subclass of torch's c10d Backend so that
// ProcessGroup can register it. Its holder drops the GIL before the last
// reference goes away, because destruction joins the worker thread, which may
// be waiting on peers.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <optional>

#include "../plan/selection.h"
#include "../plan/topology.h"
#include "../transport/shm_segment.h"
#include "backend_config.h"
#include "config_bindings.h"
#include "detached_teardown.h"
#include "plan_bindings.h"
#include "setup_waits.h"
#include "topology_bindings.h"
#include "xdev_backend.h"

namespace py = pybind11;

namespace xdev::backend {

template <typename T>
class GilReleasingHolder {
 public:
  GilReleasingHolder() = default;
  explicit GilReleasingHolder(T* p) : impl_(c10::intrusive_ptr<T>::reclaim(p)) {}
  explicit GilReleasingHolder(c10::intrusive_ptr<T> p) : impl_(std::move(p)) {}
  GilReleasingHolder(const GilReleasingHolder&) = default;
  GilReleasingHolder(GilReleasingHolder&&) noexcept = default;
  GilReleasingHolder& operator=(const GilReleasingHolder&) = default;
  GilReleasingHolder& operator=(GilReleasingHolder&&) noexcept = default;
  ~GilReleasingHolder() {
    if (impl_ && PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      impl_.reset();
    }
  }
  T* get() const noexcept { return impl_.get(); }

 private:
  c10::intrusive_ptr<T> impl_;
};

}  // namespace xdev::backend

PYBIND11_DECLARE_HOLDER_TYPE(T, xdev::backend::GilReleasingHolder<T>, true)

namespace xdev::backend {
namespace {

// The CUDA half: what the first CUDA collective found (None-valued before it).
py::dict describe_cuda(const XdevBackend& b) {
  py::dict d;
  const CudaCollectives* cuda = b.cuda();
  const CudaGroupInfo* info = cuda ? cuda->info() : nullptr;
  d["built"] = cuda != nullptr;
  d["initialized"] = info != nullptr;
  d["cuda_slot_bytes"] = b.config().cuda_slot_bytes;
  d["cuda_host_check"] = b.config().cuda_host_check;
  const std::string fallback = b.cuda_fallback_name();
  d["fallback_backend"] = fallback.empty() ? py::object(py::none()) : py::object(py::str(fallback));
  if (info == nullptr) {
    d["note"] = cuda == nullptr ? "this build of torch_xdev has no CUDA path (CPU-only torch, or "
                                  "no GPU): CUDA tensors go to the fallback engine"
                                : "decided by the group's first collective on CUDA tensors";
    d["ddp_shared_buckets"] = false;
    d["ddp_shared_buckets_note"] = d["note"];
    d["heap"] = py::none();
    return d;
  }
  d["device"] = info->device;
  d["gpus"] = info->gpus;
  d["topology_class"] = plan::to_string(info->topology);
  d["nvswitch"] = info->nvswitch;
  d["model"] = info->model ? py::object(py::str(info->model->name())) : py::none();
  d["topology_source"] = info->topology_source;
  d["nvlink"] = info->nvlink.to_rows();
  d["reachable"] = info->reachable.to_rows();
  d["ranks_share_gpu"] = info->ranks_share_gpu;
  d["mps"] = info->mps;
  d["gpu_time_sliced"] = info->gpu_time_sliced;
  d["transport"] = info->transport;
  d["transport_note"] = info->transport_note;
  const CudaHeapState heap = cuda->heap_state();
  d["ddp_shared_buckets"] = heap.on;
  d["ddp_shared_buckets_note"] = heap.note;
  if (const std::optional<CudaHeapUsage> usage = cuda->heap_usage()) {
    py::dict h;
    h["bytes_reserved"] = usage->bytes_reserved;
    h["bytes_in_use"] = usage->bytes_in_use;
    h["live_blocks"] = usage->live_blocks;
    h["in_place_allreduces"] = usage->in_place_allreduces;
    d["heap"] = h;
  } else {
    d["heap"] = py::none();
  }
  return d;
}

// The plan an allreduce of 4 KiB, 1 MiB and 64 MiB would get: {bytes: (algorithm, reason)}.
py::dict plan_by_size(const XdevBackend& b, bool cuda) {
  py::dict per_size;
  for (int64_t bytes : {int64_t{4} << 10, int64_t{1} << 20, int64_t{64} << 20}) {
    const auto [path, reason] = XdevBackend::shown_selection(b.selection_for(bytes, cuda));
    per_size[py::int_(bytes)] = py::make_tuple(path, reason);
  }
  return per_size;
}

py::dict describe(const XdevBackend& b) {
  const CallGate::Entry entry = b.enter_to_describe();
  const BackendConfig& c = b.config();
  py::dict d;
  d["backend"] = "xdev";
  describe_options(c, d);
  d["options_note"] = b.options_note();
  d["rank"] = b.getRank();
  d["world_size"] = b.getSize();
  d["local_world_size"] = b.local_world_size();
  d["host_cores"] = b.host_cores();
  d["worker_has_own_core"] = b.worker_has_own_core();
  d["num_hosts"] = b.num_hosts();
  d["hostname"] = c.hostname;
  d["shared_memory"] = b.has_shared_memory();
  d["two_level"] = b.two_level_available();
  d["two_level_note"] = b.two_level_note();
  d["single_copy"] = b.single_copy_available();
  d["single_copy_note"] = b.single_copy_note();
  d["shared_buffers"] = b.live_shared_buffers();
  d["ddp_shared_buckets"] = b.heap_available();
  d["ddp_shared_buckets_note"] = b.heap_note();
  if (const std::shared_ptr<const transport::SymmetricHeap> heap = b.heap()) {
    py::dict h;
    h["arenas"] = heap->arenas();
    h["bytes_reserved"] = heap->bytes_reserved();
    h["bytes_in_use"] = heap->bytes_in_use();
    h["live_blocks"] = heap->live_blocks();
    h["in_place_collectives"] = heap->in_place_collectives();
    h["staged_collectives"] = heap->staged_collectives();
    d["symmetric_heap"] = h;
  } else {
    d["symmetric_heap"] = py::none();
  }
  d["fallback_backend"] = b.fallback_name();
  d["cpu_topology"] = plan::to_string(plan::TopologyClass::kFullyConnected);
  d["cpu_allreduce_plan"] = plan_by_size(b, false);
  if (const plan::MachineModel* m = b.cpu_model()) {
    py::dict model;
    model["name"] = m->name();
    model["source"] = m->source;
    model["core_gbps"] = c.cpu_core_gbps;
    model["memory_gbps"] = c.cpu_memory_gbps;
    model["launch_us"] = c.cpu_launch_us;
    model["barrier_us"] = c.cpu_barrier_us;
    model["step_us"] = c.cpu_step_us;
    model["sleeping_barrier_us"] = c.cpu_sleeping_barrier_us;
    model["window_bytes"] = m->window_bytes;
    if (const plan::NetworkParams* net = b.network_model()) {
      // Across hosts: the model above is each host's, and these join them.
      model["net_host_gbps"] = c.net_host_gbps;
      model["net_stream_gbps"] = c.net_stream_gbps;
      model["net_latency_us"] = c.net_latency_us;
      model["net_host_cores"] = net->host_cores;
    }
    d["cpu_cost_model"] = model;
  } else {
    d["cpu_cost_model"] = py::none();
  }
  d["cuda"] = describe_cuda(b);
  d["cuda_allreduce_plan"] = plan_by_size(b, true);
  const std::vector<std::string> last_gs = b.last_gather_scatter();
  d["last_gather_scatter"] = last_gs.empty()
                                 ? py::object(py::none())
                                 : py::object(py::make_tuple(last_gs[0], last_gs[1], last_gs[2]));
  const auto broadcast = b.last_broadcast();
  d["last_broadcast"] = broadcast.first.empty()
                            ? py::object(py::none())
                            : py::object(py::make_tuple(broadcast.first, broadcast.second));
  const auto last = b.last_selection();
  d["last_allreduce"] = last.first.empty() ? py::object(py::none())
                                           : py::object(py::make_tuple(last.first, last.second));
  return d;
}

}  // namespace
}  // namespace xdev::backend

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using xdev::backend::BackendConfig;
  using xdev::backend::GilReleasingHolder;
  using xdev::backend::XdevBackend;
  py::module_::import("torch.distributed");  // registers c10d's Backend and Store types

  xdev::backend::bind_config(m);

  py::class_<XdevBackend, c10d::Backend, GilReleasingHolder<XdevBackend>>(m, "XdevBackend")
      .def(py::init([](c10d::Store* store, int rank, int size, const BackendConfig& config,
                       c10d::Backend* fallback, c10d::Backend* cuda_fallback,
                       py::handle cross_host_engine) {
             TORCH_CHECK_VALUE(store != nullptr, "store must not be None");
             TORCH_CHECK_VALUE(fallback != nullptr, "fallback must not be None");
             // Take our own references on objects Python also holds.
             auto store_ref = c10::intrusive_ptr<c10d::Store>::reclaim_copy(store);
             auto fallback_ref = c10::intrusive_ptr<c10d::Backend>::reclaim_copy(fallback);
             c10::intrusive_ptr<c10d::Backend> cuda_ref;
             if (cuda_fallback != nullptr) {
               cuda_ref = c10::intrusive_ptr<c10d::Backend>::reclaim_copy(cuda_fallback);
             }
             XdevBackend::EngineFactory make_engine;
             if (!cross_host_engine.is_none()) {
               // A handle, not an owner: this runs without the GIL. It is called
               // during construction only, while the caller's argument lives.
               make_engine = [factory = cross_host_engine](const std::string& prefix,
                                                           int engine_rank, int engine_size) {
                 py::gil_scoped_acquire gil;
                 py::object engine = factory(prefix, engine_rank, engine_size);
                 auto* raw = engine.cast<c10d::Backend*>();
                 TORCH_CHECK_VALUE(raw != nullptr, "cross_host_engine returned None");
                 return c10::intrusive_ptr<c10d::Backend>::reclaim_copy(raw);
               };
             }
             return GilReleasingHolder<XdevBackend>(c10::make_intrusive<XdevBackend>(
                 store_ref, rank, size, config, fallback_ref, cuda_ref, make_engine));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("config"),
           py::arg("fallback"), py::arg("cuda_fallback") = py::none(),
           py::arg("cross_host_engine") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("describe", &xdev::backend::describe)
      .def("options_note", &XdevBackend::options_note)
      .def(
          "shared_empty",
          [](XdevBackend& b, const std::vector<int64_t>& sizes, at::ScalarType dtype) {
            // It waits on peers through the store, so without the GIL; its errors
            // become Python exceptions once the GIL is back.
            at::Tensor tensor;
            std::optional<std::invalid_argument> bad_value;
            std::optional<std::string> peer_failure;  // a peer gone or in another call
            std::optional<std::runtime_error> failure;
            {
              py::gil_scoped_release no_gil;
              try {
                tensor = b.shared_empty(sizes, dtype);
              } catch (const std::invalid_argument& e) {
                bad_value.emplace(e.what());
              } catch (const c10::DistBackendError& e) {
                peer_failure.emplace(e.what_without_backtrace());
              } catch (const c10::Error& e) {
                failure.emplace(e.what_without_backtrace());
              } catch (const std::exception& e) {
                failure.emplace(e.what());
              }
            }
            if (bad_value) throw py::value_error(bad_value->what());
            if (peer_failure) {
              // As a collective raises it: torch.distributed.DistBackendError.
              const py::object error_type =
                  py::module_::import("torch.distributed").attr("DistBackendError");
              PyErr_SetString(error_type.ptr(), peer_failure->c_str());
              throw py::error_already_set();
            }
            if (failure) throw *failure;
            return tensor;
          },
          py::arg("sizes"), py::arg("dtype"))
      .def("prepare_cuda_graph_capture", &XdevBackend::prepare_cuda_graph_capture,
           py::arg("device"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("shm_name", &XdevBackend::shm_name)
      .def_property_readonly("worker_has_own_core", &XdevBackend::worker_has_own_core)
      // c10d's split_group deep-copies it for the children (ProcessGroupNCCL and Gloo bind it too).
      .def_property_readonly("options", &XdevBackend::getBackendOptions)
      // new_group calls it on the ranks outside a new group where the default group is
      // bound to a device and can split (NCCL's ncclCommSplit needs every rank): xdev's
      // groups meet on the store, so those ranks have nothing to do.
      .def(
          "perform_nocolor_split", [](XdevBackend&, const py::object&) {}, py::arg("device"))
      .def(
          "_set_split_options",
          [](XdevBackend& b, const std::string& options_json) {
            // The splitter holds no Python object (the group may go on a
            // thread that must not take the GIL): it looks the creator up,
            // and hands it this group's options as text ("" for none).
            b.set_splitter([options_json](const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                          int size, std::chrono::milliseconds timeout,
                                          const std::string& group_name,
                                          const std::vector<int64_t>& global_ranks) {
              py::gil_scoped_acquire gil;
              py::object child = py::module_::import("torch_xdev._registration")
                                     .attr("split_backend")(options_json, store, rank, size,
                                                            timeout, group_name, global_ranks);
              auto* raw = child.cast<c10d::Backend*>();
              TORCH_CHECK(raw != nullptr, "xdev split: the creator returned None");
              return c10::intrusive_ptr<c10d::Backend>::reclaim_copy(raw);
            });
          },
          py::arg("options_json"));

  // What Backend.options gives for an xdev group; c10d's split_group deep-copies it.
  py::class_<xdev::backend::XdevBackendOptions, c10d::Backend::Options,
             c10::intrusive_ptr<xdev::backend::XdevBackendOptions>>(m, "XdevBackendOptions")
      .def("__deepcopy__", [](const xdev::backend::XdevBackendOptions& o, const py::dict&) {
        auto copy = c10::make_intrusive<xdev::backend::XdevBackendOptions>(o);
        return copy;
      });

  m.def("remove_orphaned_segments", &xdev::transport::ShmSegment::remove_orphans,
        "Unlinks /dev/shm segments left by xdev processes that no longer exist.");
  m.def(
      "wait_for_ranks",
      [](c10d::Store* store, const std::string& prefix, int world_size,
         std::chrono::milliseconds timeout, const std::string& what) {
        TORCH_CHECK_VALUE(store != nullptr, "store must not be None");
        xdev::backend::wait_for_ranks(*store, prefix, world_size, timeout, what);
      },
      py::arg("store"), py::arg("prefix"), py::arg("world_size"), py::arg("timeout"),
      py::arg("what"), py::call_guard<py::gil_scoped_release>(),
      "Returns once the store holds prefix + r for every rank r < world_size; at the timeout "
      "raises DistStoreError naming the ranks whose keys are missing and `what` they were to do.");
  m.def("wait_for_detached_teardowns", &xdev::backend::wait_for_detached_teardowns,
        py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
        "Waits for the threads that finish destroying groups whose last reference went on "
        "their own worker; returns whether none is left.");
  m.def(
      "detached_teardowns",
      []() {
        const xdev::backend::DetachedTeardownCounts c = xdev::backend::detached_teardown_counts();
        return py::make_tuple(c.started, c.in_flight);
      },
      "(started, in flight): threads that finish destroying a group, since the process began.");

  // The extension's C++ ABI is that of the torch it was compiled against;
  // torch_xdev's import compares it with the torch that loads it.
  m.attr("built_with_torch") = TORCH_VERSION;
#ifdef XDEV_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif

  xdev::backend::bind_plan(m);
  xdev::backend::bind_topology(m);
}
