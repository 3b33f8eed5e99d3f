#include "backend_config.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace xdev::backend {
namespace {

std::string text_of(const std::string& v) {
  return "\"" + v + "\"";
}
std::string text_of(int64_t v) {
  return std::to_string(v);
}
std::string text_of(bool v) {
  return v ? "true" : "false";
}
std::string text_of(std::chrono::milliseconds v) {
  return std::to_string(v.count()) + " ms";
}
std::string text_of(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", v);  // round-trips: equal text, equal value
  return text;
}
template <typename T>
std::string text_of(const std::vector<T>& v) {
  std::string s = "[";
  for (const T& e : v) s += (s.size() > 1 ? "," : "") + text_of(e);
  return s + "]";
}

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

}  // namespace

std::vector<std::string> plan_settings(const BackendConfig& c) {
  std::vector<std::string> settings;
  const auto add = [&settings](const std::string& name, const std::string& value) {
    settings.push_back(name + "=" + value);
  };
#define XDEV_ADD_OPTION(type, name, ...) \
  if (std::string(#name) != "timeout" && std::string(#name) != "debug") add(#name, text_of(c.name));
  XDEV_OPTION_FIELDS(XDEV_ADD_OPTION)
#undef XDEV_ADD_OPTION
#define XDEV_ADD_MODEL_FIELD(type, name, ...) \
  if (starts_with(#name, "cpu_") || starts_with(#name, "net_")) add(#name, text_of(c.name));
  XDEV_INTERNAL_FIELDS(XDEV_ADD_MODEL_FIELD)
#undef XDEV_ADD_MODEL_FIELD
  return settings;
}

void validate(const BackendConfig& config) {
  if (config.shm_slot_bytes < kMinSlotBytes || config.shm_slot_bytes > kMaxSlotBytes) {
    throw std::invalid_argument("shm_slot_bytes must be >= " + std::to_string(kMinSlotBytes) +
                                " and <= " + std::to_string(kMaxSlotBytes) + " (1 GiB); got " +
                                std::to_string(config.shm_slot_bytes));
  }
  if (config.cuda_slot_bytes < kMinSlotBytes || config.cuda_slot_bytes > kMaxSlotBytes ||
      config.cuda_slot_bytes % kCudaSlotAlignment != 0) {
    throw std::invalid_argument(
        "cuda_slot_bytes must be a multiple of " + std::to_string(kCudaSlotAlignment) +
        ", >= " + std::to_string(kMinSlotBytes) + " and <= " + std::to_string(kMaxSlotBytes) +
        " (1 GiB); got " + std::to_string(config.cuda_slot_bytes));
  }
  if (config.two_level_pieces < 0 || config.two_level_pieces > kMaxForcedTwoLevelPieces) {
    throw std::invalid_argument(
        "two_level_pieces must be >= 0 and <= " + std::to_string(kMaxForcedTwoLevelPieces) +
        "; got " + std::to_string(config.two_level_pieces));
  }
}

plan::MachineModel cpu_host_model(const BackendConfig& c, int ranks, int cores) {
  plan::CpuHostParams params;
  params.cores = std::max(1, cores);
  params.core_bytes_per_s = c.cpu_core_gbps * 1e9;
  params.memory_bytes_per_s = c.cpu_memory_gbps * 1e9;
  params.launch_latency_s = c.cpu_launch_us * 1e-6;
  params.barrier_latency_s = c.cpu_barrier_us * 1e-6;
  params.step_latency_s = c.cpu_step_us * 1e-6;
  params.sleeping_barrier_latency_s = c.cpu_sleeping_barrier_us * 1e-6;
  params.window_bytes = c.shm_slot_bytes;
  return plan::cpu_host(ranks, params);
}

plan::NetworkParams network_model(const BackendConfig& c, int cores) {
  plan::NetworkParams net;
  net.host_bytes_per_s = c.net_host_gbps * 1e9;
  net.stream_bytes_per_s = c.net_stream_gbps * 1e9;
  net.latency_s = c.net_latency_us * 1e-6;
  net.host_memory_bytes_per_s = c.cpu_memory_gbps * 1e9;
  net.host_cores = c.net_host_cores > 0 ? static_cast<int>(c.net_host_cores) : std::max(1, cores);
  return net;
}

}  // namespace xdev::backend
