#include "two_level_allreduce.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "cpu_gather_scatter.h"
#include "staged_broadcast.h"
#include "tensor_helpers.h"

namespace xdev::backend {
namespace {

// How errors name the two-level allreduce's own calls.
constexpr const char* kAllreduceName = "two-level allreduce";

// Slice j of `total` elements cut into `parts` (the first total % parts one
// element longer), as the host's reduce-scatter leaves them on local rank j.
std::vector<int64_t> slice_sizes(int64_t total, int parts) {
  std::vector<int64_t> sizes(static_cast<size_t>(parts), total / parts);
  for (int64_t j = 0; j < total % parts; ++j) ++sizes[static_cast<size_t>(j)];
  return sizes;
}

}  // namespace

c10d::ReduceOp two_level_engine_op(kernels::ReduceOp op) {
  switch (op) {
    case kernels::ReduceOp::kSum:
    case kernels::ReduceOp::kAvg:  // summed across hosts, divided once after
      return c10d::ReduceOp::SUM;
    case kernels::ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case kernels::ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case kernels::ReduceOp::kProduct:
      return c10d::ReduceOp::PRODUCT;
  }
  TORCH_CHECK(false, "xdev two-level collective: unknown reduce op");
}

TwoLevelOps two_level_ops(kernels::ReduceOp op, c10::ScalarType dtype) {
  if (op != kernels::ReduceOp::kAvg) return {op, op, false};
  if (dtype == at::kHalf) return {kernels::ReduceOp::kAvg, kernels::ReduceOp::kSum, false};
  return {kernels::ReduceOp::kSum, kernels::ReduceOp::kAvg, true};
}

void reduce_rows_in_host_order(const at::Tensor& rows, int hosts, kernels::ReduceOp op,
                               const at::Tensor& out) {
  const int64_t row_bytes = out.numel() * out.element_size();
  std::vector<const void*> sources;
  for (int h = 0; h < hosts; ++h) {
    sources.push_back(static_cast<const char*>(rows.data_ptr()) + h * row_bytes);
  }
  kernels::reduce(*native_dtype(out.scalar_type()), op, out.data_ptr(), sources.data(), hosts,
                  out.numel(), /*divisor=*/0);
}

std::chrono::milliseconds engine_timeout(transport::Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - transport::Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

bool gathers_across_hosts(kernels::ReduceOp op, c10::ScalarType dtype) {
  return (op == kernels::ReduceOp::kMin || op == kernels::ReduceOp::kMax) &&
         at::isFloatingType(dtype);
}

std::string host_and_its_ranks(const GroupContext& group) {
  std::string ranks;
  for (int r : group.host_ranks()) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  return "host '" + group.config().hostname + "', whose local ranks are group ranks " + ranks;
}

void wait_for_engine(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout,
                     const char* what) {
  std::string reason;
  try {
    if (work->wait(timeout)) return;
    reason = "the engine's work did not complete";
  } catch (const c10::Error& e) {
    reason = e.what_without_backtrace();  // Gloo's own words, e.g. its timeout
  } catch (const std::exception& e) {
    reason = e.what();
  }
  // Across hosts nothing checked beforehand that the ranks there reached this
  // call; say what could keep them away.
  throw transport::PeerError(
      std::string("xdev: ") + what + " failed (" + reason +
      "). A rank on another host has exited, is stuck, or called a different collective (auto "
      "chooses two levels or the engine by size: ranks whose sizes differ across hosts may "
      "take different paths)");
}

void run_in_host_step(GroupContext& group, transport::GatherScatterExecutor& executor,
                      transport::GatherScatterRequest& req, const SharedPlacement& placement,
                      const std::string& name) {
  // Staging a single window costs less than the closing barrier in place needs.
  const bool offered = plan::in_host_step_in_place(req.plan->num_windows());
  switch (run_from_heap(group, executor, req, offered ? placement : SharedPlacement{},
                        *group.host_channel())) {
    case HeapRun::kInPlace:
      group.log_once(
          name + ":in-place",
          name + " inside the host ran in place from its symmetric heap: nothing staged");
      break;
    case HeapRun::kPlacesDiffer:
      group.log_once(name + ":heap-places-differ",
                     name +
                         ": a tensor of the host's symmetric heap is not at the same place on "
                         "every local rank; staged");
      break;
    case HeapRun::kNotInHeap:
      break;
  }
}

TwoLevelAllreduce::TwoLevelAllreduce(GroupContext& group, const SharedBuffers& shared,
                                     std::shared_ptr<CrossHostEngine> engine)
    : group_(group),
      shared_(shared),
      host_model_(cpu_host_model(group.config(), group.local_world_size(), group.machine_cores())),
      network_(network_model(group.config(), group.host_cores())),
      executor_(*group.host_channel()),
      broadcast_executor_(*group.host_channel()),
      engine_(engine),
      check_(group, std::move(engine)) {
  where_ = " in " + host_and_its_ranks(group) + ")";
}

c10::intrusive_ptr<c10d::Work> TwoLevelAllreduce::allreduce(std::vector<at::Tensor> tensors,
                                                            kernels::ReduceOp op, int pieces,
                                                            bool leader,
                                                            std::chrono::milliseconds timeout,
                                                            bool async_op) {
  return group_.enqueue(
      c10d::OpType::ALLREDUCE, "xdev:all_reduce", tensors,
      [this, tensors, op, pieces, leader, timeout] {
        const auto deadline = group_.deadline_for(timeout);
        transport::OpDescriptor call;
        call.collective = static_cast<int32_t>(Collective::kAllreduce);
        call.reduce_op = static_cast<int32_t>(op);
        call.dtype = static_cast<int32_t>(*native_dtype(tensors[0].scalar_type()));
        call.num_tensors = static_cast<int64_t>(tensors.size());
        for (const at::Tensor& t : tensors) call.total_elems += t.numel();
        call.counts_hash = counts_hash(tensors);
        const auto run_form = [&](const at::Tensor& flat, const SharedPlacement& placement) {
          if (leader) {
            run_leader(flat, op, call, deadline, placement, kAllreduceName);
          } else {
            run(flat, op, pieces, call, deadline, placement);
          }
        };
        if (tensors.size() == 1 && tensors[0].is_contiguous()) {
          // A DDP bucket from this host's symmetric heap: the steps inside the
          // host run in place when every local rank's lies at the same place.
          run_form(tensors[0].view({-1}), shared_.find(tensors[0]));
          return;
        }
        // Several tensors (allreduce_coalesced) or a strided one: one flat
        // payload, so that every slice is cut the same way on every host.
        std::vector<at::Tensor> flat_views;
        for (const at::Tensor& t : tensors) flat_views.push_back(t.reshape({-1}));
        const at::Tensor flat = at::cat(flat_views);
        run_form(flat, {});
        unpack_into(flat, tensors);
      },
      async_op);
}

void TwoLevelAllreduce::run(const at::Tensor& flat, kernels::ReduceOp op, int pieces_asked,
                            transport::OpDescriptor call, transport::Clock::time_point deadline,
                            const SharedPlacement& placement) {
  const int local_rank = group_.local_rank();
  const TwoLevelOps ops = two_level_ops(op, flat.scalar_type());
  const int num_pieces = static_cast<int>(std::clamp<int64_t>(
      pieces_asked, 1, std::max<int64_t>(1, flat.numel() / group_.local_world_size())));
  call.num_packs = num_pieces;  // hosts cutting the payload differently fail the check

  // Piece k: its elements of flat, and this local rank's slice of them.
  struct Piece {
    at::Tensor flat;
    at::Tensor slice;
    SharedPlacement placement;
    c10::intrusive_ptr<c10d::Work> engine_work;
    at::Tensor gathered;  // every host's slice, in host order, where the engine gathers
  };
  std::vector<Piece> pieces;
  int64_t start = 0;
  for (int64_t n : slice_sizes(flat.numel(), num_pieces)) {
    Piece p;
    p.flat = flat.narrow(0, start, n);
    p.slice =
        at::empty({slice_sizes(n, group_.local_world_size())[static_cast<size_t>(local_rank)]},
                  flat.options());
    p.placement = placement.heap != nullptr ? shared_.find(p.flat) : SharedPlacement{};
    pieces.push_back(std::move(p));
    start += n;
  }
  const auto reduce_scatter = [&](Piece& p, std::function<void()> after_check = {}) {
    run_in_host(plan::GatherScatterKind::kReduceScatter, p.flat, p.slice, ops.in_host, call,
                deadline, p.placement, kAllreduceName, std::move(after_check));
  };
  const bool gather = gathers_across_hosts(op, flat.scalar_type());
  const auto start_engine = [&](Piece& p) {
    if (gather) {
      // Slices of one local index have one size on every host: all skip an empty one.
      if (p.slice.numel() == 0) return;
      p.gathered = at::empty({group_.num_hosts() * p.slice.numel()}, p.slice.options());
      c10d::AllgatherOptions opts;
      opts.timeout = engine_timeout(deadline);
      at::Tensor in = p.slice;
      p.engine_work = engine_->get()._allgather_base(p.gathered, in, opts);
      return;
    }
    std::vector<at::Tensor> engine_tensors{p.slice};
    c10d::AllreduceOptions opts;
    opts.reduceOp = two_level_engine_op(op);
    opts.timeout = engine_timeout(deadline);
    p.engine_work = engine_->get().allreduce(engine_tensors, opts);
  };
  const auto finish = [&](Piece& p) {
    if (p.engine_work) {
      wait_for_engine(p.engine_work, engine_timeout(deadline),
                      gather ? "two-level allreduce: the engine's all-gather across hosts"
                             : "two-level allreduce: the engine's allreduce across hosts");
      if (p.gathered.defined()) {
        reduce_rows_in_host_order(p.gathered, group_.num_hosts(), op, p.slice);
      }
      if (ops.divide_after) divide_for_avg(p.slice, group_.size());
    }
    run_in_host(plan::GatherScatterKind::kAllGather, p.flat, p.slice, kernels::ReduceOp::kSum, call,
                deadline, p.placement, kAllreduceName);
  };

  // The check across hosts. A small slice rides in it once reduced, and
  // every rank then sums the hosts' partial sums in host order (the same bits
  // everywhere). Otherwise it leaves as soon as this host's ranks agree on
  // the call, and travels while they reduce-scatter the first piece.
  const at::Tensor& first_slice = pieces[0].slice;
  const int64_t slice_bytes = first_slice.numel() * first_slice.element_size();
  const bool carried = num_pieces == 1 && plan::carried_across_hosts(slice_bytes);
  const at::Tensor messages = check_.exchange_around_host_step(
      call, carried, first_slice.data_ptr(), slice_bytes, /*host_step_follows=*/true,
      kAllreduceName, deadline, [&](std::function<void()> after_check) {
        reduce_scatter(pieces[0], std::move(after_check));
      });
  if (carried) {
    check_.reduce_payloads(messages, 0, ops.across, first_slice);
    finish(pieces[0]);
    return;
  }
  // A pipeline: while the engine allreduces piece k across hosts, this thread
  // reduce-scatters piece k+1 and then all-gathers piece k-1 inside the host.
  start_engine(pieces[0]);
  for (size_t k = 1; k < pieces.size(); ++k) {
    reduce_scatter(pieces[k]);
    start_engine(pieces[k]);
    finish(pieces[k - 1]);
  }
  finish(pieces.back());
}

void TwoLevelAllreduce::barrier(transport::Clock::time_point deadline) {
  group_.host_channel()->barrier(deadline, "barrier (the ranks of this host" + where_);
  c10d::BarrierOptions opts;
  opts.timeout = engine_timeout(deadline);
  wait_for_engine(engine_->get().barrier(opts), opts.timeout,
                  "barrier: the engine's barrier across hosts");
}

void TwoLevelAllreduce::run_leader(const at::Tensor& flat, kernels::ReduceOp op,
                                   transport::OpDescriptor call,
                                   transport::Clock::time_point deadline,
                                   const SharedPlacement& placement, const char* what) {
  const bool leader = group_.local_rank() == 0;
  const TwoLevelOps ops = two_level_ops(op, flat.scalar_type());
  // No count of pieces is 0: a host that ran the other form fails the check across hosts.
  call.num_packs = 0;
  const at::Tensor slice =
      at::empty({slice_sizes(flat.numel(),
                             group_.local_world_size())[static_cast<size_t>(group_.local_rank())]},
                flat.options());
  bool exchanged = false;
  try {
    run_in_host(plan::GatherScatterKind::kReduceScatter, flat, slice, ops.in_host, call, deadline,
                placement, what);
    run_in_host(plan::GatherScatterKind::kAllGather, flat, slice, kernels::ReduceOp::kSum, call,
                deadline, placement, what);
    if (leader) {
      // The host's sum rides whole in the check across hosts. When the calls
      // differ, the exchange fails this host's next step inside it (the
      // broadcast) on purpose, so the other local ranks stop there too.
      exchanged = true;
      // The selection gives this form only payloads that fit the message.
      TORCH_INTERNAL_ASSERT(plan::carried_across_hosts(flat.numel() * flat.element_size()),
                            "xdev: a leader-form payload outgrew the message across hosts");
      const at::Tensor messages =
          check_.exchange(call, flat.data_ptr(), flat.numel() * flat.element_size(),
                          /*host_step_follows=*/true, what, deadline);
      check_.reduce_payloads(messages, 0, ops.across, flat);
    }
    staged_broadcast(group_, broadcast_executor_, group_.local_world_size(), 0, {flat},
                     (std::string(what) + " (broadcast from local rank 0" + where_).c_str(),
                     deadline);
  } catch (const transport::MismatchError&) {
    // Every rank a mismatch stops crosses hosts once, as in the slices' form:
    // a leader in its exchange, any other rank with a refusal. So the ranks of
    // each local index pass the same number of exchanges, whichever form each
    // host ran, and none waits for a partner until the timeout.
    if (!exchanged) check_.refuse(deadline);
    throw;
  }
}

void TwoLevelAllreduce::run_in_host(plan::GatherScatterKind kind, const at::Tensor& flat,
                                    const at::Tensor& slice, kernels::ReduceOp op,
                                    const transport::OpDescriptor& call,
                                    transport::Clock::time_point deadline,
                                    const SharedPlacement& placement, const char* what,
                                    std::function<void()> after_check) {
  const bool reduce_scatter = kind == plan::GatherScatterKind::kReduceScatter;
  // A reduce-scatter reduces elements; an all-gather moves bytes.
  const int64_t unit = reduce_scatter ? 1 : flat.element_size();
  std::vector<int64_t> blocks;
  std::vector<int64_t> starts;
  int64_t start = 0;
  for (int64_t n : slice_sizes(flat.numel(), group_.local_world_size())) {
    blocks.push_back(n * unit);
    starts.push_back(start);
    start += n * unit;
  }
  const int64_t slot_bytes = group_.config().shm_slot_bytes;
  const plan::GatherScatterPlan plan(
      kind, blocks, reduce_scatter ? slot_bytes / flat.element_size() : slot_bytes);
  const plan::FlatLayout layout({plan.block_elems()});  // every piece lies within the largest block
  transport::GatherScatterRequest req;
  req.plan = &plan;
  req.block_layout = &layout;
  req.full = {static_cast<char*>(flat.data_ptr())};
  req.block = {static_cast<char*>(slice.data_ptr())};
  req.block_starts = std::move(starts);
  req.dtype = reduce_scatter ? *native_dtype(flat.scalar_type()) : kernels::DType::kUInt8;
  req.op = op;
  req.avg_divisor = group_.size();  // an AVG inside the host divides by the whole group's size
  transport::OpDescriptor d =
      group_.next_descriptor(reduce_scatter ? Collective::kReduceScatter : Collective::kAllGather);
  // The op the call asked for: an AVG runs as a SUM inside the host, and a
  // rank asking SUM must not pass for it.
  d.reduce_op = call.reduce_op;
  d.dtype = static_cast<int32_t>(req.dtype);
  d.algorithm = static_cast<int32_t>(plan::Algorithm::kFlat);
  // The call's size and shapes, not this piece's: the host's ranks then
  // agree on the whole call here (and on the pieces it is cut into), so that
  // (their hosts differing) every cross-host group of the host sees the same
  // difference.
  d.total_elems = reduce_scatter ? call.total_elems : call.total_elems * flat.element_size();
  d.num_packs = call.num_packs;
  d.num_tensors = call.num_tensors;
  d.counts_hash = call.counts_hash;
  const std::string step = reduce_scatter ? " (reduce-scatter" : " (all-gather";
  req.ctx = group_.make_context(d, (what + step + where_).c_str(), deadline);
  req.after_check = std::move(after_check);
  run_in_host_step(group_, executor_, req, placement,
                   reduce_scatter ? "two-level reduce-scatter" : "two-level all-gather");
}

}  // namespace xdev::backend
