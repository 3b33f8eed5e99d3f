// Helpers for the transport tests: threads stand in for the ranks of one host.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "transport/shm_channel.h"
#include "transport/shm_segment.h"

namespace xdev::transport {

// One channel per rank on a fresh segment. The name is unlinked once all have
// attached, as the backend does, so nothing is left in /dev/shm whatever
// happens next.
inline std::vector<ShmChannel> make_group(int world, size_t slot_bytes) {
  const std::string name = ShmSegment::make_name();
  std::vector<ShmChannel> ranks;
  ranks.push_back(ShmChannel::create(name, world, 0, slot_bytes));
  for (int r = 1; r < world; ++r) ranks.push_back(ShmChannel::attach(name, world, r, slot_bytes));
  ranks[0].unlink_name();
  return ranks;
}

}  // namespace xdev::transport
