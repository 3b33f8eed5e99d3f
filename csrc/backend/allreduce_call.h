// What the CPU and CUDA paths share to run one native allreduce: the call's
// tensors grouped by dtype (one payload per dtype, in call order), each
// group's packing and descriptor, and the windowed plan that moves it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/collective_plan.h"
#include "../plan/packing.h"
#include "../plan/selection.h"
#include "../plan/topology.h"
#include "../transport/shm_channel.h"
#include "group_context.h"

namespace xdev::backend {

// One dtype's share of an allreduce call.
struct DtypeAllreduce {
  plan::DtypeGroup group;  // which of the call's tensors, laid out how
  kernels::DType dtype = kernels::DType::kFloat32;
  std::vector<plan::Range> packs;      // the selection's packing of the payload
  transport::OpDescriptor descriptor;  // seq 0: GroupContext::number it as it runs
  int64_t total() const { return group.layout.total(); }
};

// The user's packing options (Options.num_packs and friends).
plan::PackingOptions packing_options(const BackendConfig& config);

// Groups tensors (native dtypes only) by dtype and gives each group its packs
// and descriptor, in the order every rank runs them. Takes no sequence
// number: the caller numbers each group right before it opens it. Without packing (packed false)
// every group is one pack and its descriptor says num_packs 0.
std::vector<DtypeAllreduce> prepare_allreduce(const GroupContext& group,
                                              const std::vector<at::Tensor>& tensors,
                                              kernels::ReduceOp op, const plan::Selection& sel,
                                              bool packed = true);

// Builds the windowed plans of one group's allreduces. The balanced plan's
// pack trees follow `links` (every pair counts as one link when it has none)
// and are kept per pack count. Op thread only.
class AllreducePlanner {
 public:
  explicit AllreducePlanner(plan::LinkMatrix links) : links_(std::move(links)) {}

  plan::CollectivePlan plan(const GroupContext& group, const plan::Selection& sel,
                            const DtypeAllreduce& call, int64_t window_elems);

 private:
  const std::vector<plan::PackTree>& pack_trees(int64_t num_packs);

  plan::LinkMatrix links_;
  std::map<int64_t, std::vector<plan::PackTree>> pack_trees_;
};

}  // namespace xdev::backend
