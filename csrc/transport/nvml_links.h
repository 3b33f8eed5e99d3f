// NVLink counts between the GPUs of this host, read from NVML at run time.
//
// NVML (libnvidia-ml.so.1, part of the NVIDIA driver) is opened with dlopen,
// so the extension has no link-time dependency on it and loads on machines
// without a driver. No NVML, or an NVML that cannot initialise, means "no
// NVLink known": an all-zero matrix, available = false and a note saying why;
// it is never an error. Pure C++17: no CUDA and no nvml.h needed to build.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "../plan/topology.h"

namespace xdev::transport {

// A PCI address as domain:bus:device.function.
struct PciAddress {
  unsigned domain = 0;
  unsigned bus = 0;
  unsigned device = 0;
  unsigned function = 0;

  // GPUs are told apart by domain, bus and device: the function number is 0
  // for every GPU, and not every source reports it.
  bool same_device(const PciAddress& o) const {
    return domain == o.domain && bus == o.bus && device == o.device;
  }
};

// Parses "[domain:]bus:device[.function]" in hex, any case, with a 4- or
// 8-digit domain as cudaDeviceGetPCIBusId, torch and NVML print it
// ("0000:07:00.0", "00000000:07:00.0"). nullopt if the text is anything else.
std::optional<PciAddress> parse_pci_bus_id(const std::string& text);

struct NvlinkReport {
  // Indexed by local rank, in the order of the bus ids given: NVLinks between
  // the ranks' GPUs (0 between ranks that share a GPU, and on the diagonal).
  plan::LinkMatrix links;
  // Indexed by local rank: the NVLinks from the rank's GPU to NVSwitches (the
  // part of `links` that goes through a switch: plan::direct_links removes it).
  std::vector<int> nvswitch;
  // True when NVML was loaded and initialised and knew every GPU given.
  bool available = false;
  // What was found, or why nothing was (e.g. "libnvidia-ml.so.1 not found: ...").
  std::string note;
};

// pci_bus_ids: one per local rank, as cudaDeviceGetPCIBusId or torch give them;
// entries may repeat (ranks sharing a GPU). Links to an NVSwitch make the GPUs
// that reach one all-to-all, with min(switch links of a, of b) links per pair.
// Throws std::invalid_argument for an entry that is not a PCI bus id; never
// throws because NVML is missing or fails. Serialised by a mutex, so callers
// on several threads do not interleave NVML init and shutdown.
NvlinkReport probe_nvlinks(const std::vector<std::string>& pci_bus_ids);

}  // namespace xdev::transport
