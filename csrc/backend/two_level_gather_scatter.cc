#include "two_level_gather_scatter.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "../plan/two_level.h"
#include "staged_broadcast.h"
#include "tensor_helpers.h"

namespace xdev::backend {
namespace {

char* ptr(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

// Checks a list form's list (one tensor per rank, of one dtype and every one
// the size of `mine`) and returns a flat tensor for all of it, world blocks.
at::Tensor flat_for_list(const char* what, const std::vector<at::Tensor>& list,
                         const at::Tensor& mine, int world, int rank) {
  for (int64_t n : list_sizes(what, list, mine, world, rank)) {
    TORCH_CHECK_VALUE(n == mine.numel(), "xdev ", what,
                      ": across hosts every entry of a list must have this rank's size (",
                      mine.numel(), " element(s)); got ", n);
  }
  return at::empty({world * mine.numel()}, mine.options());
}

}  // namespace

TwoLevelGatherScatter::TwoLevelGatherScatter(GroupContext& group, const SharedBuffers& shared,
                                             std::shared_ptr<CrossHostEngine> engine,
                                             TwoLevelAllreduce& allreduce)
    : group_(group),
      shared_(shared),
      executor_(*group.host_channel()),
      broadcast_executor_(*group.host_channel()),
      engine_(engine),
      allreduce_(allreduce),
      check_(group, std::move(engine)) {
  std::vector<int64_t> order;
  for (int h = 0; h < group.num_hosts(); ++h) {
    for (int r = 0; r < group.size(); ++r) {
      if (group.rank_hosts()[static_cast<size_t>(r)] == h) order.push_back(r);
    }
  }
  bool rank_order = true;
  for (size_t k = 0; k < order.size(); ++k)
    rank_order = rank_order && order[k] == static_cast<int64_t>(k);
  if (!rank_order) host_major_ranks_ = at::tensor(order, at::kLong);
  const std::string where = " in " + host_and_its_ranks(group) + ")";
  what_reduce_scatter_ = "two-level reduce_scatter (reduce-scatter" + where;
  what_all_gather_ = "two-level all_gather (all-gather" + where;
  what_broadcast_ = "two-level all_gather (broadcast from local rank 0" + where;
}

c10::intrusive_ptr<c10d::Work> TwoLevelGatherScatter::all_gather(std::vector<at::Tensor> outputs,
                                                                 std::vector<at::Tensor> inputs,
                                                                 c10d::OpType type, bool leader,
                                                                 std::chrono::milliseconds timeout,
                                                                 bool async_op) {
  check_.check_with_peers(Collective::kAllGather, "all_gather", timeout, [&] {
    check_pairs("all_gather", outputs, inputs, group_.size());
    check_written("all_gather", outputs);
  });
  return group_.enqueue(
      type, "xdev:all_gather", outputs,
      [this, outputs, inputs, leader, timeout] {
        const std::vector<at::Tensor> out = contiguous(outputs);
        std::vector<at::Tensor> in = contiguous(inputs);
        lend_copies_of_overlapping_inputs(in, outputs, group_.rank());
        std::vector<at::Tensor> all = out;
        all.insert(all.end(), inputs.begin(), inputs.end());
        run_all_gather(out, in, leader, group_.deadline_for(timeout), counts_hash(all));
        copy_back(out, outputs);
      },
      async_op);
}

c10::intrusive_ptr<c10d::Work> TwoLevelGatherScatter::reduce_scatter(
    std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs, kernels::ReduceOp op,
    c10d::OpType type, bool leader, std::chrono::milliseconds timeout, bool async_op) {
  check_.check_with_peers(Collective::kReduceScatter, "reduce_scatter", timeout, [&] {
    check_pairs("reduce_scatter", inputs, outputs, group_.size());
    check_written("reduce_scatter", outputs);
  });
  return group_.enqueue(
      type, "xdev:reduce_scatter", outputs,
      [this, outputs, inputs, op, leader, timeout] {
        std::vector<at::Tensor> out = contiguous(outputs);
        give_overlapping_outputs_own_buffers(out, inputs, group_.rank());
        std::vector<at::Tensor> all = out;
        all.insert(all.end(), inputs.begin(), inputs.end());
        run_reduce_scatter(out, contiguous(inputs), op, leader, group_.deadline_for(timeout),
                           counts_hash(all));
        copy_back(out, outputs);
      },
      async_op);
}

c10::intrusive_ptr<c10d::Work> TwoLevelGatherScatter::all_gather_list(
    std::vector<std::vector<at::Tensor>> outputs, std::vector<at::Tensor> inputs, c10d::OpType type,
    bool leader, std::chrono::milliseconds timeout, bool async_op) {
  std::vector<at::Tensor> full;
  std::vector<at::Tensor> work_outputs;
  check_.check_with_peers(Collective::kAllGather, "all_gather", timeout, [&] {
    TORCH_CHECK_VALUE(inputs.size() == outputs.size(), "xdev all_gather: ", outputs.size(),
                      " output list(s) for ", inputs.size(), " input(s)");
    for (size_t i = 0; i < inputs.size(); ++i) {
      full.push_back(
          flat_for_list("all_gather", outputs[i], inputs[i], group_.size(), group_.rank()));
      check_written("all_gather", outputs[i]);
      work_outputs.insert(work_outputs.end(), outputs[i].begin(), outputs[i].end());
    }
  });
  return group_.enqueue(
      type, "xdev:all_gather", work_outputs,
      [this, outputs, inputs, full, leader, timeout] {
        const std::vector<at::Tensor> in = contiguous(inputs);
        std::vector<at::Tensor> all = full;
        all.insert(all.end(), in.begin(), in.end());
        run_all_gather(full, in, leader, group_.deadline_for(timeout), counts_hash(all));
        for (size_t i = 0; i < outputs.size(); ++i) unpack_into(full[i], outputs[i]);
      },
      async_op);
}

c10::intrusive_ptr<c10d::Work> TwoLevelGatherScatter::reduce_scatter_list(
    std::vector<at::Tensor> outputs, std::vector<std::vector<at::Tensor>> inputs,
    kernels::ReduceOp op, bool leader, std::chrono::milliseconds timeout, bool async_op) {
  std::vector<at::Tensor> full;
  check_.check_with_peers(Collective::kReduceScatter, "reduce_scatter", timeout, [&] {
    TORCH_CHECK_VALUE(inputs.size() == outputs.size(), "xdev reduce_scatter: ", inputs.size(),
                      " input list(s) for ", outputs.size(), " output(s)");
    check_written("reduce_scatter", outputs);
    for (size_t i = 0; i < outputs.size(); ++i) {
      full.push_back(
          flat_for_list("reduce_scatter", inputs[i], outputs[i], group_.size(), group_.rank()));
    }
  });
  return group_.enqueue(
      c10d::OpType::REDUCE_SCATTER, "xdev:reduce_scatter", outputs,
      [this, outputs, inputs, full, op, leader, timeout] {
        for (size_t i = 0; i < outputs.size(); ++i) {
          std::vector<at::Tensor> pieces;  // rank j's piece, flattened, in rank order
          for (const at::Tensor& t : inputs[i]) pieces.push_back(t.reshape({-1}));
          at::Tensor dst = full[i];  // a handle: the lambda's copy is const
          at::cat_out(dst, pieces);
        }
        const std::vector<at::Tensor> out = contiguous(outputs);
        std::vector<at::Tensor> all = out;
        all.insert(all.end(), full.begin(), full.end());
        run_reduce_scatter(out, full, op, leader, group_.deadline_for(timeout), counts_hash(all));
        copy_back(out, outputs);
      },
      async_op);
}

void TwoLevelGatherScatter::run_all_gather(const std::vector<at::Tensor>& outputs,
                                           const std::vector<at::Tensor>& inputs, bool leader,
                                           transport::Clock::time_point deadline, uint64_t hash) {
  transport::OpDescriptor call;
  call.collective = static_cast<int32_t>(Collective::kAllGather);
  call.num_tensors = static_cast<int64_t>(inputs.size());
  for (const at::Tensor& t : inputs) call.total_elems += t.numel() * t.element_size();
  call.counts_hash = hash;
  std::vector<at::Tensor> full;  // host-major
  for (const at::Tensor& t : outputs) {
    full.push_back(host_major_ranks_.defined() ? at::empty_like(t) : t);
  }
  if (leader) {
    run_all_gather_leader(full, inputs, call, deadline, hash);
    if (host_major_ranks_.defined()) {
      for (size_t i = 0; i < outputs.size(); ++i) from_host_major(full[i], outputs[i]);
    }
    return;
  }
  const int hosts = group_.num_hosts();
  const int64_t local = group_.local_world_size();
  // This rank's blocks, every tensor's bytes one after another: what the engine gathers.
  std::vector<int64_t> block_bytes;
  std::vector<at::Tensor> pieces;
  for (const at::Tensor& t : inputs) {
    block_bytes.push_back(t.numel() * t.element_size());
    pieces.push_back(contiguous_bytes(t));
  }
  const at::Tensor mine = pieces.size() == 1 ? pieces[0] : at::cat(pieces);
  const int64_t total = mine.numel();
  // Small blocks ride in the check across hosts; larger ones go by the engine.
  const bool carried = plan::carried_across_hosts(total);
  const at::Tensor messages =
      check_.exchange(call, carried ? mine.data_ptr() : nullptr, total,
                      /*host_step_follows=*/true, "two-level all_gather", deadline);
  // The blocks of this local index, host by host.
  at::Tensor gathered;
  if (!carried) {
    gathered = at::empty({hosts * total}, mine.options());
    c10d::AllgatherOptions opts;
    opts.timeout = engine_timeout(deadline);
    at::Tensor in = mine;
    wait_for_engine(engine_->get()._allgather_base(gathered, in, opts), opts.timeout,
                    "two-level all_gather: the engine's all-gather across hosts");
  }
  // Where host h's blocks lie (the all-gather inside the host only reads them).
  const auto blocks_from = [&](int h) {
    return carried ? const_cast<char*>(CrossHostCheck::payload_of(messages, h))
                   : ptr(gathered) + h * total;
  };
  std::vector<char*> full_ptrs;
  std::vector<char*> block_ptrs;
  std::vector<int64_t> layout;
  for (int h = 0; h < hosts; ++h) {
    int64_t offset = 0;  // within host h's blocks
    for (size_t i = 0; i < inputs.size(); ++i) {
      full_ptrs.push_back(ptr(full[i]) + h * local * block_bytes[i]);
      block_ptrs.push_back(blocks_from(h) + offset);
      layout.push_back(block_bytes[i]);
      offset += block_bytes[i];
    }
  }
  run_in_host(plan::GatherScatterKind::kAllGather, full_ptrs, block_ptrs, plan::FlatLayout(layout),
              kernels::DType::kUInt8, 1, kernels::ReduceOp::kSum, kernels::ReduceOp::kSum, hash,
              deadline, heap_placement(full));
  if (host_major_ranks_.defined()) {
    for (size_t i = 0; i < outputs.size(); ++i) from_host_major(full[i], outputs[i]);
  }
}

void TwoLevelGatherScatter::run_all_gather_leader(const std::vector<at::Tensor>& full,
                                                  const std::vector<at::Tensor>& inputs,
                                                  const transport::OpDescriptor& call,
                                                  transport::Clock::time_point deadline,
                                                  uint64_t hash) {
  const int hosts = group_.num_hosts();
  const int host = group_.host_index();
  const int64_t local = group_.local_world_size();
  // Host h's L blocks of tensor i, as bytes of the host-major full tensor.
  const auto region = [&](size_t i, int h) {
    const int64_t bytes = local * inputs[i].numel() * inputs[i].element_size();
    return contiguous_bytes(full[i]).narrow(0, h * bytes, bytes);
  };
  std::vector<char*> full_ptrs;
  std::vector<char*> block_ptrs;
  std::vector<int64_t> layout;
  for (size_t i = 0; i < inputs.size(); ++i) {
    full_ptrs.push_back(ptr(region(i, host)));
    block_ptrs.push_back(ptr(inputs[i]));
    layout.push_back(inputs[i].numel() * inputs[i].element_size());
  }
  bool exchanged = false;
  try {
    // 1. This host's blocks on every local rank.
    run_in_host(plan::GatherScatterKind::kAllGather, full_ptrs, block_ptrs,
                plan::FlatLayout(layout), kernels::DType::kUInt8, 1, kernels::ReduceOp::kSum,
                kernels::ReduceOp::kSum, hash, deadline, {});
    // 2. Local rank 0 exchanges them, every tensor's one after another, with
    // the other hosts' local ranks 0. When the calls differ, the exchange
    // fails this host's broadcast on purpose, so its other ranks stop there.
    if (group_.local_rank() == 0) {
      std::vector<at::Tensor> own;
      for (size_t i = 0; i < inputs.size(); ++i) own.push_back(region(i, host));
      const at::Tensor mine = own.size() == 1 ? own[0] : at::cat(own);
      exchanged = true;
      // The selection gives this form only payloads that fit the message.
      TORCH_INTERNAL_ASSERT(plan::carried_across_hosts(mine.numel()),
                            "xdev: a leader-form payload outgrew the message across hosts");
      const at::Tensor messages =
          check_.exchange(call, mine.data_ptr(), mine.numel(), /*host_step_follows=*/true,
                          "two-level all_gather", deadline);
      for (int h = 0; h < hosts; ++h) {
        if (h == host) continue;
        const char* payload = CrossHostCheck::payload_of(messages, h);
        for (size_t i = 0; i < inputs.size(); ++i) {
          const at::Tensor dst = region(i, h);
          if (dst.numel() == 0) continue;  // an empty tensor may have no data pointer
          std::memcpy(dst.data_ptr(), payload, static_cast<size_t>(dst.numel()));
          payload += dst.numel();
        }
      }
    }
    // 3. The other hosts' blocks from local rank 0.
    std::vector<at::Tensor> others;
    for (int h = 0; h < hosts; ++h) {
      for (size_t i = 0; i < inputs.size() && h != host; ++i) others.push_back(region(i, h));
    }
    staged_broadcast(group_, broadcast_executor_, static_cast<int>(local), 0, others,
                     what_broadcast_.c_str(), deadline);
  } catch (const transport::MismatchError&) {
    // Every rank a mismatch stops crosses hosts once (TwoLevelAllreduce::run_leader).
    if (!exchanged) check_.refuse(deadline);
    throw;
  }
}

void TwoLevelGatherScatter::run_reduce_scatter(const std::vector<at::Tensor>& outputs,
                                               const std::vector<at::Tensor>& inputs,
                                               kernels::ReduceOp op, bool leader,
                                               transport::Clock::time_point deadline,
                                               uint64_t hash) {
  transport::OpDescriptor call;
  call.collective = static_cast<int32_t>(Collective::kReduceScatter);
  call.reduce_op = static_cast<int32_t>(op);
  call.dtype = static_cast<int32_t>(*native_dtype(inputs[0].scalar_type()));
  call.num_tensors = static_cast<int64_t>(inputs.size());
  for (const at::Tensor& t : inputs) call.total_elems += t.numel();
  call.counts_hash = hash;
  if (leader) {
    // The allreduce's leader form on a copy of the whole input, every
    // tensor's in rank order (so whichever host holds a rank), of which this
    // rank keeps its block of each.
    std::vector<at::Tensor> flat_inputs;
    for (const at::Tensor& t : inputs) flat_inputs.push_back(t.view({-1}));
    const at::Tensor totals = at::cat(flat_inputs);
    allreduce_.run_leader(totals, op, call, deadline, {}, "two-level reduce_scatter");
    int64_t start = 0;
    for (const at::Tensor& out : outputs) {
      const int64_t n = out.numel();
      out.view({-1}).copy_(totals.narrow(0, start + group_.rank() * n, n));
      start += group_.size() * n;
    }
    return;
  }
  const int hosts = group_.num_hosts();
  const int64_t local = group_.local_world_size();
  const int64_t elem_size = inputs[0].element_size();
  std::vector<at::Tensor> full;  // host-major
  int64_t total = 0;             // this rank's block: every tensor's, one after another
  for (size_t i = 0; i < inputs.size(); ++i) {
    full.push_back(host_major_ranks_.defined() ? to_host_major(inputs[i]) : inputs[i]);
    total += outputs[i].numel();
  }
  // This host's partial sums of the blocks of this local index, host by host.
  const at::Tensor packed = at::empty({hosts * total}, inputs[0].options());
  std::vector<char*> full_ptrs;
  std::vector<char*> block_ptrs;
  std::vector<int64_t> layout;
  for (int h = 0; h < hosts; ++h) {
    int64_t offset = h * total;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t block = outputs[i].numel();
      full_ptrs.push_back(ptr(full[i]) + h * local * block * elem_size);
      block_ptrs.push_back(ptr(packed) + offset * elem_size);
      layout.push_back(block);
      offset += block;
    }
  }
  const TwoLevelOps ops = two_level_ops(op, inputs[0].scalar_type());
  // The check across hosts; small partial sums ride in it once reduced, and
  // the rank then sums its block from every host's, in host order, as the
  // engine would not. Otherwise it leaves as soon as this host's ranks agree
  // on the call and travels while they reduce-scatter. No step inside the
  // host follows it: the host's ranks made the same call (their check
  // compares the call's shapes), so every cross-host group of a host sees the
  // same difference, and all of them fail there.
  const int64_t packed_bytes = packed.numel() * elem_size;
  const bool carried = plan::carried_across_hosts(packed_bytes);
  const at::Tensor messages = check_.exchange_around_host_step(
      call, carried, packed.data_ptr(), packed_bytes, /*host_step_follows=*/false,
      "two-level reduce_scatter", deadline, [&](std::function<void()> after_check) {
        run_in_host(plan::GatherScatterKind::kReduceScatter, full_ptrs, block_ptrs,
                    plan::FlatLayout(layout), *native_dtype(inputs[0].scalar_type()), elem_size,
                    ops.in_host, op, hash, deadline, heap_placement(full), std::move(after_check));
      });
  const at::Tensor mine =
      outputs.size() == 1 ? outputs[0].view({-1}) : at::empty({total}, inputs[0].options());
  if (carried) {
    // Every host's partial sums of this local index, packed host by host: ours is block host_index.
    check_.reduce_payloads(messages, group_.host_index() * total * elem_size, ops.across, mine);
  } else if (total > 0 && gathers_across_hosts(op, inputs[0].scalar_type())) {
    // Every host's partial results of this rank's block, host by host, reduced here.
    const at::Tensor rows = at::empty({hosts * total}, inputs[0].options());
    c10d::AllToAllOptions opts;
    opts.timeout = engine_timeout(deadline);
    at::Tensor out = rows;
    at::Tensor in = packed;
    std::vector<int64_t> even;  // empty: every host sends each host the same share
    wait_for_engine(engine_->get().alltoall_base(out, in, even, even, opts), opts.timeout,
                    "two-level reduce_scatter: the engine's all-to-all across hosts");
    reduce_rows_in_host_order(rows, hosts, op, mine);
  } else if (total > 0) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = two_level_engine_op(op);
    opts.timeout = engine_timeout(deadline);
    at::Tensor out = mine;
    at::Tensor in = packed;
    wait_for_engine(engine_->get()._reduce_scatter_base(out, in, opts), opts.timeout,
                    "two-level reduce_scatter: the engine's reduce-scatter across hosts");
  }
  if (ops.divide_after && !carried) divide_for_avg(mine, group_.size());
  if (outputs.size() > 1) unpack_into(mine, outputs);
}

void TwoLevelGatherScatter::run_in_host(
    plan::GatherScatterKind kind, const std::vector<char*>& full, const std::vector<char*>& block,
    const plan::FlatLayout& layout, kernels::DType dtype, int64_t elem_size, kernels::ReduceOp op,
    kernels::ReduceOp asked, uint64_t hash, transport::Clock::time_point deadline,
    const SharedPlacement& placement, std::function<void()> after_check) {
  const bool reduce_scatter = kind == plan::GatherScatterKind::kReduceScatter;
  const int64_t slot_bytes = group_.config().shm_slot_bytes;
  const plan::GatherScatterPlan plan(kind, group_.local_world_size(), layout.total(),
                                     slot_bytes / elem_size);
  transport::GatherScatterRequest req;
  req.plan = &plan;
  req.block_layout = &layout;
  req.full = full;
  req.block = block;
  req.dtype = dtype;
  req.op = op;
  req.avg_divisor = group_.size();  // an AVG inside the host divides by the whole group's size
  transport::OpDescriptor d =
      group_.next_descriptor(reduce_scatter ? Collective::kReduceScatter : Collective::kAllGather);
  d.reduce_op = reduce_scatter ? static_cast<int32_t>(asked) : 0;
  d.dtype = static_cast<int32_t>(dtype);
  d.num_tensors = static_cast<int64_t>(full.size());
  d.total_elems = layout.total();
  d.counts_hash = hash;
  req.ctx = group_.make_context(
      d, reduce_scatter ? what_reduce_scatter_.c_str() : what_all_gather_.c_str(), deadline);
  req.after_check = std::move(after_check);
  run_in_host_step(group_, executor_, req, placement,
                   reduce_scatter ? "two-level reduce_scatter" : "two-level all_gather");
}

SharedPlacement TwoLevelGatherScatter::heap_placement(const std::vector<at::Tensor>& full) const {
  // A host-major copy, or several tensors, are this rank's own memory.
  if (full.size() != 1 || host_major_ranks_.defined()) return {};
  return shared_.find(full[0]);
}

at::Tensor TwoLevelGatherScatter::to_host_major(const at::Tensor& full) const {
  return blocks_of(full).index_select(0, host_major_ranks_);
}

void TwoLevelGatherScatter::from_host_major(const at::Tensor& host_major,
                                            const at::Tensor& full) const {
  // Row k of the host-major copy is the block of group rank host_major_ranks_[k].
  blocks_of(full).index_copy_(0, host_major_ranks_, blocks_of(host_major));
}

at::Tensor TwoLevelGatherScatter::blocks_of(const at::Tensor& full) const {
  const int64_t world = group_.size();
  return contiguous_bytes(full).view({world, full.numel() * full.element_size() / world});
}

}  // namespace xdev::backend
