#include "nvml_links.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <mutex>
#include <stdexcept>

namespace xdev::transport {
namespace {

// ---------------------------------------------------------------------------
// The slice of NVML's C API used here, declared to match nvml.h's ABI so that
// building needs no driver headers. nvml.h's return codes and enums are plain
// C enums, which are int-sized on every ABI the driver ships for.
using nvmlReturn_t = int;
constexpr nvmlReturn_t kNvmlSuccess = 0;  // NVML_SUCCESS
struct nvmlDevice_st;                     // opaque
using nvmlDevice_t = nvmlDevice_st*;
using nvmlEnableState_t = int;
constexpr nvmlEnableState_t kNvmlFeatureEnabled = 1;  // NVML_FEATURE_ENABLED
using nvmlIntNvLinkDeviceType_t = int;
constexpr nvmlIntNvLinkDeviceType_t kNvlinkDeviceTypeSwitch = 2;  // NVML_NVLINK_DEVICE_TYPE_SWITCH
constexpr unsigned kNvlinkMaxLinks = 18;                          // NVML_NVLINK_MAX_LINKS

// nvmlPciInfo_t (the layout since NVML 9: busIdLegacy first, busId last).
struct nvmlPciInfo_t {
  char busIdLegacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  char busId[32];
};
static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t must match nvml.h");

// One entry per symbol; the optional ones may be absent from older drivers.
struct NvmlApi {
  nvmlReturn_t (*init)() = nullptr;      // nvmlInit_v2
  nvmlReturn_t (*shutdown)() = nullptr;  // nvmlShutdown
  nvmlReturn_t (*handle_by_bus_id)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*link_state)(nvmlDevice_t, unsigned, nvmlEnableState_t*) = nullptr;
  nvmlReturn_t (*remote_pci)(nvmlDevice_t, unsigned, nvmlPciInfo_t*) = nullptr;
  nvmlReturn_t (*remote_type)(nvmlDevice_t, unsigned,
                              nvmlIntNvLinkDeviceType_t*) = nullptr;  // optional
  const char* (*error_string)(nvmlReturn_t) = nullptr;                // optional
};

constexpr const char* kLibrary = "libnvidia-ml.so.1";

// Closes the library on every path out of probe_nvlinks.
class Library {
 public:
  Library() : handle_(dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL)) {}
  ~Library() {
    if (handle_ != nullptr) dlclose(handle_);
  }
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;

  bool loaded() const { return handle_ != nullptr; }

  template <typename Fn>
  bool load(const char* name, Fn*& fn) const {
    fn = reinterpret_cast<Fn*>(dlsym(handle_, name));
    return fn != nullptr;
  }

 private:
  void* handle_;
};

std::string error_text(const NvmlApi& api, nvmlReturn_t rc) {
  const char* text = api.error_string != nullptr ? api.error_string(rc) : nullptr;
  return (text != nullptr ? std::string(text) : std::string("NVML error")) + " (" +
         std::to_string(rc) + ")";
}

// Parses up to max_digits hex digits of text[pos, end); false if there are
// none, too many, or a non-hex character.
bool parse_hex(const std::string& text, size_t pos, size_t end, size_t max_digits, unsigned* out) {
  if (end <= pos || end - pos > max_digits) return false;
  unsigned value = 0;
  for (size_t i = pos; i < end; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (!std::isxdigit(c)) return false;
    const unsigned digit = std::isdigit(c) ? c - '0' : std::tolower(c) - 'a' + 10;
    value = value * 16 + digit;
  }
  *out = value;
  return true;
}

std::string to_bus_id(const PciAddress& a) {
  char text[32];
  std::snprintf(text, sizeof(text), "%08x:%02x:%02x.%x", a.domain, a.bus, a.device, a.function);
  return text;
}

}  // namespace

std::optional<PciAddress> parse_pci_bus_id(const std::string& text) {
  // Split into up to three ':'-separated fields, the last one "device[.function]".
  std::vector<size_t> colons;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == ':') colons.push_back(i);
  }
  if (colons.empty() || colons.size() > 2) return std::nullopt;
  PciAddress a;
  size_t bus_begin = 0;
  if (colons.size() == 2) {
    if (!parse_hex(text, 0, colons[0], 8, &a.domain)) return std::nullopt;
    bus_begin = colons[0] + 1;
  }
  const size_t bus_end = colons.back();
  if (!parse_hex(text, bus_begin, bus_end, 2, &a.bus)) return std::nullopt;
  const size_t dot = text.find('.', bus_end);
  const size_t device_end = dot == std::string::npos ? text.size() : dot;
  if (!parse_hex(text, bus_end + 1, device_end, 2, &a.device) || a.device > 0x1f) {
    return std::nullopt;
  }
  if (dot != std::string::npos &&
      (!parse_hex(text, dot + 1, text.size(), 1, &a.function) || a.function > 7)) {
    return std::nullopt;
  }
  return a;
}

NvlinkReport probe_nvlinks(const std::vector<std::string>& pci_bus_ids) {
  const int num_ranks = static_cast<int>(pci_bus_ids.size());
  NvlinkReport report;
  report.links = plan::LinkMatrix(num_ranks);
  report.nvswitch.assign(static_cast<size_t>(num_ranks), 0);

  // Each distinct GPU once; gpu_of[rank] indexes `gpus`.
  std::vector<PciAddress> gpus;
  std::vector<int> gpu_of;
  for (const std::string& id : pci_bus_ids) {
    const std::optional<PciAddress> a = parse_pci_bus_id(id);
    if (!a) {
      throw std::invalid_argument("probe_nvlinks: '" + id +
                                  "' is not a PCI bus id (expected domain:bus:device.function, "
                                  "e.g. 0000:07:00.0)");
    }
    auto same = [&](const PciAddress& g) { return g.same_device(*a); };
    const auto it = std::find_if(gpus.begin(), gpus.end(), same);
    gpu_of.push_back(static_cast<int>(it - gpus.begin()));
    if (it == gpus.end()) gpus.push_back(*a);
  }
  if (gpus.empty()) {
    report.note = "no GPUs given";
    return report;
  }

  // NVML itself is thread-safe; the lock keeps each probe's init/shutdown pair
  // and library load whole when several groups probe at once.
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);

  dlerror();  // clear a stale message
  Library lib;
  if (!lib.loaded()) {
    const char* error = dlerror();
    std::string why = error != nullptr ? error : "dlopen failed";
    // dlerror() says "<library>: <reason>"; the note names the library once.
    const std::string prefix = std::string(kLibrary) + ": ";
    if (why.compare(0, prefix.size(), prefix) == 0) why.erase(0, prefix.size());
    report.note = std::string(kLibrary) + " not found: " + why + " (no NVLink known)";
    return report;
  }
  NvmlApi api;
  const char* lacking = nullptr;  // the first required symbol the library lacks
  auto require = [&](const char* name, auto*& fn) {
    if (!lib.load(name, fn) && lacking == nullptr) lacking = name;
  };
  require("nvmlInit_v2", api.init);
  require("nvmlShutdown", api.shutdown);
  require("nvmlDeviceGetHandleByPciBusId_v2", api.handle_by_bus_id);
  require("nvmlDeviceGetNvLinkState", api.link_state);
  require("nvmlDeviceGetNvLinkRemotePciInfo_v2", api.remote_pci);
  if (lacking != nullptr) {
    report.note =
        std::string(kLibrary) + " lacks " + lacking + " (driver too old?; no NVLink known)";
    return report;
  }
  lib.load("nvmlDeviceGetNvLinkRemoteDeviceType", api.remote_type);
  lib.load("nvmlErrorString", api.error_string);

  const nvmlReturn_t init_rc = api.init();
  if (init_rc != kNvmlSuccess) {
    report.note = "nvmlInit_v2 failed: " + error_text(api, init_rc) + " (no NVLink known)";
    return report;
  }

  // Counted per distinct GPU, from each GPU's own side.
  const size_t num_gpus = gpus.size();
  std::vector<std::vector<int>> direct(num_gpus, std::vector<int>(num_gpus, 0));
  std::vector<int> switch_links(num_gpus, 0);
  std::string missing;
  for (size_t g = 0; g < num_gpus; ++g) {
    nvmlDevice_t device = nullptr;
    const std::string bus_id = to_bus_id(gpus[g]);
    const nvmlReturn_t rc = api.handle_by_bus_id(bus_id.c_str(), &device);
    if (rc != kNvmlSuccess) {
      missing += (missing.empty() ? "" : "; ") + bus_id + ": " + error_text(api, rc);
      continue;
    }
    for (unsigned link = 0; link < kNvlinkMaxLinks; ++link) {
      // Errors are expected here: NOT_SUPPORTED on GPUs without NVLink,
      // INVALID_ARGUMENT past the GPU's last link. Such links do not count.
      nvmlEnableState_t state = 0;
      if (api.link_state(device, link, &state) != kNvmlSuccess || state != kNvmlFeatureEnabled) {
        continue;
      }
      nvmlIntNvLinkDeviceType_t type = 0;
      if (api.remote_type != nullptr && api.remote_type(device, link, &type) == kNvmlSuccess &&
          type == kNvlinkDeviceTypeSwitch) {
        ++switch_links[g];
        continue;
      }
      nvmlPciInfo_t remote{};
      if (api.remote_pci(device, link, &remote) != kNvmlSuccess) continue;
      const PciAddress peer{remote.domain, remote.bus, remote.device, 0};
      // A peer outside the given GPUs (another job's GPU, a switch without a
      // type query, an NPU) is not counted.
      for (size_t h = 0; h < num_gpus; ++h) {
        if (h != g && gpus[h].same_device(peer)) ++direct[g][h];
      }
    }
  }
  api.shutdown();

  // Both ends report a direct link; the larger count survives a GPU whose
  // handle could not be had. NVSwitches join every pair of GPUs that reach one.
  int total_direct = 0, total_switched = 0;
  std::vector<std::vector<int>> gpu_links(num_gpus, std::vector<int>(num_gpus, 0));
  for (size_t g = 0; g < num_gpus; ++g) {
    for (size_t h = g + 1; h < num_gpus; ++h) {
      const int d = std::max(direct[g][h], direct[h][g]);
      const int s = std::min(switch_links[g], switch_links[h]);
      gpu_links[g][h] = gpu_links[h][g] = d + s;
      total_direct += d;
      total_switched += s > 0 ? 1 : 0;
    }
  }
  for (int a = 0; a < num_ranks; ++a) {
    report.nvswitch[static_cast<size_t>(a)] = switch_links[gpu_of[a]];
    for (int b = a + 1; b < num_ranks; ++b) {
      report.links.set_links(a, b, gpu_links[gpu_of[a]][gpu_of[b]]);  // 0 on a shared GPU
    }
  }

  report.available = missing.empty();
  report.note = "NVML: " + std::to_string(num_gpus) + " GPU(s), " + std::to_string(total_direct) +
                " direct NVLink(s) between them, " + std::to_string(total_switched) +
                " pair(s) joined through NVSwitch";
  if (!missing.empty()) report.note += "; no NVML handle for " + missing;
  return report;
}

}  // namespace xdev::transport
