#include "config_bindings.h"

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace py = pybind11;

namespace xdev::backend {
namespace {

// The Python type of a field, as the type stub (torch_xdev/_C.pyi) spells it.
const char* python_type(const std::string&) {
  return "str";
}
const char* python_type(int64_t) {
  return "int";
}
const char* python_type(bool) {
  return "bool";
}
const char* python_type(double) {
  return "float";
}
const char* python_type(std::chrono::milliseconds) {
  return "timedelta";
}
const char* python_type(const std::vector<int64_t>&) {
  return "list[int]";
}
const char* python_type(const std::vector<std::vector<int64_t>>&) {
  return "list[list[int]]";
}

// A field's value in describe(): durations in seconds, everything else as pybind casts it.
template <typename T>
py::object describe_value(const T& value) {
  return py::cast(value);
}
py::object describe_value(std::chrono::milliseconds value) {
  return py::float_(std::chrono::duration<double>(value).count());
}

py::dict field_info(const char* name, const char* type, bool option, const char* doc,
                    const char* describe_key) {
  py::dict f;
  f["name"] = name;
  f["type"] = type;
  f["option"] = option;
  f["doc"] = doc;
  f["describe_key"] =
      describe_key[0] == '\0' ? py::object(py::none()) : py::object(py::str(describe_key));
  return f;
}

py::list declared_fields() {
  const BackendConfig defaults;
  py::list fields;
#define XDEV_OPTION_INFO(type, name, default_value, doc, describe_key) \
  fields.append(field_info(#name, python_type(defaults.name), true, doc, describe_key));
#define XDEV_INTERNAL_INFO(type, name, default_value, doc) \
  fields.append(field_info(#name, python_type(defaults.name), false, doc, ""));
  XDEV_OPTION_FIELDS(XDEV_OPTION_INFO)
  XDEV_INTERNAL_FIELDS(XDEV_INTERNAL_INFO)
#undef XDEV_OPTION_INFO
#undef XDEV_INTERNAL_INFO
  return fields;
}

}  // namespace

void bind_config(py::module_& m) {
  py::class_<BackendConfig> cls(m, "BackendConfig");
  cls.def(py::init<>());
#define XDEV_BIND_FIELD(type, name, default_value, doc, ...) \
  cls.def_readwrite(#name, &BackendConfig::name, doc);
  XDEV_OPTION_FIELDS(XDEV_BIND_FIELD)
  XDEV_INTERNAL_FIELDS(XDEV_BIND_FIELD)
#undef XDEV_BIND_FIELD
  cls.def("validate", &validate, "Raises ValueError naming the first setting out of range.");
  cls.def_static("fields", &declared_fields,
                 "The declared fields, in order: name, type (as the stub spells it), option "
                 "(a field of torch_xdev.Options, or internal), doc, describe_key.");
}

void describe_options(const BackendConfig& config, py::dict& d) {
#define XDEV_DESCRIBE_OPTION(type, name, default_value, doc, describe_key) \
  if (describe_key[0] != '\0') d[describe_key] = describe_value(config.name);
  XDEV_OPTION_FIELDS(XDEV_DESCRIBE_OPTION)
#undef XDEV_DESCRIBE_OPTION
}

}  // namespace xdev::backend
