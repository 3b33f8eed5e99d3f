// Rings over direct links, and the ring allreduce that NCCL runs on them.
//
// Pure C++17. The ring allreduce is here as the reference the hierarchical
// plans are measured against in the cost model; xdev does not run it.
#pragma once

#include <vector>

#include "packing.h"
#include "schedule.h"
#include "topology.h"

namespace xdev::plan {

// Directed rings through every device, each using one link of every pair it
// crosses, no two sharing a link in the same direction: every undirected
// Hamiltonian cycle found is used in both directions, as NCCL does, and as
// many link-disjoint cycles are taken as the link counts allow (the search
// stops at the degree bound or after a fixed amount of work). A topology
// without any such cycle gets one ring in device order and its reverse,
// over whatever path joins the devices.
std::vector<std::vector<int>> find_rings(const LinkMatrix& links);

// Ring allreduce over `rings` (each a device order): the range is split
// evenly between the rings, each ring's part into N chunks; N - 1
// reduce-scatter phases (a rank adds its predecessor's partial sum of one
// chunk to its own), N - 1 allgather phases (a rank copies the next total
// from its predecessor), then every rank copies its slot to its output.
Schedule ring_allreduce_schedule(int world_size, const std::vector<std::vector<int>>& rings,
                                 Range range);

}  // namespace xdev::plan
