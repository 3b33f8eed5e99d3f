#include "allreduce_call.h"

#include "tensor_helpers.h"

namespace xdev::backend {
namespace {

// The packing of an allreduce run by sel: the user's if they chose one, else
// the selection's pack count.
plan::PackingOptions packing_for(const BackendConfig& config, const plan::Selection& sel) {
  plan::PackingOptions packing = packing_options(config);
  const bool user_packing =
      packing.num_packs > 0 || packing.bytes_per_pack > 0 ||
      (packing.agg_small_grads_max_bytes > 0 && packing.agg_small_grads_max_group > 0);
  if (!user_packing && sel.num_packs > 0) packing.num_packs = sel.num_packs;
  return packing;
}

}  // namespace

plan::PackingOptions packing_options(const BackendConfig& config) {
  plan::PackingOptions packing;
  packing.num_packs = config.num_packs < 0 ? 0 : config.num_packs;
  packing.agg_small_grads_max_bytes = config.agg_small_grads_max_bytes;
  packing.agg_small_grads_max_group = config.agg_small_grads_max_group;
  packing.bytes_per_pack = config.bytes_per_pack;
  return packing;
}

std::vector<DtypeAllreduce> prepare_allreduce(const GroupContext& group,
                                              const std::vector<at::Tensor>& tensors,
                                              kernels::ReduceOp op, const plan::Selection& sel,
                                              bool packed) {
  const uint64_t hash = counts_hash(tensors);
  const plan::PackingOptions packing = packing_for(group.config(), sel);
  std::vector<DtypeAllreduce> calls;
  for (plan::DtypeGroup& g : group_by_scalar_type(tensors)) {
    DtypeAllreduce call;
    call.dtype = *native_dtype(static_cast<at::ScalarType>(g.dtype));
    if (packed) call.packs = plan::make_packs(g.layout, g.elem_size, packing);
    transport::OpDescriptor& d = call.descriptor;
    d.collective = static_cast<int32_t>(Collective::kAllreduce);  // numbered when it runs
    d.reduce_op = static_cast<int32_t>(op);
    d.dtype = static_cast<int32_t>(call.dtype);
    d.algorithm = static_cast<int32_t>(sel.algorithm);
    d.root = group.config().reduce_to_rank;
    d.num_packs = static_cast<int64_t>(call.packs.size());
    d.num_tensors = static_cast<int64_t>(tensors.size());
    d.total_elems = g.layout.total();
    d.counts_hash = hash;
    call.group = std::move(g);
    calls.push_back(std::move(call));
  }
  return calls;
}

plan::CollectivePlan AllreducePlanner::plan(const GroupContext& group, const plan::Selection& sel,
                                            const DtypeAllreduce& call, int64_t window_elems) {
  const bool balanced = sel.algorithm == plan::Algorithm::kHierarchicalBalanced;
  return plan::CollectivePlan::allreduce(
      sel.algorithm, group.size(), static_cast<int>(group.config().reduce_to_rank), call.packs,
      call.total(), window_elems,
      balanced ? pack_trees(static_cast<int64_t>(call.packs.size()))
               : std::vector<plan::PackTree>{});
}

const std::vector<plan::PackTree>& AllreducePlanner::pack_trees(int64_t num_packs) {
  auto it = pack_trees_.find(num_packs);
  if (it == pack_trees_.end()) {
    it = pack_trees_.emplace(num_packs, plan::balanced_pack_trees_for(links_, num_packs)).first;
  }
  return it->second;
}

}  // namespace xdev::backend
