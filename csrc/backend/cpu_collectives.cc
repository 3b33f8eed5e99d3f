#include "cpu_collectives.h"

#include <algorithm>
#include <cstdio>
#include <thread>

#include "setup_waits.h"
#include "staged_broadcast.h"
#include "tensor_helpers.h"

namespace xdev::backend {

CpuCollectives::CpuCollectives(GroupContext& group)
    : group_(group),
      model_(cpu_host_model(group.config(), group.size(), group.machine_cores())),
      staged_(*group.channel()),
      in_place_(*group.channel()),
      planner_(plan::LinkMatrix::fully_connected(group.size())) {
  // Single copy needs every rank to read every peer: each rank probes, then
  // all agree through the store, so the transport choice is the same on all.
  const BackendConfig& config = group.config();
  std::string why = "disabled by Options.single_copy / XDEV_SINGLE_COPY";
  const bool mine_ok = config.single_copy && group.channel()->can_read_peers(&why);
  if (config.single_copy && !mine_ok) {
    // Asked for explicitly, so say why it is refused, on the rank that knows.
    std::fprintf(stderr, "[xdev] group '%s' rank %d: single copy unavailable, staying staged: %s\n",
                 config.group_name.c_str(), group.rank(), why.c_str());
  }
  if (count_failures_across_ranks(group.store(), "xdev/cma/", !mine_ok, group.rank(), group.size(),
                                  group.config().timeout, "probing single copy") == 0) {
    single_copy_ = std::make_unique<transport::SingleCopyExecutor>(*group.channel());
    single_copy_note_ = "on: ranks read each other's tensors with process_vm_readv";
  } else {
    single_copy_note_ =
        mine_ok ? "off: a peer cannot read this host's ranks (see its log)" : "off: " + why;
  }
}

c10::intrusive_ptr<c10d::Work> CpuCollectives::allreduce(std::vector<at::Tensor> tensors,
                                                         kernels::ReduceOp op, plan::Selection sel,
                                                         std::chrono::milliseconds timeout,
                                                         bool async_op, SharedPlacement shared) {
  return group_.enqueue(
      c10d::OpType::ALLREDUCE, "xdev:all_reduce", tensors,
      [this, tensors, op, sel, timeout, shared]() {
        run_allreduce(tensors, op, sel, timeout, shared);
      },
      async_op);
}

void CpuCollectives::run_allreduce(const std::vector<at::Tensor>& tensors, kernels::ReduceOp op,
                                   const plan::Selection& sel, std::chrono::milliseconds timeout,
                                   const SharedPlacement& shared) {
  const auto deadline = group_.deadline_for(timeout);
  const std::vector<at::Tensor> flat = contiguous(tensors);
  // In place: a shared_empty buffer always (every rank's tensor is in one, or
  // the call fails), a heap block when the staged flat plan finds after its
  // first barrier that every rank's block is at the same place (and this
  // rank can reach every peer's).
  const bool in_shared_buffer = sel.in_place_shared && shared.buffer != nullptr;
  const bool offered_heap = sel.in_place_shared && shared.heap != nullptr;
  const bool in_heap = offered_heap && map_peers_copies(group_, shared, *group_.channel());
  if (offered_heap && !in_heap) shared.heap->count_collective(/*in_place=*/false);
  for (const DtypeAllreduce& call :
       prepare_allreduce(group_, tensors, op, sel, /*packed=*/!in_shared_buffer)) {
    const int64_t total = call.total();
    transport::OpDescriptor desc = call.descriptor;
    group_.number(desc);
    transport::SharedBufferRequest in_place;
    if (in_shared_buffer || in_heap) {  // the one tensor, in memory every rank maps
      if (in_shared_buffer) {
        desc.shared_buffer = shared.buffer->id();
        desc.shared_offset = shared.offset;
      } else {
        desc.heap_arena = shared.heap_location.arena;
        desc.heap_offset = shared.heap_location.offset;
      }
      in_place.count = total;
      in_place.dtype = call.dtype;
      in_place.op = op;
      in_place.ctx = group_.make_context(desc, "allreduce", deadline);
      transport::ShmChannel& channel = *group_.channel();
      in_place.copies = [&shared, &channel] { return copies_of(shared, channel); };
      if (in_shared_buffer) {
        in_place_.run(in_place);
        continue;
      }
    }
    const size_t elem_size = call.group.elem_size;
    const bool single_copy = sel.single_copy;  // of one tensor: this very group
    // Single copy runs the whole payload as one window: no slots to fill.
    const int64_t window_elems =
        single_copy ? std::max<int64_t>(total, 1)
                    : group_.config().shm_slot_bytes / static_cast<int64_t>(elem_size);
    const plan::CollectivePlan cp = planner_.plan(group_, sel, call, window_elems);
    desc.single_copy = single_copy ? 1 : 0;
    const transport::OpContext ctx = group_.make_context(desc, "allreduce", deadline);
    if (single_copy) {
      // Single copy implies a non-empty payload: window 0 exists.
      const plan::Schedule schedule = plan::in_place_variant(cp.window(0).schedule);
      transport::SingleCopyRequest req;
      req.schedule = &schedule;
      req.data = static_cast<char*>(flat[call.group.tensor_indices[0]].data_ptr());
      req.count = total;
      req.dtype = call.dtype;
      req.op = op;
      req.ctx = ctx;
      single_copy_->run(req);
      continue;
    }
    transport::CollectiveRequest req;
    req.plan = &cp;
    req.layout = &call.group.layout;
    for (size_t idx : call.group.tensor_indices) {
      req.tensors.push_back(static_cast<char*>(flat[idx].data_ptr()));
    }
    req.dtype = call.dtype;
    req.op = op;
    req.ctx = ctx;
    if (in_heap) {
      req.after_first_barrier = [this, &in_place, &shared] {
        const bool ran = in_place_.run_opened(in_place);
        shared.heap->count_collective(ran);
        if (ran) {
          if (group_.config().debug) {  // no strings built per call without the log
            group_.log_once("heap-in-place",
                            "allreduce ran in place from the symmetric heap: nothing staged");
          }
          return true;
        }
        group_.log_once("heap-places-differ",
                        "a tensor of the symmetric heap is not at the same place on every rank "
                        "(allocated in another order, or an ordinary tensor on some rank); "
                        "staged");
        return false;
      };
    }
    staged_.run(req);
  }
  copy_back(flat, tensors);
}

c10::intrusive_ptr<c10d::Work> CpuCollectives::broadcast(std::vector<at::Tensor> tensors, int root,
                                                         std::chrono::milliseconds timeout,
                                                         bool async_op) {
  return group_.enqueue(
      c10d::OpType::BROADCAST, "xdev:broadcast", tensors,
      [this, tensors, root, timeout]() {
        staged_broadcast(group_, staged_, group_.size(), root, tensors, "broadcast",
                         group_.deadline_for(timeout));
      },
      async_op);
}

c10::intrusive_ptr<c10d::Work> CpuCollectives::barrier(std::chrono::milliseconds timeout,
                                                       bool async_op,
                                                       std::function<void()> before) {
  // Queued behind every earlier native collective of this rank, so when it
  // completes they have completed too.
  return group_.enqueue(
      c10d::OpType::BARRIER, "xdev:barrier", {},
      [this, timeout, before = std::move(before)]() {
        if (before) before();
        const transport::OpDescriptor desc = group_.next_descriptor(Collective::kBarrier);
        staged_.barrier(group_.make_context(desc, "barrier", group_.deadline_for(timeout)));
      },
      async_op);
}

}  // namespace xdev::backend
