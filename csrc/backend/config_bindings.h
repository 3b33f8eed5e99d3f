// Python binding of BackendConfig (torch_xdev._C.BackendConfig), and the option keys of
// describe(), both generated from the field lists of backend_config.h.
#pragma once

#include <pybind11/pybind11.h>

#include "backend_config.h"

namespace xdev::backend {

// Adds the class BackendConfig to `m`: a read-write attribute per field, validate(), and the
// static method fields() that lists the declarations (tests compare them with
// torch_xdev.Options and the type stub).
void bind_config(pybind11::module_& m);

// Sets describe()'s key of each option that has one (timeout as "timeout_s", in seconds).
void describe_options(const BackendConfig& config, pybind11::dict& d);

}  // namespace xdev::backend
