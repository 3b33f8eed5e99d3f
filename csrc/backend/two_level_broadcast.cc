#include "two_level_broadcast.h"

#include <ATen/ATen.h>

#include "../plan/collective_plan.h"
#include "staged_broadcast.h"
#include "tensor_helpers.h"
#include "two_level_allreduce.h"

namespace xdev::backend {

TwoLevelBroadcast::TwoLevelBroadcast(GroupContext& group, c10::intrusive_ptr<c10d::Backend> engine)
    : group_(group),
      executor_(*group.host_channel()),
      engine_(engine),
      check_(group, std::move(engine)) {
  std::string ranks;
  for (int r : group.host_ranks()) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  what_ = "two-level broadcast (inside host '" + group.config().hostname +
          "', whose local ranks are group ranks " + ranks + ")";
}

c10::intrusive_ptr<c10d::Work> TwoLevelBroadcast::broadcast(std::vector<at::Tensor> tensors,
                                                            int root,
                                                            std::chrono::milliseconds timeout,
                                                            bool async_op) {
  return group_.enqueue(
      c10d::OpType::BROADCAST, "xdev:broadcast", tensors,
      [this, tensors, root, timeout] {
        const auto deadline = group_.deadline_for(timeout);
        const std::vector<at::Tensor> flat = contiguous(tensors);
        // The root's local index: the local rank that holds the data on every host after step 1.
        int root_local = 0;
        for (int r = 0; r < root; ++r) {
          root_local += group_.rank_hosts()[static_cast<size_t>(r)] ==
                                group_.rank_hosts()[static_cast<size_t>(root)]
                            ? 1
                            : 0;
        }
        std::vector<int64_t> byte_counts;
        std::vector<at::Tensor> bytes;
        for (const at::Tensor& t : flat) {
          byte_counts.push_back(t.numel() * t.element_size());
          bytes.push_back(t.view({-1}).view(at::kByte));
        }
        const plan::FlatLayout layout(byte_counts);
        // Every rank checks, not only those whose engine broadcasts: a
        // refusing rank's host peers must learn of it (cross_host_check.h).
        transport::OpDescriptor call;
        call.collective = static_cast<int32_t>(Collective::kBroadcast);
        call.root = root;
        call.num_tensors = static_cast<int64_t>(flat.size());
        call.total_elems = layout.total();
        call.shape_hash = shape_hash(tensors);
        check_.check(call, "two-level broadcast", deadline);
        if (group_.local_rank() == root_local && layout.total() > 0) {
          // One tensor of bytes for the engine, whatever the call's tensors and dtypes.
          std::vector<at::Tensor> payload{bytes.size() == 1 ? bytes[0] : at::cat(bytes)};
          c10d::BroadcastOptions opts;
          opts.rootRank = group_.rank_hosts()[static_cast<size_t>(root)];
          opts.timeout = engine_timeout(deadline);
          wait_for_engine(engine_->broadcast(payload, opts), opts.timeout,
                          "two-level broadcast: the engine's broadcast across hosts");
          if (bytes.size() > 1) unpack_into(payload[0], bytes);
        }
        // `flat` holds the engine's result on the root's local index: broadcast it as it is.
        staged_broadcast(group_, executor_, group_.local_world_size(), root_local, flat,
                         what_.c_str(), deadline);
        copy_back(flat, tensors);
      },
      async_op);
}

}  // namespace xdev::backend
