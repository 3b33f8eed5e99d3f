#include "two_level_broadcast.h"

#include <ATen/ATen.h>

#include <cstring>

#include "../plan/collective_plan.h"
#include "../plan/two_level.h"
#include "staged_broadcast.h"
#include "tensor_helpers.h"
#include "two_level_allreduce.h"

namespace xdev::backend {

TwoLevelBroadcast::TwoLevelBroadcast(GroupContext& group, std::shared_ptr<CrossHostEngine> engine)
    : group_(group),
      executor_(*group.host_channel()),
      engine_(engine),
      check_(group, std::move(engine)) {
  what_ = "two-level broadcast (inside " + host_and_its_ranks(group) + ")";
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
        // The root's local index on its host.
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
          bytes.push_back(contiguous_bytes(t));
        }
        const plan::FlatLayout layout(byte_counts);
        transport::OpDescriptor call;
        call.collective = static_cast<int32_t>(Collective::kBroadcast);
        call.root = root;
        call.num_tensors = static_cast<int64_t>(flat.size());
        call.total_elems = layout.total();
        call.counts_hash = counts_hash(tensors);
        const int root_host = group_.rank_hosts()[static_cast<size_t>(root)];
        // Local rank 0 of every host crosses, whatever the root: the same
        // rank on every host, so that hosts whose calls name different roots
        // meet in the check and fail there rather than wait for each other.
        const bool crosses = group_.local_rank() == 0;
        // The host's ranks agree on the call first, so that only the rank
        // that crosses hosts need check it with the other hosts. Like a
        // leader form, every rank a mismatch stops crosses hosts once: the
        // crossing rank in its exchange, any other with a refusal (where it
        // never crossed, a rank of its local index on another host that did,
        // in a different call, would wait for it and pair with its next
        // call). When the calls differ, the check fails this host's broadcast
        // below on purpose, so that the host's other ranks stop there.
        bool exchanged = false;
        try {
          transport::OpDescriptor here = group_.next_descriptor(Collective::kBroadcast);
          here.root = call.root;
          here.num_tensors = call.num_tensors;
          here.total_elems = call.total_elems;
          here.counts_hash = call.counts_hash;
          group_.host_channel()->open_collective(
              group_.make_context(here, what_.c_str(), deadline));
          if (group_.host_index() == root_host && root_local != 0) {
            // The root's data goes to its host's local rank 0 first (to every
            // local rank: the step inside a host is a broadcast).
            staged_broadcast(group_, executor_, group_.local_world_size(), root_local, flat,
                             what_.c_str(), deadline);
          }
          if (crosses) {
            // One tensor of bytes, whatever the call's tensors and dtypes. A
            // payload that fits rides in the check from the root's host; a
            // larger one follows it by the engine's broadcast.
            at::Tensor payload = bytes.size() == 1 ? bytes[0] : at::cat(bytes);
            const int64_t total = layout.total();
            const bool carried = plan::carried_across_hosts(total);
            exchanged = true;
            const at::Tensor messages =
                check_.exchange(call, carried ? payload.data_ptr() : nullptr, total,
                                /*host_step_follows=*/true, "two-level broadcast", deadline);
            if (carried && group_.host_index() != root_host && total > 0) {
              std::memcpy(payload.data_ptr(), CrossHostCheck::payload_of(messages, root_host),
                          static_cast<size_t>(total));
            } else if (!carried) {
              std::vector<at::Tensor> engine_tensors{payload};
              c10d::BroadcastOptions opts;
              opts.rootRank = root_host;
              opts.timeout = engine_timeout(deadline);
              wait_for_engine(engine_->get().broadcast(engine_tensors, opts), opts.timeout,
                              "two-level broadcast: the engine's broadcast across hosts");
            }
            if (bytes.size() > 1) unpack_into(payload, bytes);
          }
          // `flat` holds the root's data on local rank 0. (On the root's host
          // a root elsewhere already gave it to every rank; the step still
          // runs there: a failed check stops this host's other ranks in it.)
          staged_broadcast(group_, executor_, group_.local_world_size(), 0, flat, what_.c_str(),
                           deadline);
        } catch (const transport::MismatchError&) {
          if (!exchanged) check_.refuse(deadline);
          throw;
        }
        copy_back(flat, tensors);
      },
      async_op);
}

}  // namespace xdev::backend
