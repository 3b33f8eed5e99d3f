#include "cpu_gather_scatter.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "tensor_helpers.h"

namespace xdev::backend {
namespace {

std::vector<at::Tensor> concat(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  std::vector<at::Tensor> all = a;
  all.insert(all.end(), b.begin(), b.end());
  return all;
}

int64_t sum(const std::vector<int64_t>& v) {
  int64_t total = 0;
  for (int64_t x : v) total += x;
  return total;
}

// Whether every list holds one size for every rank.
bool is_even(const std::vector<std::vector<int64_t>>& sizes) {
  for (const auto& list : sizes) {
    for (int64_t n : list) {
      if (n != list[0]) return false;
    }
  }
  return true;
}

std::vector<char*> data_of(const std::vector<at::Tensor>& tensors) {
  std::vector<char*> ptrs;
  for (const at::Tensor& t : tensors) ptrs.push_back(static_cast<char*>(t.data_ptr()));
  return ptrs;
}

}  // namespace

CpuGatherScatter::CpuGatherScatter(GroupContext& group, const SharedBuffers& shared)
    : group_(group), shared_(shared) {
  if (group.channel() != nullptr) {
    executor_ = std::make_unique<transport::GatherScatterExecutor>(*group.channel());
  }
}

c10::intrusive_ptr<c10d::Work> CpuGatherScatter::reduce_scatter(
    std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs, kernels::ReduceOp op,
    c10d::OpType type, std::chrono::milliseconds timeout, bool async_op,
    const plan::GatherScatterSelection& how) {
  group_.check_with_peers(Collective::kReduceScatter, "reduce_scatter", timeout, [&] {
    check_pairs("reduce_scatter", inputs, outputs, group_.size());
    check_written("reduce_scatter", outputs);
  });
  return group_.enqueue(
      type, "xdev:reduce_scatter", outputs,
      [this, outputs, inputs, op, timeout, how] {
        std::vector<at::Tensor> out = contiguous(outputs);
        give_overlapping_outputs_own_buffers(out, inputs, group_.rank());
        run_reduce_scatter(out, contiguous(inputs), op, timeout, how);
        copy_back(out, outputs);
      },
      async_op);
}

c10::intrusive_ptr<c10d::Work> CpuGatherScatter::all_gather(
    std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs, c10d::OpType type,
    std::chrono::milliseconds timeout, bool async_op, const plan::GatherScatterSelection& how) {
  group_.check_with_peers(Collective::kAllGather, "all_gather", timeout, [&] {
    check_pairs("all_gather", outputs, inputs, group_.size());
    check_written("all_gather", outputs);
  });
  return group_.enqueue(
      type, "xdev:all_gather", outputs,
      [this, outputs, inputs, timeout, how] {
        std::vector<at::Tensor> in = contiguous(inputs);
        lend_copies_of_overlapping_inputs(in, outputs, group_.rank());
        const std::vector<at::Tensor> out = contiguous(outputs);
        run_all_gather(out, in, timeout, how);
        copy_back(out, outputs);
      },
      async_op);
}

c10::intrusive_ptr<c10d::Work> CpuGatherScatter::reduce_scatter_list(
    std::vector<at::Tensor> outputs, std::vector<std::vector<at::Tensor>> inputs,
    kernels::ReduceOp op, std::chrono::milliseconds timeout, bool async_op) {
  std::vector<at::Tensor> full;
  std::vector<std::vector<int64_t>> sizes;  // per list: each rank's block
  bool uneven = false;
  group_.check_with_peers(Collective::kReduceScatter, "reduce_scatter", timeout, [&] {
    TORCH_CHECK_VALUE(inputs.size() == outputs.size(), "xdev reduce_scatter: ", inputs.size(),
                      " input list(s) for ", outputs.size(), " output(s)");
    check_written("reduce_scatter", outputs);
    for (size_t i = 0; i < outputs.size(); ++i) {
      sizes.push_back(
          list_sizes("reduce_scatter", inputs[i], outputs[i], group_.size(), group_.rank()));
      full.push_back(at::empty({sum(sizes.back())}, outputs[i].options()));
    }
    uneven = !is_even(sizes);
    TORCH_CHECK_VALUE(!uneven || outputs.size() == 1,
                      "xdev reduce_scatter: uneven sizes need a single output");
  });
  return group_.enqueue(
      c10d::OpType::REDUCE_SCATTER, "xdev:reduce_scatter", outputs,
      [this, outputs, inputs, full, sizes, uneven, op, timeout] {
        for (size_t i = 0; i < outputs.size(); ++i) {
          std::vector<at::Tensor> pieces;  // rank j's piece, flattened, in rank order
          for (const at::Tensor& t : inputs[i]) pieces.push_back(t.reshape({-1}));
          at::Tensor dst = full[i];  // a handle: the lambda's copy is const
          at::cat_out(dst, pieces);
        }
        const std::vector<at::Tensor> out = contiguous(outputs);
        if (uneven) {
          run_uneven(plan::GatherScatterKind::kReduceScatter, full[0], out[0], sizes[0],
                     counts_hash(inputs[0]), op, timeout);
        } else {
          run_reduce_scatter(out, full, op, timeout, plan::GatherScatterSelection{});
        }
        copy_back(out, outputs);
      },
      async_op);
}

c10::intrusive_ptr<c10d::Work> CpuGatherScatter::all_gather_list(
    std::vector<std::vector<at::Tensor>> outputs, std::vector<at::Tensor> inputs,
    std::chrono::milliseconds timeout, bool async_op) {
  std::vector<at::Tensor> full;
  std::vector<std::vector<int64_t>> sizes;
  std::vector<at::Tensor> work_outputs;
  bool uneven = false;
  group_.check_with_peers(Collective::kAllGather, "all_gather", timeout, [&] {
    TORCH_CHECK_VALUE(inputs.size() == outputs.size(), "xdev all_gather: ", outputs.size(),
                      " output list(s) for ", inputs.size(), " input(s)");
    for (const std::vector<at::Tensor>& list : outputs) check_written("all_gather", list);
    for (size_t i = 0; i < inputs.size(); ++i) {
      sizes.push_back(
          list_sizes("all_gather", outputs[i], inputs[i], group_.size(), group_.rank()));
      full.push_back(at::empty({sum(sizes.back())}, inputs[i].options()));
      work_outputs.insert(work_outputs.end(), outputs[i].begin(), outputs[i].end());
    }
    uneven = !is_even(sizes);
    TORCH_CHECK_VALUE(!uneven || inputs.size() == 1,
                      "xdev all_gather: uneven sizes need a single input");
  });
  return group_.enqueue(
      c10d::OpType::ALLGATHER, "xdev:all_gather", work_outputs,
      [this, outputs, inputs, full, sizes, uneven, timeout] {
        const std::vector<at::Tensor> in = contiguous(inputs);
        if (uneven) {
          run_uneven(plan::GatherScatterKind::kAllGather, full[0], in[0], sizes[0],
                     counts_hash(outputs[0]), kernels::ReduceOp::kSum, timeout);
        } else {
          run_all_gather(full, in, timeout, plan::GatherScatterSelection{});
        }
        for (size_t i = 0; i < outputs.size(); ++i) unpack_into(full[i], outputs[i]);
      },
      async_op);
}

void CpuGatherScatter::run_uneven(plan::GatherScatterKind kind, const at::Tensor& full,
                                  const at::Tensor& block, const std::vector<int64_t>& sizes,
                                  uint64_t list_hash, kernels::ReduceOp op,
                                  std::chrono::milliseconds timeout) {
  const bool reduce_scatter = kind == plan::GatherScatterKind::kReduceScatter;
  if (executor_ == nullptr) {  // a world of one: its block is the whole list
    if (reduce_scatter) {
      block.view({-1}).copy_(full);
    } else {
      full.copy_(block.view({-1}));
    }
    return;
  }
  // Reduce-scatter reduces elements; all-gather moves bytes.
  const int64_t elem_size = full.element_size();
  const int64_t unit = reduce_scatter ? 1 : elem_size;  // of a block, per element
  std::vector<int64_t> blocks;
  std::vector<int64_t> starts;
  int64_t start = 0;
  for (int64_t n : sizes) {
    blocks.push_back(n * unit);
    starts.push_back(start);
    start += n * unit;
  }
  const int64_t slot_bytes = group_.config().shm_slot_bytes;
  const plan::GatherScatterPlan plan(kind, blocks,
                                     reduce_scatter ? slot_bytes / elem_size : slot_bytes);
  // Every piece lies within the largest block.
  const plan::FlatLayout layout({plan.block_elems()});
  transport::GatherScatterRequest req;
  req.plan = &plan;
  req.block_layout = &layout;
  req.full = {static_cast<char*>(full.data_ptr())};
  req.block = {static_cast<char*>(block.data_ptr())};
  req.block_starts = std::move(starts);
  req.dtype = reduce_scatter ? *native_dtype(full.scalar_type()) : kernels::DType::kUInt8;
  req.op = op;
  transport::OpDescriptor d =
      group_.next_descriptor(reduce_scatter ? Collective::kReduceScatter : Collective::kAllGather);
  d.reduce_op = reduce_scatter ? static_cast<int32_t>(op) : 0;
  d.dtype = static_cast<int32_t>(req.dtype);
  d.num_tensors = static_cast<int64_t>(sizes.size());  // the list: one tensor per rank
  d.total_elems = start;
  d.counts_hash = list_hash;
  req.ctx = group_.make_context(d, reduce_scatter ? "reduce_scatter" : "all_gather",
                                group_.deadline_for(timeout));
  executor_->run(req);
}

void CpuGatherScatter::run_reduce_scatter(const std::vector<at::Tensor>& outputs,
                                          const std::vector<at::Tensor>& inputs,
                                          kernels::ReduceOp op, std::chrono::milliseconds timeout,
                                          const plan::GatherScatterSelection& how) {
  const bool single_copy = how.single_copy;
  if (executor_ == nullptr) {  // a world of one: its block is the whole input
    for (size_t i = 0; i < outputs.size(); ++i) outputs[i].view({-1}).copy_(inputs[i].view({-1}));
    return;
  }
  const auto deadline = group_.deadline_for(timeout);
  const uint64_t hash = counts_hash(concat(outputs, inputs));
  const int64_t slot_bytes = group_.config().shm_slot_bytes;
  // One collective per dtype, in order of first appearance: the same on every rank.
  for (const plan::DtypeGroup& g : group_by_scalar_type(outputs)) {
    // Single copy (one tensor): one window over the whole block.
    const int64_t window_elems = single_copy
                                     ? std::max<int64_t>(g.layout.total(), 1) * group_.size()
                                     : slot_bytes / static_cast<int64_t>(g.elem_size);
    const plan::GatherScatterPlan plan(plan::GatherScatterKind::kReduceScatter, group_.size(),
                                       g.layout.total(), window_elems);
    transport::GatherScatterRequest req;
    req.plan = &plan;
    req.block_layout = &g.layout;
    for (size_t idx : g.tensor_indices) {
      req.full.push_back(static_cast<char*>(inputs[idx].data_ptr()));
      req.block.push_back(static_cast<char*>(outputs[idx].data_ptr()));
    }
    req.dtype = *native_dtype(static_cast<at::ScalarType>(g.dtype));
    req.op = op;
    req.single_copy = single_copy;
    transport::OpDescriptor d = group_.next_descriptor(Collective::kReduceScatter);
    d.reduce_op = static_cast<int32_t>(op);
    d.single_copy = single_copy ? 1 : 0;
    d.dtype = static_cast<int32_t>(req.dtype);
    d.num_tensors = static_cast<int64_t>(outputs.size());
    d.total_elems = g.layout.total();
    d.counts_hash = hash;
    req.ctx = group_.make_context(d, "reduce_scatter", deadline);
    run_request(req, inputs[g.tensor_indices[0]], "reduce_scatter", how.in_place);
  }
}

void CpuGatherScatter::run_all_gather(const std::vector<at::Tensor>& outputs,
                                      const std::vector<at::Tensor>& inputs,
                                      std::chrono::milliseconds timeout,
                                      const plan::GatherScatterSelection& how) {
  const bool single_copy = how.single_copy;
  if (executor_ == nullptr) {
    for (size_t i = 0; i < outputs.size(); ++i) outputs[i].view({-1}).copy_(inputs[i].view({-1}));
    return;
  }
  // Bytes move: one collective for every dtype of the call.
  std::vector<int64_t> block_bytes;
  for (const at::Tensor& t : inputs) block_bytes.push_back(t.numel() * t.element_size());
  const plan::FlatLayout layout(block_bytes);
  const int64_t window_bytes = single_copy ? std::max<int64_t>(layout.total(), 1) * group_.size()
                                           : group_.config().shm_slot_bytes;
  const plan::GatherScatterPlan plan(plan::GatherScatterKind::kAllGather, group_.size(),
                                     layout.total(), window_bytes);
  transport::GatherScatterRequest req;
  req.plan = &plan;
  req.block_layout = &layout;
  req.full = data_of(outputs);
  req.block = data_of(inputs);
  req.dtype = kernels::DType::kUInt8;
  req.single_copy = single_copy;
  transport::OpDescriptor d = group_.next_descriptor(Collective::kAllGather);
  d.single_copy = single_copy ? 1 : 0;
  d.dtype = static_cast<int32_t>(kernels::DType::kUInt8);
  d.num_tensors = static_cast<int64_t>(inputs.size());
  d.total_elems = layout.total();
  d.counts_hash = counts_hash(concat(outputs, inputs));
  req.ctx = group_.make_context(d, "all_gather", group_.deadline_for(timeout));
  run_request(req, outputs[0], "all_gather", how.in_place);
}

void CpuGatherScatter::run_request(transport::GatherScatterRequest& req, const at::Tensor& full,
                                   const char* name, bool in_place) {
  // In place where the selection chose it (one tensor of the heap, a size
  // where the model says skipping the staging pays for the closing barrier
  // that keeps every tensor unchanged while peers read it), and where the
  // tensor is in the heap on this rank too.
  SharedPlacement placement;
  if (in_place && req.full.size() == 1 && !req.single_copy) {
    placement = shared_.find(full);
  }
  const std::string op = name;
  switch (run_from_heap(group_, *executor_, req, placement, *group_.channel())) {
    case HeapRun::kInPlace:
      group_.log_once(op + ":in-place", op +
                                            " ran in place from the symmetric heap (every rank's " +
                                            (op == "all_gather" ? "output" : "input") +
                                            " at the same place): nothing staged");
      break;
    case HeapRun::kPlacesDiffer:
      group_.log_once(op + ":heap-places-differ",
                      op + ": a tensor of the symmetric heap is not at the same place on every "
                           "rank (allocated in another order, or an ordinary tensor on some "
                           "rank); staged");
      break;
    case HeapRun::kNotInHeap:
      break;
  }
}

HeapRun run_from_heap(GroupContext& group, transport::GatherScatterExecutor& executor,
                      transport::GatherScatterRequest& req, const SharedPlacement& placement,
                      const transport::ShmChannel& channel) {
  if (placement.heap == nullptr) {
    executor.run(req);
    return HeapRun::kNotInHeap;
  }
  if (!map_peers_copies(group, placement, channel)) {
    executor.run(req);
    placement.heap->count_collective(/*in_place=*/false);
    return HeapRun::kNotInHeap;
  }
  req.ctx.descriptor.heap_arena = placement.heap_location.arena;
  req.ctx.descriptor.heap_offset = placement.heap_location.offset;
  req.full_copies = [&placement, &channel] { return copies_of(placement, channel); };
  const bool in_place = executor.run(req);
  placement.heap->count_collective(in_place);
  return in_place ? HeapRun::kInPlace : HeapRun::kPlacesDiffer;
}

}  // namespace xdev::backend
