// Python bindings of GPU topology detection: torch_xdev._C.topology.
//
// NVLink counts from NVML (loaded at run time) and the classification of a
// host's GPUs from NVLink counts and peer reachability. Used by
// torch_xdev.topology (`python -m torch_xdev.topology`).
#pragma once

#include <pybind11/pybind11.h>

namespace xdev::backend {

// Adds the submodule "topology" to `m`.
void bind_topology(pybind11::module_& m);

}  // namespace xdev::backend
