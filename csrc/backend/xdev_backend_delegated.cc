// XdevBackend's entry points for the collectives the engine (Gloo or NCCL)
// always runs: reduce to one root, gather, scatter, all-to-all and point to
// point. xdev adds what the engine lacks: the check with the peers before the
// engine runs reduce, gather, scatter and all-to-all (on one host), reduce's
// PREMUL_SUM scaling, and (through FallbackEngines) every dtype and layout for
// gather, scatter and all-to-all. Point to point goes to the engine as is.
#include "tensor_helpers.h"
#include "xdev_backend.h"

namespace xdev::backend {
namespace {

// What every rank of a collective the engine runs must agree on: the root,
// and the dtype, device and sizes of this rank's own part (`tensors`).
transport::OpDescriptor engine_call(const std::vector<at::Tensor>& tensors, int64_t root) {
  transport::OpDescriptor call;
  call.root = root;
  call.num_tensors = static_cast<int64_t>(tensors.size());
  if (!tensors.empty()) {
    call.dtype = static_cast<int32_t>(tensors[0].scalar_type());
    call.device = tensors[0].is_cuda() ? 1 : 0;
  }
  for (const at::Tensor& t : tensors) call.total_elems += t.numel();
  call.counts_hash = counts_hash(tensors);
  return call;
}

// A rooted call's arguments (gather's, scatter's): a root of this group, one
// tensor of this rank's own, and the root's list of one tensor per rank, each
// of the own tensor's dtype and sizes (Gloo's rule); no list elsewhere.
void check_rooted_call(const char* name, int64_t root, int rank, int size, const char* own_what,
                       const std::vector<at::Tensor>& own_tensors, const char* list_what,
                       const std::vector<std::vector<at::Tensor>>& lists) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "xdev ", name, ": root rank ", root,
                    " is not a rank of this group (ranks 0 to ", size - 1, ")");
  TORCH_CHECK_VALUE(own_tensors.size() == 1, "xdev ", name, ": takes one ", own_what,
                    " tensor, got ", own_tensors.size());
  const at::Tensor& own = own_tensors[0];
  if (rank != root) {
    TORCH_CHECK_VALUE(lists.empty(), "xdev ", name, ": only the root passes ", list_what,
                      " tensors");
    return;
  }
  const size_t got = lists.size() == 1 ? lists[0].size() : 0;
  TORCH_CHECK_VALUE(lists.size() == 1 && got == static_cast<size_t>(size), "xdev ", name,
                    ": the root passes a list of ", size, " ", list_what,
                    " tensors, one per rank; got ", got);
  for (size_t r = 0; r < got; ++r) {
    const at::Tensor& t = lists[0][r];
    TORCH_CHECK_TYPE(t.scalar_type() == own.scalar_type(), "xdev ", name, ": ", list_what,
                     " tensor ", r, " is ", t.scalar_type(), " where this rank's own is ",
                     own.scalar_type());
    TORCH_CHECK_VALUE(t.sizes() == own.sizes(), "xdev ", name, ": ", list_what, " tensor ", r,
                      " has sizes ", t.sizes(), " where this rank's own has ", own.sizes());
  }
}

// c10d's split sizes: none (equal parts) or one per rank, adding up to the
// first dimension.
void check_splits(const char* which, const std::vector<int64_t>& splits, const at::Tensor& t,
                  int size) {
  if (splits.empty()) {
    TORCH_CHECK_VALUE(t.numel() % size == 0, "xdev all_to_all_single: the ", which, " tensor's ",
                      t.numel(), " element(s) do not split evenly across ", size,
                      " ranks; pass its split sizes");
    return;
  }
  int64_t total = 0;
  for (int64_t s : splits) total += s;
  TORCH_CHECK_VALUE(splits.size() == static_cast<size_t>(size) && t.dim() > 0 && total == t.size(0),
                    "xdev all_to_all_single: ", splits.size(), " ", which,
                    " split size(s) adding up to ", total, " for a tensor of sizes ", t.sizes(),
                    "; pass one per rank (", size, "), adding up to its first dimension");
}

// All-to-all's part of engine_call: its dtype and device.
transport::OpDescriptor dtype_only(transport::OpDescriptor call) {
  call.num_tensors = 0;
  call.total_elems = 0;
  call.counts_hash = 0;
  return call;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> XdevBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  // First, as every PREMUL_SUM xdev scales: the ranks' vote on whether every
  // tensor can be scaled (a rank asking another op meets the vote, and every
  // rank fails); the SUM it becomes is checked below.
  if (premultiplies_here(opts.reduceOp, tensors)) {
    refuse_premul_with_peers(tensors, opts.reduceOp, opts.timeout);
    // The root's tensor receives the result, so it is scaled in place; the
    // others' stay as they are (NCCL leaves them so) and lend scaled copies.
    if (getRank() != opts.rootRank) {
      std::vector<at::Tensor> scaled = premultiplied(tensors, opts.reduceOp);
      return reduce(scaled, with_sum(opts));
    }
    premultiply_(tensors, opts.reduceOp);
    return reduce(tensors, with_sum(opts));
  }
  // The engine's reduce checks nothing across ranks: a rank's refusal left its
  // peers to time out, and a mismatched op, root or size mixed the calls or
  // aborted the process (Gloo). One meeting of the host's ranks first.
  transport::OpDescriptor call = engine_call(tensors, opts.rootRank);
  call.reduce_op = static_cast<int32_t>(opts.reduceOp.op_);
  group_.check_engine_call(
      Collective::kReduce, "reduce", opts.timeout, call,
      [&] {
        refuse_avg_of_bool("reduce", opts.reduceOp, tensors);
        fallbacks_.refuse_what_gloo_cannot_reduce(tensors, "reduce");
      },
      opts.asyncOp);
  return delegated_call().reduce(group_, tensors, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::GatherOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  // As reduce: the engine checks nothing across ranks (another size or dtype
  // aborted Gloo's process, another root waited out the timeout).
  group_.check_engine_call(
      Collective::kGather, "gather", opts.timeout, engine_call(inputs, opts.rootRank),
      [&] {
        check_rooted_call("gather", opts.rootRank, rank_, size_, "input", inputs, "output",
                          outputs);
      },
      opts.asyncOp);
  return delegated_call().gather(group_, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  // As gather (Gloo's scatter of another size filled part of the output).
  group_.check_engine_call(
      Collective::kScatter, "scatter", opts.timeout, engine_call(outputs, opts.rootRank),
      [&] {
        check_rooted_call("scatter", opts.rootRank, rank_, size_, "output", outputs, "input",
                          inputs);
      },
      opts.asyncOp);
  return delegated_call().scatter(group_, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& output_split_sizes,
                                                          std::vector<int64_t>& input_split_sizes,
                                                          const c10d::AllToAllOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  // The sizes may differ between ranks by design (uneven splits, which no
  // rank sees whole): the peers compare the dtype, and each rank its splits.
  group_.check_engine_call(
      Collective::kAllToAll, "all_to_all_single", opts.timeout, dtype_only(engine_call({input}, 0)),
      [&] {
        TORCH_CHECK_TYPE(output.scalar_type() == input.scalar_type(),
                         "xdev all_to_all_single: the output is ", output.scalar_type(),
                         " and the input ", input.scalar_type(), "; pass one dtype");
        check_splits("output", output_split_sizes, output, size_);
        check_splits("input", input_split_sizes, input, size_);
      },
      opts.asyncOp);
  return delegated_call().alltoall_base(group_, output, input, output_split_sizes,
                                        input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  group_.check_engine_call(
      Collective::kAllToAll, "all_to_all", opts.timeout, dtype_only(engine_call(inputs, 0)),
      [&] {
        TORCH_CHECK_VALUE(
            inputs.size() == static_cast<size_t>(size_) && outputs.size() == inputs.size(),
            "xdev all_to_all: takes one input and one output tensor per rank (", size_, "); got ",
            inputs.size(), " and ", outputs.size());
        for (const at::Tensor& t : outputs) {
          TORCH_CHECK_TYPE(t.scalar_type() == inputs[0].scalar_type(),
                           "xdev all_to_all: an output is ", t.scalar_type(), " and the inputs ",
                           inputs[0].scalar_type(), "; pass one dtype");
        }
      },
      opts.asyncOp);
  return delegated_call().alltoall(group_, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                 int tag) {
  const CallGate::Entry entry = gate_.enter();
  return fallbacks_.for_point_to_point(tensors)->send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                 int tag) {
  const CallGate::Entry entry = gate_.enter();
  return fallbacks_.for_point_to_point(tensors)->recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                          int tag) {
  const CallGate::Entry entry = gate_.enter();
  return fallbacks_.for_point_to_point(tensors)->recvAnysource(tensors, tag);
}

}  // namespace xdev::backend
