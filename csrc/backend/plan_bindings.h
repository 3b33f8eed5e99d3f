// Python bindings of the plan layer's cost model: torch_xdev._C.plan.
//
// Machine models (built in, or a GPU host made from an NVLink matrix, or a CPU
// host), predicted allreduce times per candidate, and the choice by predicted
// time. Used by the `python -m torch_xdev.plan` CLI.
#pragma once

#include <pybind11/pybind11.h>

namespace xdev::backend {

// Adds the submodule "plan" to `m`.
void bind_plan(pybind11::module_& m);

}  // namespace xdev::backend
