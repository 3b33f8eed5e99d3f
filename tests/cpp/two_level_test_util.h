// Helpers shared by the tests of the plans across hosts (test_two_level*.cc).
#pragma once

#include "plan/machines.h"
#include "plan/two_level.h"

namespace xdev_test {

// Sockets as fast as memory, with no latency: next to a slow host (below), where the model
// must prefer the engine across hosts to the steps inside each host.
inline xdev::plan::NetworkParams fast_network() {
  xdev::plan::NetworkParams net;
  net.stream_bytes_per_s = 1e13;
  net.host_bytes_per_s = 1e13;
  net.latency_s = 0;
  return net;
}

inline xdev::plan::MachineModel slow_cpu_host(int ranks) {
  xdev::plan::CpuHostParams slow;
  slow.core_bytes_per_s = 1e8;
  slow.memory_bytes_per_s = 1e8;
  return xdev::plan::cpu_host(ranks, slow);
}

}  // namespace xdev_test
