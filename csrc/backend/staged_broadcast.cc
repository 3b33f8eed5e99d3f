#include "staged_broadcast.h"

#include "../plan/collective_plan.h"
#include "tensor_helpers.h"

namespace xdev::backend {

void staged_broadcast(GroupContext& group, transport::ShmExecutor& executor, int world_size,
                      int root, const std::vector<at::Tensor>& tensors, const char* name,
                      transport::Clock::time_point deadline) {
  const std::vector<at::Tensor> flat = contiguous(tensors);
  std::vector<int64_t> byte_counts;
  for (const at::Tensor& t : flat) byte_counts.push_back(t.numel() * t.element_size());
  const plan::FlatLayout layout(byte_counts);
  const plan::CollectivePlan cp = plan::CollectivePlan::broadcast(world_size, root, layout.total(),
                                                                  group.config().shm_slot_bytes);
  transport::CollectiveRequest req;
  req.plan = &cp;
  req.layout = &layout;
  for (const at::Tensor& t : flat) req.tensors.push_back(static_cast<char*>(t.data_ptr()));
  req.dtype = kernels::DType::kUInt8;
  transport::OpDescriptor desc = group.next_descriptor(Collective::kBroadcast);
  desc.root = root;
  desc.num_tensors = static_cast<int64_t>(flat.size());
  desc.total_elems = layout.total();
  desc.counts_hash = counts_hash(tensors);
  req.ctx = group.make_context(desc, name, deadline);
  executor.run(req);
  copy_back(flat, tensors);
}

}  // namespace xdev::backend
