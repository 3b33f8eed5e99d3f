// XdevBackend's entry points for the collectives the engine (Gloo or NCCL)
// always runs: reduce to one root, gather, scatter, all-to-all and point to
// point. xdev adds what the engine lacks: refusals every rank meets, the
// PREMUL_SUM scaling, and (through FallbackEngines) every dtype and layout.
#include "tensor_helpers.h"
#include "xdev_backend.h"

namespace xdev::backend {

c10::intrusive_ptr<c10d::Work> XdevBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  refuse_with_peers(Collective::kReduce, "reduce", tensors, opts.timeout, [&] {
    refuse_avg_of_bool("reduce", opts.reduceOp, tensors);
    fallbacks_.refuse_what_gloo_cannot_reduce(tensors, "reduce");
  });
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
