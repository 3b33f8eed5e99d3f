#include "topology_bindings.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../plan/topology.h"
#include "../transport/nvml_links.h"

namespace py = pybind11;

namespace xdev::backend {
namespace {

using Matrix = std::vector<std::vector<int64_t>>;

// A LinkMatrix from a Python list of rows: square, symmetric, non-negative,
// and for a 0/1 matrix (reachability) nothing else; the diagonal is ignored.
// Throws std::invalid_argument (ValueError) naming the matrix and the entry.
plan::LinkMatrix to_link_matrix(const Matrix& rows, const char* what, bool zero_one) {
  const size_t n = rows.size();
  if (n > 4096) throw std::invalid_argument(std::string(what) + " has too many ranks");
  auto at = [](size_t i, size_t j) {
    return "[" + std::to_string(i) + "][" + std::to_string(j) + "]";
  };
  for (size_t i = 0; i < n; ++i) {
    if (rows[i].size() != n) {
      throw std::invalid_argument(std::string(what) + " is not square: row " + std::to_string(i) +
                                  " has " + std::to_string(rows[i].size()) + " entries, expected " +
                                  std::to_string(n));
    }
  }
  plan::LinkMatrix m(static_cast<int>(n));
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i + 1; j < n; ++j) {
      const int64_t v = rows[i][j];
      const int64_t limit = zero_one ? 1 : 1024;  // more NVLinks than that is a corrupt input
      if (v < 0 || v > limit) {
        throw std::invalid_argument(std::string(what) + " has " + std::to_string(v) + " at " +
                                    at(i, j) + ", expected 0.." + std::to_string(limit));
      }
      if (rows[j][i] != v) {
        throw std::invalid_argument(std::string(what) + " is not symmetric: " + at(i, j) + " = " +
                                    std::to_string(v) + " but " + at(j, i) + " = " +
                                    std::to_string(rows[j][i]));
      }
      m.set_links(static_cast<int>(i), static_cast<int>(j), static_cast<int>(v));
    }
  }
  return m;
}

Matrix to_rows(const plan::LinkMatrix& m) {
  Matrix rows(static_cast<size_t>(m.size()), std::vector<int64_t>(static_cast<size_t>(m.size())));
  for (int i = 0; i < m.size(); ++i) {
    for (int j = 0; j < m.size(); ++j) rows[i][j] = m.links(i, j);
  }
  return rows;
}

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
        d["links"] = to_rows(report.links);
        d["available"] = report.available;
        d["note"] = report.note;
        return d;
      },
      py::arg("bus_ids"),
      "NVLinks between the GPUs with these PCI bus ids (one per local rank; repeats allowed), "
      "from NVML loaded at run time: {'links': [[int]], 'available': bool, 'note': str}. "
      "Without NVML: available False, all-zero links and a note saying why.");

  m.def(
      "classify_gpus",
      [](const Matrix& nvlink, const Matrix& reachable) {
        return std::string(plan::to_string(
            plan::classify_gpus(to_link_matrix(nvlink, "the NVLink matrix", false),
                                to_link_matrix(reachable, "the reachability matrix", true))));
      },
      py::arg("nvlink"), py::arg("reachable"),
      "'dgx1', 'fully_connected', 'partial' or 'none' for a host's GPUs, from NVLink counts and "
      "peer reachability (0/1) per pair of local ranks. Raises ValueError if the sizes differ.");
}

}  // namespace xdev::backend
