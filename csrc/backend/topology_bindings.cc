#include "topology_bindings.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../plan/topology.h"
#include "../transport/nvml_links.h"

namespace py = pybind11;

namespace xdev::backend {
namespace {

using Matrix = std::vector<std::vector<int64_t>>;

}  // namespace

void bind_topology(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "topology", "GPU topology: NVLink counts from NVML and the classification of a host's GPUs.");

  m.def(
      "probe_nvlinks",
      [](const std::vector<std::string>& bus_ids) {
        transport::NvlinkReport report;
        {
          // NVML may take a while to initialise; other Python threads go on.
          py::gil_scoped_release no_gil;
          report = transport::probe_nvlinks(bus_ids);
        }
        py::dict d;
        d["links"] = report.links.to_rows();
        d["nvswitch"] = report.nvswitch;
        d["available"] = report.available;
        d["note"] = report.note;
        return d;
      },
      py::arg("bus_ids"),
      "NVLinks between the GPUs with these PCI bus ids (one per local rank; repeats allowed), "
      "from NVML loaded at run time: {'links': [[int]] (pairs joined through NVSwitches "
      "included), 'nvswitch': [int] (each rank's GPU's links to NVSwitches), 'available': "
      "bool, 'note': str}. "
      "Without NVML: available False, all-zero links and a note saying why.");

  m.def(
      "classify_gpus",
      [](const Matrix& nvlink, const Matrix& reachable, const std::vector<int>& nvswitch) {
        return std::string(plan::to_string(plan::classify_gpus(
            plan::LinkMatrix::from_rows(nvlink, "the NVLink matrix"),
            plan::LinkMatrix::from_rows(reachable, "the reachability matrix", /*max_links=*/1),
            nvswitch)));
      },
      py::arg("nvlink"), py::arg("reachable"), py::arg("nvswitch") = std::vector<int>{},
      "'dgx1', 'nvswitch', 'fully_connected', 'partial' or 'none' for a host's GPUs, from NVLink "
      "counts and peer reachability (0/1) per pair of local ranks and, optionally, each rank's "
      "NVLinks to NVSwitches. Raises ValueError if the sizes differ.");
}

}  // namespace xdev::backend
