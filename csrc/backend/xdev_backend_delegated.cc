// XdevBackend's entry points for the collectives the engine (Gloo or NCCL)
// always runs: reduce to one root, gather, scatter, all-to-all and point to
// point. xdev adds what the engine lacks: reduce's check with the peers and
// its PREMUL_SUM scaling, and (through FallbackEngines) every dtype and layout
// for gather, scatter and all-to-all. Point to point goes to the engine as is.
#include "tensor_helpers.h"
#include "xdev_backend.h"

namespace xdev::backend {

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
  transport::OpDescriptor call;
  call.reduce_op = static_cast<int32_t>(opts.reduceOp.op_);
  call.root = opts.rootRank;
  call.num_tensors = static_cast<int64_t>(tensors.size());
  if (!tensors.empty()) {
    call.dtype = static_cast<int32_t>(tensors[0].scalar_type());
    call.device = tensors[0].is_cuda() ? 1 : 0;
  }
  for (const at::Tensor& t : tensors) call.total_elems += t.numel();
  call.counts_hash = counts_hash(tensors);
  group_.check_engine_call(Collective::kReduce, "reduce", opts.timeout, call, [&] {
    refuse_avg_of_bool("reduce", opts.reduceOp, tensors);
    fallbacks_.refuse_what_gloo_cannot_reduce(tensors, "reduce");
  });
  return delegated_call().reduce(group_, tensors, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::GatherOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  return delegated_call().gather(group_, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  return delegated_call().scatter(group_, outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& output_split_sizes,
                                                          std::vector<int64_t>& input_split_sizes,
                                                          const c10d::AllToAllOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  return delegated_call().alltoall_base(group_, output, input, output_split_sizes,
                                        input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
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
