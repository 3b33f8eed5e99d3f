#include "plan_bindings.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../plan/cost_model.h"
#include "../plan/cuda_across_hosts.h"
#include "../plan/gather_scatter_predict.h"
#include "../plan/machines.h"
#include "../plan/packing.h"
#include "../plan/predict.h"
#include "../plan/schedule.h"
#include "../plan/selection.h"
#include "../plan/topology.h"
#include "../plan/two_level.h"
#include "backend_config.h"

namespace py = pybind11;

namespace xdev::backend {
namespace {

using Matrix = std::vector<std::vector<int64_t>>;

// A LinkMatrix of at least one device from a Python list of rows (rules:
// LinkMatrix::from_rows). Throws std::invalid_argument (ValueError).
plan::LinkMatrix link_matrix(const Matrix& rows) {
  if (rows.empty()) throw std::invalid_argument("link matrix is empty");
  return plan::LinkMatrix::from_rows(rows, "link matrix");
}

double positive_gbps(double gbps, const char* what) {
  if (!(gbps > 0) || !std::isfinite(gbps)) {
    throw std::invalid_argument(std::string(what) + " must be a finite number > 0, got " +
                                std::to_string(gbps));
  }
  return gbps * 1e9;
}

double non_negative_us(double us, const char* what) {
  if (!(us >= 0) || !std::isfinite(us)) {
    throw std::invalid_argument(std::string(what) + " must be a finite number >= 0, got " +
                                std::to_string(us));
  }
  return us / 1e6;
}

// What every prediction says, an allreduce's or a gather/scatter's: its
// candidate's kind ("ring", "nccl" or the plan's own name) under kind_key.
template <typename P>
py::dict prediction_dict(const P& p, const char* kind_key, const char* plan_name) {
  py::dict d;
  d["label"] = p.candidate.label();
  d[kind_key] = p.candidate.ring_reference ? "ring" : p.candidate.nccl ? "nccl" : plan_name;
  d["ring_reference"] = p.candidate.ring_reference;
  d["nccl"] = p.candidate.nccl;
  d["bytes"] = p.bytes;
  d["seconds"] = p.seconds;
  d["algbw"] = p.algbw;
  d["busbw"] = p.busbw;
  return d;
}

py::dict to_dict(const plan::Prediction& p) {
  py::dict d = prediction_dict(p, "algorithm", plan::to_string(p.candidate.algorithm));
  d["num_packs"] = p.candidate.num_packs;
  return d;
}

py::dict to_dict(const plan::GatherScatterPrediction& p) {
  py::dict d = prediction_dict(p, "form", plan::to_string(p.candidate.form));
  d["window_bytes"] = p.candidate.window_bytes;
  return d;
}

py::dict to_dict(const plan::NcclPrediction& p, int64_t bytes) {
  py::dict d;
  d["label"] = p.candidate.label();
  d["bytes"] = bytes;
  d["seconds"] = p.seconds;
  d["latency_s"] = p.latency_s;
  d["algbw"] = p.algbw;
  return d;
}

plan::GatherScatterKind gather_scatter_kind(const std::string& collective) {
  if (collective == "reduce_scatter") return plan::GatherScatterKind::kReduceScatter;
  if (collective == "all_gather") return plan::GatherScatterKind::kAllGather;
  throw std::invalid_argument("collective '" + collective +
                              "': use 'reduce_scatter' or 'all_gather'");
}

// Far beyond any tensor, and far enough below 2^63 that the plans' element,
// window and size-class arithmetic cannot overflow.
constexpr int64_t kMaxModelBytes = int64_t{1} << 50;  // 1 PiB

void check_bytes(int64_t nbytes, int64_t elem_bytes) {
  if (elem_bytes < 1) throw std::invalid_argument("elem_bytes must be >= 1");
  if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0");
  if (nbytes > kMaxModelBytes) {
    throw std::invalid_argument("nbytes must be at most 2^50 (1 PiB); got " +
                                std::to_string(nbytes));
  }
}

// MachineModel and the built-in and parametric machines.
void bind_machines(py::module_& m) {
  py::class_<plan::MachineModel>(m, "MachineModel")
      .def_property_readonly("name", &plan::MachineModel::name)
      .def_property_readonly("num_devices", &plan::MachineModel::num_devices)
      .def_readonly("source", &plan::MachineModel::source)
      .def_readonly("window_bytes", &plan::MachineModel::window_bytes)
      .def_readonly("launch_latency_s", &plan::MachineModel::launch_latency_s)
      .def_readonly("step_latency_s", &plan::MachineModel::step_latency_s)
      .def_readonly("barrier_latency_s", &plan::MachineModel::barrier_latency_s)
      .def_readonly("barrier_between_phases", &plan::MachineModel::barrier_between_phases)
      .def_property_readonly("has_nccl",
                             [](const plan::MachineModel& mm) { return mm.nccl.present; })
      .def(
          "links", [](const plan::MachineModel& mm) { return mm.links.to_rows(); },
          "Direct link counts per device pair (NVLinks; 1 per pair for a CPU host).")
      .def("__repr__", [](const plan::MachineModel& mm) {
        return "<MachineModel " + mm.name() + ": " + std::to_string(mm.num_devices()) + " devices>";
      });

  // Options.num_packs' bound; bytes_per_pack makes no more packs either.
  m.attr("MAX_PACKS") = plan::kMaxPacks;

  m.def("builtin_machine", &plan::builtin_machine, py::arg("name"),
        "A built-in machine model by name, one of builtin_machine_names() (e.g. hgx-h100, "
        "dgx1-v100, pcie-8gpu, cpu-<N>).");
  m.def("builtin_machine_names", &plan::builtin_machine_names);

  m.def(
      "gpu_machine",
      [](const std::string& name, const Matrix& links, double nvlink_gbps, double pcie_gbps,
         double memory_gbps, int compute_capability, const std::vector<int>& nvswitch) {
        plan::GpuHostParams p;
        p.nvlink_bytes_per_s = positive_gbps(nvlink_gbps, "nvlink_gbps");
        p.pcie_bytes_per_s = positive_gbps(pcie_gbps, "pcie_gbps");
        p.memory_bytes_per_s = positive_gbps(memory_gbps, "memory_gbps");
        if (compute_capability < 60) {
          throw std::invalid_argument("compute_capability must be >= 60 (major x 10 + minor)");
        }
        // The matrix counts pairs joined through NVSwitches too; the switches are their own
        // resource in the model, so the pairs keep only their direct links.
        const plan::LinkMatrix direct = plan::direct_links(link_matrix(links), nvswitch);
        plan::MachineModel mm = plan::gpu_host(name, direct, p, nvswitch);
        mm.nccl = plan::nccl_host_for(direct, nvswitch, compute_capability, p.pcie_bytes_per_s);
        mm.source = "GPU host '" + name + "' from a link matrix: NVLink " +
                    std::to_string(nvlink_gbps) + " GB/s per link and direction, PCIe " +
                    std::to_string(pcie_gbps) + " GB/s, memory " + std::to_string(memory_gbps) +
                    " GB/s";
        return mm;
      },
      py::arg("name"), py::arg("links"), py::arg("nvlink_gbps") = 25.0, py::arg("pcie_gbps") = 12.0,
      py::arg("memory_gbps") = 900.0, py::arg("compute_capability") = 70,
      py::arg("nvswitch") = std::vector<int>{},
      "GPUs joined by an NVLink count matrix (square, symmetric, diagonal ignored; pairs "
      "joined through NVSwitches count min(nvswitch[a], nvswitch[b]) on top of direct links) "
      "and, per GPU, NVLinks to NVSwitches (empty: none); bandwidths in GB/s (1e9 bytes/s); "
      "NCCL's candidates as for GPUs of that compute capability (major x 10 + minor; default "
      "70, the V100's NVLink 2).");

  m.def(
      "cpu_machine",
      [](int ranks, int cores, double core_gbps, double memory_gbps, double launch_us,
         double barrier_us, int64_t window_bytes, double step_us, double sleeping_barrier_us) {
        if (window_bytes < 0) throw std::invalid_argument("window_bytes must be >= 0");
        plan::CpuHostParams p;
        p.cores = cores;
        p.core_bytes_per_s = positive_gbps(core_gbps, "core_gbps");
        p.memory_bytes_per_s = positive_gbps(memory_gbps, "memory_gbps");
        p.launch_latency_s = non_negative_us(launch_us, "launch_us");
        p.barrier_latency_s = non_negative_us(barrier_us, "barrier_us");
        p.window_bytes = window_bytes;
        p.step_latency_s = non_negative_us(step_us, "step_us");
        p.sleeping_barrier_latency_s = non_negative_us(sleeping_barrier_us, "sleeping_barrier_us");
        return plan::cpu_host(ranks, p);
      },
      py::arg("ranks"), py::arg("cores"), py::arg("core_gbps"), py::arg("memory_gbps"),
      py::arg("launch_us"), py::arg("barrier_us"), py::arg("window_bytes"),
      py::arg("step_us") = plan::cpu_fit::kStepUs,
      py::arg("sleeping_barrier_us") = plan::cpu_fit::kSleepingBarrierUs,
      "One host's ranks exchanging through shared memory with the staged executor.");

  m.def(
      "shared_gpu_machine",
      [](int ranks, double memory_gbps, double launch_us, double step_us, int64_t window_bytes) {
        if (ranks < 1)
          throw std::invalid_argument("ranks must be >= 1, got " + std::to_string(ranks));
        if (window_bytes < 0) {
          throw std::invalid_argument("window_bytes must be >= 0 (0: one window), got " +
                                      std::to_string(window_bytes));
        }
        plan::GpuHostParams p;
        p.memory_bytes_per_s = positive_gbps(memory_gbps, "memory_gbps");
        p.launch_latency_s = non_negative_us(launch_us, "launch_us");
        p.step_latency_s = non_negative_us(step_us, "step_us");
        p.barrier_per_phase = true;
        p.window_bytes = window_bytes;
        return plan::shared_gpu_host(ranks, p);
      },
      py::arg("ranks"), py::arg("memory_gbps"), py::arg("launch_us"), py::arg("step_us"),
      py::arg("window_bytes") = plan::kCudaWindowBytes,
      "Ranks sharing one GPU with xdev's CUDA executor: every byte (local and peer reads, "
      "writes) through one memory of memory_gbps (GB/s, 1e9 bytes/s); launch_us once per call, "
      "step_us per barrier between phases (one flag hand-off); windows of window_bytes (the "
      "cuda_slot_bytes; 0: one window).");
}

// Predicted times of one plan, and the model's choice among them.
void bind_predictions(py::module_& m) {
  m.def(
      "predict",
      [](const plan::MachineModel& mm, const std::string& algorithm, int64_t num_packs,
         int64_t nbytes, int64_t elem_bytes, bool ring_reference) {
        check_bytes(nbytes, elem_bytes);
        plan::Candidate c;
        c.algorithm = plan::algorithm_from_string(algorithm);
        c.num_packs = num_packs;
        c.ring_reference = ring_reference;
        if (!ring_reference &&
            (c.algorithm == plan::Algorithm::kAuto || c.algorithm == plan::Algorithm::kFallback)) {
          throw std::invalid_argument("predict: '" + algorithm +
                                      "' is not a plan the cost model can run; use choose() "
                                      "for 'auto'");
        }
        plan::Prediction p;
        {
          py::gil_scoped_release no_gil;
          p = plan::predict_allreduce(mm, c, nbytes, elem_bytes);
        }
        return to_dict(p);
      },
      py::arg("machine"), py::arg("algorithm"), py::arg("num_packs"), py::arg("nbytes"),
      py::arg("elem_bytes") = 4, py::arg("ring_reference") = false,
      "Predicted time of one allreduce candidate; a dict with label, algorithm, num_packs, "
      "ring_reference, bytes, seconds, algbw and busbw (bytes/s).");

  m.def(
      "size_class",
      [](int64_t nbytes) {
        check_bytes(nbytes, 1);
        return plan::model_bucket_bytes(nbytes);
      },
      py::arg("nbytes"),
      "The size a group's automatic choice for a payload of nbytes is made at (and cached "
      "for): the power of two at or above it, at least 4.");

  m.def(
      "choose",
      [](const plan::MachineModel& mm, int64_t nbytes, int64_t num_packs, bool with_ring_reference,
         bool with_nccl) {
        check_bytes(nbytes, 1);
        plan::ModelChoice choice;
        {
          py::gil_scoped_release no_gil;
          choice = plan::choose_allreduce(mm, nbytes, num_packs, with_ring_reference, with_nccl);
        }
        py::list predictions;
        for (const plan::Prediction& p : choice.predictions) predictions.append(to_dict(p));
        py::dict d;
        d["best"] = to_dict(choice.best);
        d["best_native"] = to_dict(choice.best_native);
        d["best_nccl"] = choice.has_nccl ? py::object(to_dict(choice.best_nccl)) : py::none();
        d["predictions"] = predictions;
        return d;
      },
      py::arg("machine"), py::arg("nbytes"), py::arg("num_packs") = -1,
      py::arg("with_ring_reference") = true, py::arg("with_nccl") = true,
      "The fastest candidate ('best': native, or NCCL's where the machine has NCCL and "
      "with_nccl), the fastest native one ('best_native') and NCCL one ('best_nccl', None "
      "without), and every prediction behind the choice ('predictions': native, NCCL, ring "
      "reference).");

  m.def(
      "choose_gather_scatter",
      [](const plan::MachineModel& mm, const std::string& collective, int64_t nbytes,
         bool single_copy, bool in_place, bool with_ring_reference, int64_t elem_bytes,
         bool with_nccl) {
        check_bytes(nbytes, elem_bytes);
        const plan::GatherScatterKind kind = gather_scatter_kind(collective);
        plan::GatherScatterChoice choice;
        {
          py::gil_scoped_release no_gil;
          choice = plan::choose_gather_scatter(mm, kind, nbytes, {single_copy, in_place, with_nccl},
                                               with_ring_reference, elem_bytes);
        }
        py::list predictions;
        for (const plan::GatherScatterPrediction& p : choice.predictions) {
          predictions.append(to_dict(p));
        }
        py::dict d;
        d["best"] = to_dict(choice.best);
        d["predictions"] = predictions;
        return d;
      },
      py::arg("machine"), py::arg("collective"), py::arg("nbytes"), py::arg("single_copy") = true,
      py::arg("in_place") = true, py::arg("with_ring_reference") = true, py::arg("elem_bytes") = 4,
      py::arg("with_nccl") = true,
      "Reduce-scatter or all-gather of a full tensor of nbytes: the fastest candidate allowed "
      "('best': staged, plus single_copy / in_place where allowed, and NCCL's algorithms on a "
      "machine with NCCL unless with_nccl is False) and every prediction ('predictions': dicts "
      "with label, form ('nccl' for NCCL's), window_bytes, ring_reference, nccl, bytes, "
      "seconds, algbw and busbw; ring reference last).");

  m.def(
      "classify",
      [](const Matrix& links) {
        return std::string(plan::to_string(plan::classify(link_matrix(links))));
      },
      py::arg("links"), "'none', 'partial', 'fully_connected' or 'dgx1'.");
}

// Ranks on several hosts: predictions and traffic of the two-level plan and the flat ring.
void bind_across_hosts(py::module_& m) {
  m.def(
      "predict_cuda_across_hosts",
      [](const plan::MachineModel& mm, int num_hosts, int64_t nbytes, int nics, double nic_gbps,
         bool amd_cpu) {
        check_bytes(nbytes, 1);
        if (nics < 1) throw std::invalid_argument("nics must be >= 1");
        plan::NcclNetwork net;
        net.nodes = num_hosts;
        net.nics = nics;
        net.nic_gbps = positive_gbps(nic_gbps, "nic_gbps") / 1e9;
        net.amd_cpu = amd_cpu;
        plan::CudaAcrossHostsPrediction p;
        py::list candidates;
        {
          py::gil_scoped_release no_gil;
          p = plan::predict_cuda_across_hosts(mm, net, nbytes);
        }
        const int ranks = num_hosts * mm.num_devices();
        for (const plan::NcclCandidate& c : plan::nccl_candidates(mm.nccl, net)) {
          candidates.append(
              to_dict(plan::predict_nccl_allreduce(mm.nccl, c, ranks, nbytes, net), nbytes));
        }
        py::dict d;
        d["nccl"] = candidates;
        d["best_nccl"] = to_dict(p.nccl, nbytes);
        d["reduce_scatter"] = to_dict(p.reduce_scatter);
        d["across"] = to_dict(p.across, nbytes / mm.num_devices());
        d["all_gather"] = to_dict(p.all_gather);
        d["two_level_seconds"] = p.two_level_s;
        d["two_level_faster"] = p.two_level_faster;
        d["reason"] = p.reason;
        return d;
      },
      py::arg("machine"), py::arg("num_hosts"), py::arg("nbytes"), py::arg("nics"),
      py::arg("nic_gbps"), py::arg("amd_cpu") = false,
      "An allreduce of nbytes of CUDA tensors on num_hosts hosts, each the GPU machine "
      "`machine` with `nics` NICs of nic_gbps GB/s: NCCL's tuning model over all ranks (every "
      "candidate: 'nccl'; its choice: 'best_nccl') against a two-level plan (a reduce-scatter "
      "inside each host, NCCL across hosts among the ranks of each local index, an all-gather "
      "inside: 'reduce_scatter', 'across', 'all_gather', 'two_level_seconds'), "
      "'two_level_faster' and 'reason'.");

  m.def(
      "predict_flat_ring_across_hosts",
      [](const BackendConfig& config, int num_hosts, int ranks_per_host, int64_t nbytes,
         int cores) {
        check_bytes(nbytes, 1);
        positive_gbps(config.net_stream_gbps, "net_stream_gbps");
        positive_gbps(config.net_host_gbps, "net_host_gbps");
        non_negative_us(config.net_latency_us, "net_latency_us");
        if (!(config.cpu_memory_gbps >= 0) || !(config.net_host_cores >= 0) || cores < 0) {
          throw std::invalid_argument("cpu_memory_gbps, net_host_cores and cores must be >= 0");
        }
        constexpr int kMostRanks = 1 << 20;
        if (num_hosts > kMostRanks || ranks_per_host > kMostRanks / std::max(1, num_hosts)) {
          throw std::invalid_argument("num_hosts x ranks_per_host must be at most 2^20");
        }
        const plan::NetworkParams net = network_model(config, cores);
        py::gil_scoped_release no_gil;
        return plan::predict_flat_ring_s({num_hosts, ranks_per_host}, nbytes, net);
      },
      py::arg("config"), py::arg("num_hosts"), py::arg("ranks_per_host"), py::arg("nbytes"),
      py::arg("cores"),
      "Seconds the engine's ring over all ranks takes for an allreduce of nbytes across "
      "num_hosts hosts of ranks_per_host ranks, as the backend predicts it with this config's "
      "network model (net_* fields, and the host memory of cpu_memory_gbps) on hosts of `cores` "
      "cores where net_host_cores is 0.");

  m.def(
      "across_hosts_traffic",
      [](int num_hosts, int ranks_per_host, int64_t nbytes, const std::string& collective) {
        const plan::HostLayout layout{num_hosts, ranks_per_host};
        plan::Traffic two_level;
        plan::Traffic flat_ring;
        if (collective == "allreduce") {
          two_level = plan::two_level_traffic(layout, nbytes);
          flat_ring = plan::flat_ring_traffic(layout, nbytes);
        } else if (collective == "all_gather" || collective == "reduce_scatter") {
          two_level = plan::two_level_gather_scatter_traffic(layout, nbytes);
          flat_ring = plan::flat_ring_gather_scatter_traffic(layout, nbytes);
        } else {
          throw py::value_error(
              "across_hosts_traffic: collective is 'allreduce', 'all_gather' "
              "or 'reduce_scatter'; got '" +
              collective + "'");
        }
        py::dict d;
        for (const auto& [name, t] :
             {std::pair{"two_level", two_level}, std::pair{"flat_ring", flat_ring}}) {
          py::dict row;
          row["inter_host_bytes"] = t.inter_host_bytes;
          row["inter_host_steps"] = t.inter_host_steps;
          row["inter_host_streams"] = t.inter_host_streams;
          row["intra_host_socket_bytes"] = t.intra_host_socket_bytes;
          d[name] = row;
        }
        return d;
      },
      py::arg("num_hosts"), py::arg("ranks_per_host"), py::arg("nbytes"),
      py::arg("collective") = "allreduce",
      "Per host, for a collective of nbytes (an allreduce's payload; the full tensor of an "
      "all-gather or reduce-scatter, every rank's block): bytes sent to other hosts, sequential "
      "steps that cross hosts, streams leaving the host at once, and bytes between ranks of one "
      "host through sockets; for the two-level plan ('two_level') and the engine's ring over all "
      "ranks ('flat_ring').");
}

}  // namespace

void bind_plan(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "plan", "The plan layer's cost model: machine models and predicted allreduce times.");
  bind_machines(m);
  bind_predictions(m);
  bind_across_hosts(m);
}

}  // namespace xdev::backend
