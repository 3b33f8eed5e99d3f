// The balanced hierarchical plan: the two levels of TensorFlow's
// HierarchicalCopyAllReduce (reduce inside each
// group of N/2, cross between the groups, copy back), with the shape of each
// pack's trees chosen so that every link carries a share of the traffic
// proportional to its capacity, in both directions.
//
// Each pack follows one of two tree types (g = N/2, partner(i) = i + g):
//  - group-first: reduce the pack inside each group along a spanning tree
//    rooted at a and at partner(a), add the two group sums across the a <->
//    partner(a) link (half the pack finalised on each side, so both
//    directions of that link work), swap the halves, copy back down the trees;
//  - pair-first: every rank adds its partner's half-pack first (all g cross
//    links at once), the half-sums are reduced inside one group along a tree,
//    copied back down it and across to the partners; the other half of the
//    pack mirrors this with the groups exchanged.
// Group-first crosses once per pack, pair-first on every cross link: mixing
// them moves as much traffic across the groups as the cross links can carry.
// A greedy pass assigns types, trees and cross links pack by pack, each time
// taking the option that keeps the most loaded link (load / link count)
// lowest. Trees are chains (Hamiltonian paths of a group) or stars; chains
// spread a pack over more links, stars have fewer hops.
//
// Every total is computed by exactly one finalize step and then copied, so
// all ranks hold the same bits, like hierarchical_copy.
#pragma once

#include <cstdint>
#include <vector>

#include "schedule.h"
#include "topology.h"

namespace xdev::plan {

struct PackTree {
  bool pair_first = false;
  int cross = 0;               // group-first: the rank of group 0 whose cross link is used
  std::vector<int> parent[2];  // per group: parent of each rank (-1 at the root), global ids
};

// Tree assignment for packs 0..num_packs-1 on N = links.size() ranks (N even,
// N >= 2). Uses only linked pairs; throws std::invalid_argument when a group
// has no spanning chain or star over its links, or a rank lacks a link to its
// partner.
std::vector<PackTree> balanced_pack_trees(const LinkMatrix& links, int64_t num_packs);

// The trees the backends run the balanced plan with (num_packs < 1 counts as
// one pack): along `links` where they have any link and can carry the
// two-level trees; otherwise (no links known, e.g. without NVML, or links too
// sparse) every pair weighs alike, as on LinkMatrix::fully_connected. The CPU
// path passes fully_connected(N) itself, a CUDA group its NVLink matrix.
std::vector<PackTree> balanced_pack_trees_for(const LinkMatrix& links, int64_t num_packs);

// The schedule of one window: packs[k].pack_id indexes `trees`.
Schedule hierarchical_balanced_schedule(int world_size, const std::vector<PackTree>& trees,
                                        const std::vector<PackSlice>& packs);

// Highest (load / link count) over the links after the assignment, in units
// of pack size, and the lower bound any assignment of these packs has
// (total traffic over total links); their ratio is the balance efficiency.
struct LinkBalance {
  double max_load_per_link = 0;
  double ideal_load_per_link = 0;
};
LinkBalance link_balance(const LinkMatrix& links, const std::vector<PackTree>& trees);

}  // namespace xdev::plan
