// XdevBackend's all-gather and reduce-scatter entry points (every c10d form:
// native on one host, in two levels across hosts, else the engine) and their
// selection.
#include <ATen/ops/view_as_real.h>
#include <c10/util/Exception.h>

#include <string>

#include "moved_tensors.h"
#include "tensor_helpers.h"
#include "xdev_backend.h"
#include "xdev_work.h"

namespace xdev::backend {
namespace {

// c10d's OpType gained REDUCE_SCATTER_TENSOR_COALESCED after torch 2.11; older
// releases label the coalesced reduce-scatter REDUCE_SCATTER.
template <typename OpType>
constexpr auto coalesced_reduce_scatter(int) -> decltype(OpType::REDUCE_SCATTER_TENSOR_COALESCED) {
  return OpType::REDUCE_SCATTER_TENSOR_COALESCED;
}
template <typename OpType>
constexpr OpType coalesced_reduce_scatter(long) {
  return OpType::REDUCE_SCATTER;
}
constexpr c10d::OpType reduce_scatter_coalesced_op_type() {
  return coalesced_reduce_scatter<c10d::OpType>(0);
}

// The Work of a complex reduction run on real views of the caller's tensors:
// its result and future show the complex tensors, as a Work of theirs would.
c10::intrusive_ptr<c10d::Work> shown_as(c10::intrusive_ptr<c10d::Work> work,
                                        const std::vector<at::Tensor>& complex_outputs) {
  const c10d::OpType type = work->retrieveOpType();
  return c10::make_intrusive<ShownResultWork>(std::move(work), type, complex_outputs,
                                              c10::IValue(complex_outputs));
}

// A list form's tensors as select_gather_scatter takes them: `all` (this
// rank's own tensors, then every list's), `full` (every list's: what the call
// moves), and whether a list holds a size unlike this rank's tensor's.
struct ListCall {
  std::vector<at::Tensor> all;
  std::vector<at::Tensor> full;
  bool uneven = false;
};

ListCall list_call(const std::vector<at::Tensor>& mine,
                   const std::vector<std::vector<at::Tensor>>& lists) {
  ListCall call{mine, {}, false};
  for (size_t i = 0; i < lists.size(); ++i) {
    for (const at::Tensor& t : lists[i]) {
      call.all.push_back(t);
      call.full.push_back(t);
      call.uneven = call.uneven || (i < mine.size() && t.numel() != mine[i].numel());
    }
  }
  return call;
}

// The bytes a valid call moves, from this rank's own blocks: `world` times
// each block's elements, in the dtype of the full tensor it pairs with where
// the call reduces (the dtype the peers share) and in its own where it moves
// bytes. full holds one tensor per block, or (a list form) `world` per block.
int64_t bytes_of_a_valid_call(const std::vector<at::Tensor>& blocks,
                              const std::vector<at::Tensor>& full, bool reduces, int world) {
  const size_t full_per_block = blocks.empty() ? 0 : full.size() / blocks.size();
  int64_t bytes = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const size_t paired = i * full_per_block;
    const at::Tensor& dtype_of = reduces && paired < full.size() ? full[paired] : blocks[i];
    bytes += blocks[i].numel() * static_cast<int64_t>(dtype_of.element_size());
  }
  return world * bytes;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> XdevBackend::cuda_gather_scatter(
    plan::GatherScatterKind kind, std::vector<at::Tensor> full,
    const std::vector<at::Tensor>& blocks, const c10d::ReduceOp* op, c10d::OpType type,
    std::chrono::milliseconds timeout) {
  // Checked as the CPU paths check them. A rank that refuses its arguments
  // still meets its peers at the host barrier, so that they fail at this call
  // too instead of waiting for it; without that barrier (cuda_host_check off)
  // it takes the call's sequence number, and they stop in the GPU barrier at
  // its next call or at the timeout (check_native_call).
  const char* what = op == nullptr ? "all_gather" : "reduce_scatter";
  auto check = [&] {
    if (full.size() == 1) {  // the tensor form (the CUDA path has at least two ranks)
      check_pairs(what, full, blocks, size_);
    } else {
      TORCH_CHECK_VALUE(blocks.size() == 1, "xdev ", what, ": one list takes one ",
                        op == nullptr ? "input" : "output", "; got ", blocks.size());
      list_sizes(what, full, blocks[0], size_, rank_);  // one dtype; the selection refused uneven
    }
    check_written(what, op == nullptr ? full : blocks);
  };
  check_native_call(op == nullptr ? Collective::kAllGather : Collective::kReduceScatter, what, true,
                    timeout, check);
  return cuda_->gather_scatter(kind, std::move(full), blocks[0],
                               op == nullptr ? kernels::ReduceOp::kSum : *native_op(*op), type,
                               timeout);
}

plan::GatherScatterSelection XdevBackend::select_gather_scatter(
    const char* name, const std::vector<at::Tensor>& tensors,
    const std::vector<at::Tensor>& full_tensors, const std::vector<at::Tensor>& blocks,
    const c10d::ReduceOp* op, bool uneven_list_sizes, bool one_list) {
  plan::GatherScatterInput in;
  in.one_list = one_list;
  in.uneven_list_sizes = uneven_list_sizes;
  in.requested = group_.requested();
  in.world_size = size_;
  in.num_hosts = group_.num_hosts();
  in.transport_available = group_.channel() != nullptr;
  in.op_supported = op == nullptr || native_op(*op).has_value();
  for (const at::Tensor& t : tensors) {
    if (t.device().is_cuda()) in.device = plan::DeviceKind::kCuda;
    in.op_supported =
        in.op_supported && t.layout() == at::kStrided && t.device() == tensors[0].device();
  }
  // The dtype that decides is the one every rank's call shares: the reduced
  // tensors'. An output of another dtype is this rank's own mistake, which the
  // native path refuses together with the peers; judged here, it sent this
  // rank alone to the engine, and the peers' native call paired with this
  // rank's next one.
  for (const at::Tensor& t : full_tensors) {
    in.op_supported =
        in.op_supported && (op == nullptr || native_dtype(t.scalar_type()).has_value());
  }
  if (in.device == plan::DeviceKind::kCuda) {
    const CudaGroupInfo* info = nullptr;
    if (cuda_ != nullptr && size_ > 1 && tensors[0].device().is_cuda()) {
      // Collective on first use, as for the allreduce.
      info = &cuda_->ensure_ready(tensors[0].device().index());
    }
    in.transport_available = info != nullptr && info->transport;
    in.transport_note = info != nullptr    ? info->transport_note
                        : cuda_ == nullptr ? "this build has no CUDA path"
                                           : "one rank, or tensors on several devices";
    if (info != nullptr)
      refuse_during_capture(info->device, in.transport_available, in.transport_note);
    in.nccl_available = info != nullptr && !info->ranks_share_gpu;
    in.gpu_time_sliced = info != nullptr && info->gpu_time_sliced;
    if (info != nullptr && info->model) {  // what auto's reason weighs: xdev's form and NCCL
      in.model = &*info->model;
      in.model_cache = &cuda_gather_scatter_choices_;
    }
  }
  // The size the choice follows: world x this rank's blocks, which equals
  // every rank's full tensors in a valid call. Uneven lists have no such
  // size: their full tensors' bytes, alike on every rank of a valid call.
  const int64_t full_bytes = payload_bytes(full_tensors);
  in.payload_bytes = uneven_list_sizes
                         ? full_bytes
                         : bytes_of_a_valid_call(blocks, full_tensors, op != nullptr, size_);
  in.num_tensors = static_cast<int64_t>(full_tensors.size());
  in.single_copy_available = cpu_ != nullptr && cpu_->single_copy_available();
  // The CPU model chooses the form; a reduce-scatter predicts with its dtype's width.
  in.kind =
      op == nullptr ? plan::GatherScatterKind::kAllGather : plan::GatherScatterKind::kReduceScatter;
  if (!full_tensors.empty()) in.elem_bytes = full_tensors[0].element_size();
  if (cpu_ != nullptr && in.device == plan::DeviceKind::kCpu) {
    in.model = &cpu_->model();
    in.model_cache = &gather_scatter_choices_;
    // The tensor peers would read in place: a reduce-scatter's input, an all-gather's output.
    in.in_symmetric_heap = full_tensors.size() == 1 && full_tensors[0].device().is_cpu() &&
                           shared_.find(full_tensors[0]).heap != nullptr;
  }
  in.two_level_note = two_level_note_;
  if (two_level_gather_scatter_ != nullptr) {
    in.two_level_available = true;
    in.two_level_note.clear();
    // A reduce-scatter reduces one dtype (the engine has no AVG: a division after its SUM).
    for (const at::Tensor& t : full_tensors) {
      if (op != nullptr && t.scalar_type() != full_tensors[0].scalar_type()) {
        in.two_level_available = false;
        in.two_level_note = "tensors of several dtypes";
      }
    }
    in.ranks_per_host = group_.local_world_size();
    in.host_model = &two_level_->host_model();
    in.network = &two_level_->network();
    const std::optional<kernels::ReduceOp> reduce = op ? native_op(*op) : std::nullopt;
    in.engine_may_drop_nan = reduce && !full_tensors.empty() &&
                             gathers_across_hosts(*reduce, full_tensors[0].scalar_type());
  }
  plan::GatherScatterSelection sel = plan::select_gather_scatter(in);
  if (sel.path == plan::GatherScatterPath::kFallback && in.payload_bytes != full_bytes) {
    // This rank's call is wrong (its full tensors and its blocks disagree),
    // and its peers chose by whichever side this rank got right, which it
    // cannot tell. Where the two sizes choose differently, the native path:
    // if the peers are there (its blocks were wrong), its check refuses the
    // call with them; if they are in the engine (its full tensors were), every
    // rank fails at the timeout. In the engine this rank would fail alone at
    // once, and its next call could pair with the peers' pending one.
    plan::GatherScatterInput by_full = in;
    by_full.payload_bytes = full_bytes;
    const plan::GatherScatterSelection other = plan::select_gather_scatter(by_full);
    if (other.path != plan::GatherScatterPath::kFallback) sel = other;
  }
  {
    std::lock_guard<std::mutex> lock(selection_mutex_);
    last_gather_scatter_ = {name, plan::to_string(sel.path), sel.reason};
  }
  const char* device = in.device == plan::DeviceKind::kCuda ? "CUDA" : "CPU";
  group_.log_once(std::string(name) + ":" + device + ":" + sel.reason,
                  std::string(name) + " on " + device + " tensors -> " + plan::to_string(sel.path) +
                      " (" + sel.reason + ")");
  if (sel.path != plan::GatherScatterPath::kFallback) ++collectives_called_;
  return sel;
}

// ---- Entry points ----

c10::intrusive_ptr<c10d::Work> XdevBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  const ListCall call = list_call(inputs, outputs);
  const auto sel = select_gather_scatter("all_gather", call.all, call.full, inputs, nullptr,
                                         call.uneven, outputs.size() == 1);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    return delegated_call().allgather(group_, outputs, inputs, opts);
  }
  if (sel.path == plan::GatherScatterPath::kCuda) {  // one list (the selection's condition)
    return cuda_gather_scatter(plan::GatherScatterKind::kAllGather, outputs.at(0), inputs, nullptr,
                               c10d::OpType::ALLGATHER, opts.timeout);
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->all_gather_list(
        outputs, inputs, c10d::OpType::ALLGATHER, sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  return gather_scatter_->all_gather_list(outputs, inputs, opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  const auto sel = select_gather_scatter("all_gather", {output, input}, {output}, {input}, nullptr);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    check_pairs("all_gather_into_tensor", {output}, {input}, size_);  // as the native path
    // Gloo wants a contiguous output of the input's shape times the world; a
    // strided output (the native path takes one) gets a contiguous copy.
    c10d::Backend* engine = delegate(input);
    std::vector<at::Tensor> outputs{output};
    return fallbacks_.on_contiguous(
        group_, outputs, c10d::OpType::_ALLGATHER_BASE, "xdev:all_gather_into_tensor",
        [engine, &input, &opts, world = size_](std::vector<at::Tensor>& outs) {
          MovedTensors moved;
          at::Tensor flat_out = moved.move(outs[0].view({-1}));
          at::Tensor flat_in = moved.move(input.reshape({-1}));
          c10::intrusive_ptr<c10d::Work> work = moved.run(c10d::OpType::_ALLGATHER_BASE, [&] {
            return engine->_allgather_base(flat_out, flat_in, opts);
          });
          // What Gloo shows of its own: the output's blocks along its first dimension.
          std::vector<at::Tensor> blocks =
              outs[0].dim() == 0 ? std::vector<at::Tensor>{outs[0]} : outs[0].chunk(world);
          return c10::make_intrusive<ShownResultWork>(
              std::move(work), c10d::OpType::_ALLGATHER_BASE, blocks, c10::IValue(blocks));
        });
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->all_gather({output}, {input}, c10d::OpType::_ALLGATHER_BASE,
                                                 sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  if (sel.path == plan::GatherScatterPath::kCuda) {
    return cuda_gather_scatter(plan::GatherScatterKind::kAllGather, {output}, {input}, nullptr,
                               c10d::OpType::_ALLGATHER_BASE, opts.timeout);
  }
  return gather_scatter_->all_gather({output}, {input}, c10d::OpType::_ALLGATHER_BASE, opts.timeout,
                                     opts.asyncOp, sel);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  // outputs[r][i] receives rank r's inputs[i]. Checked as Gloo checks it, so a
  // wrong call is a ValueError on the rank that made it; on the native path
  // that rank still meets its peers, which fail at this same call.
  const auto check_shapes = [&] {
    TORCH_CHECK_VALUE(!inputs.empty(), "xdev all_gather_coalesced: no input tensors given");
    TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_,
                      "xdev all_gather_coalesced: needs one output list per rank (", size_,
                      "); got ", outputs.size());
    for (size_t r = 0; r < outputs.size(); ++r) {
      TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(),
                        "xdev all_gather_coalesced: output list ", r, " has ", outputs[r].size(),
                        " tensor(s) for ", inputs.size(), " input(s)");
      for (size_t i = 0; i < inputs.size(); ++i) {
        const at::Tensor& out = outputs[r][i];
        TORCH_CHECK_VALUE(
            out.sizes() == inputs[i].sizes() && out.scalar_type() == inputs[i].scalar_type(),
            "xdev all_gather_coalesced: output ", r, "/", i, " (", out.scalar_type(), " ",
            out.sizes(), ") must match input ", i, " (", inputs[i].scalar_type(), " ",
            inputs[i].sizes(), ")");
      }
    }
  };
  const auto check_outputs_written = [&] {
    for (const std::vector<at::Tensor>& per_rank : outputs) {
      check_written("all_gather_coalesced", per_rank);
    }
  };
  std::vector<at::Tensor> all = inputs;
  std::vector<at::Tensor> full;  // every output: what the call moves
  for (const std::vector<at::Tensor>& per_rank : outputs) {
    all.insert(all.end(), per_rank.begin(), per_rank.end());
    full.insert(full.end(), per_rank.begin(), per_rank.end());
  }
  const auto sel = select_gather_scatter("all_gather_coalesced", all, full, inputs, nullptr);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    check_shapes();
    // Across hosts Gloo writes the outputs itself, and a refusal here would
    // leave the peers in Gloo; on one host such outputs are refused as on
    // the native path.
    if (group_.channel() != nullptr) check_outputs_written();
    return delegated_call().allgather_coalesced(group_, outputs, inputs, opts);
  }
  check_native_call(Collective::kAllGather, "all_gather_coalesced", false, opts.timeout, [&] {
    check_shapes();
    check_outputs_written();
  });
  // The list form with one list per input (lists[i][r] = outputs[r][i]): one
  // all-gather of every input's bytes, each rank's block the inputs in order.
  std::vector<std::vector<at::Tensor>> lists(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (const std::vector<at::Tensor>& per_rank : outputs) lists[i].push_back(per_rank[i]);
  }
  c10::intrusive_ptr<c10d::Work> work =
      sel.path == plan::GatherScatterPath::kTwoLevel
          ? two_level_gather_scatter_->all_gather_list(
                std::move(lists), inputs, c10d::OpType::ALLGATHER_COALESCED, sel.two_level_leader,
                opts.timeout, opts.asyncOp)
          : gather_scatter_->all_gather_list(std::move(lists), inputs, opts.timeout, opts.asyncOp);
  std::vector<at::Tensor> written = work->result();
  return c10::make_intrusive<ShownResultWork>(std::move(work), c10d::OpType::ALLGATHER_COALESCED,
                                              std::move(written), c10::IValue(outputs));
}

c10::intrusive_ptr<c10d::Work> XdevBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  std::vector<at::Tensor> all = outputs;
  all.insert(all.end(), inputs.begin(), inputs.end());
  const auto sel = select_gather_scatter("all_gather", all, outputs, inputs, nullptr);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    // Checked here: Gloo reads each output's blocks without checking their sizes.
    check_pairs("all_gather_into_tensor_coalesced", outputs, inputs, size_);
    // Gloo packs every pair into one buffer of one dtype, which garbled pairs of
    // several dtypes: an all-gather moves bytes, so the engine gets bytes, and
    // strided outputs as contiguous copies (on_contiguous copies them back).
    c10d::Backend* engine = delegate(inputs);
    return fallbacks_.on_contiguous(
        group_, outputs, c10d::OpType::COALESCED, "xdev:all_gather_into_tensor_coalesced",
        [engine, &inputs, &opts](std::vector<at::Tensor>& contiguous_outputs) {
          MovedTensors moved;
          const auto flat_bytes = [&moved](const at::Tensor& t) {
            at::Tensor bytes = t.reshape({-1}).contiguous().view(at::kByte);
            moved.show_as(bytes, t);
            return bytes;
          };
          std::vector<at::Tensor> byte_inputs, byte_outputs;
          for (const at::Tensor& t : inputs) byte_inputs.push_back(flat_bytes(t));
          for (const at::Tensor& t : contiguous_outputs) byte_outputs.push_back(flat_bytes(t));
          return moved.run(c10d::OpType::COALESCED, [&] {
            return engine->allgather_into_tensor_coalesced(byte_outputs, byte_inputs, opts);
          });
        });
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->all_gather(outputs, inputs, c10d::OpType::COALESCED,
                                                 sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  if (sel.path == plan::GatherScatterPath::kCuda) {  // one pair (the selection's condition)
    return cuda_gather_scatter(plan::GatherScatterKind::kAllGather, {outputs.at(0)}, inputs,
                               nullptr, c10d::OpType::COALESCED, opts.timeout);
  }
  return gather_scatter_->all_gather(outputs, inputs, c10d::OpType::COALESCED, opts.timeout,
                                     opts.asyncOp, sel);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  refuse_with_peers(Collective::kReduceScatter, "reduce_scatter", outputs, opts.timeout,
                    [&] { refuse_avg_of_bool("reduce_scatter", opts.reduceOp, outputs); });
  if (premultiplies_here(opts.reduceOp, outputs)) {
    std::vector<at::Tensor> all_inputs;
    for (const std::vector<at::Tensor>& list : inputs) {
      all_inputs.insert(all_inputs.end(), list.begin(), list.end());
    }
    refuse_premul_with_peers(all_inputs, opts.reduceOp, opts.timeout);
    std::vector<std::vector<at::Tensor>> scaled;
    for (const std::vector<at::Tensor>& list : inputs) {
      scaled.push_back(premultiplied(list, opts.reduceOp));
    }
    return reduce_scatter(outputs, scaled, with_sum(opts));
  }
  // Each output with its list of one tensor per rank.
  std::vector<std::vector<at::Tensor>> pairs;
  bool lists_fit = outputs.size() == inputs.size();
  for (size_t i = 0; i < outputs.size() && i < inputs.size(); ++i) {
    lists_fit = lists_fit && static_cast<int>(inputs[i].size()) == size_;
    pairs.push_back(inputs[i]);
    pairs.back().push_back(outputs[i]);
  }
  if (lists_fit && reduces_complex_as_real(opts.reduceOp, pairs)) {
    std::vector<at::Tensor> real_outputs = real_views(outputs);
    std::vector<std::vector<at::Tensor>> real_inputs;
    for (const std::vector<at::Tensor>& list : inputs) real_inputs.push_back(real_views(list));
    return shown_as(reduce_scatter(real_outputs, real_inputs, opts), outputs);
  }
  const ListCall call = list_call(outputs, inputs);
  const auto sel = select_gather_scatter("reduce_scatter", call.all, call.full, outputs,
                                         &opts.reduceOp, call.uneven, inputs.size() == 1);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    refuse_engine_reduce_scatter("reduce_scatter", outputs, opts.timeout);
    return delegated_call().reduce_scatter(
        group_, outputs, opts, c10d::OpType::REDUCE_SCATTER,
        [&](c10d::Backend& engine, const c10d::ReduceScatterOptions& o,
            std::vector<at::Tensor>& outs, bool in_float) {
          std::vector<at::Tensor> flat_outs = flat_views(outs);
          std::vector<std::vector<at::Tensor>> flat_inputs;
          for (const std::vector<at::Tensor>& list : inputs)
            flat_inputs.push_back(flattened(list, in_float));
          return engine.reduce_scatter(flat_outs, flat_inputs, o);
        });
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->reduce_scatter_list(
        outputs, inputs, *native_op(opts.reduceOp), sel.two_level_leader, opts.timeout,
        opts.asyncOp);
  }
  if (sel.path == plan::GatherScatterPath::kCuda) {  // one list (the selection's condition)
    return cuda_gather_scatter(plan::GatherScatterKind::kReduceScatter, inputs.at(0), outputs,
                               &opts.reduceOp, c10d::OpType::REDUCE_SCATTER, opts.timeout);
  }
  return gather_scatter_->reduce_scatter_list(outputs, inputs, *native_op(opts.reduceOp),
                                              opts.timeout, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  refuse_with_peers(Collective::kReduceScatter, "reduce_scatter_tensor", {output}, opts.timeout,
                    [&] { refuse_avg_of_bool("reduce_scatter_tensor", opts.reduceOp, {output}); });
  if (premultiplies_here(opts.reduceOp, {output})) {
    refuse_premul_with_peers({input}, opts.reduceOp, opts.timeout);
    at::Tensor scaled = premultiplied(input, opts.reduceOp);
    return _reduce_scatter_base(output, scaled, with_sum(opts));
  }
  if (pairs_fit({input}, {output}, size_) &&
      reduces_complex_as_real(opts.reduceOp, {{output, input}})) {
    at::Tensor real_output = at::view_as_real(output);  // both complex: the check says so
    at::Tensor real_input = at::view_as_real(input);
    return shown_as(_reduce_scatter_base(real_output, real_input, opts), {output});
  }
  const auto sel =
      select_gather_scatter("reduce_scatter", {output, input}, {input}, {output}, &opts.reduceOp);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    refuse_engine_reduce_scatter("reduce_scatter_tensor", {output}, opts.timeout, [&] {
      check_pairs("reduce_scatter_tensor", {input}, {output}, size_);  // Gloo's check aborts
    });
    return delegated_call().reduce_scatter(
        group_, {output}, opts, c10d::OpType::_REDUCE_SCATTER_BASE,
        [&](c10d::Backend& engine, const c10d::ReduceScatterOptions& o,
            std::vector<at::Tensor>& outs, bool in_float) {
          at::Tensor flat_out = outs[0].view({-1});
          at::Tensor flat_in = input.reshape({-1});
          if (in_float) flat_in = in_float_if_reduced(flat_in);
          return engine._reduce_scatter_base(flat_out, flat_in, o);
        });
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->reduce_scatter(
        {output}, {input}, *native_op(opts.reduceOp), c10d::OpType::_REDUCE_SCATTER_BASE,
        sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  if (sel.path == plan::GatherScatterPath::kCuda) {
    return cuda_gather_scatter(plan::GatherScatterKind::kReduceScatter, {input}, {output},
                               &opts.reduceOp, c10d::OpType::_REDUCE_SCATTER_BASE, opts.timeout);
  }
  return gather_scatter_->reduce_scatter({output}, {input}, *native_op(opts.reduceOp),
                                         c10d::OpType::_REDUCE_SCATTER_BASE, opts.timeout,
                                         opts.asyncOp, sel);
}

c10::intrusive_ptr<c10d::Work> XdevBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const CallGate::Entry entry = gate_.enter();
  refuse_with_peers(
      Collective::kReduceScatter, "reduce_scatter_tensor_coalesced", outputs, opts.timeout,
      [&] { refuse_avg_of_bool("reduce_scatter_tensor_coalesced", opts.reduceOp, outputs); });
  if (premultiplies_here(opts.reduceOp, outputs)) {
    refuse_premul_with_peers(inputs, opts.reduceOp, opts.timeout);
    std::vector<at::Tensor> scaled = premultiplied(inputs, opts.reduceOp);
    return reduce_scatter_tensor_coalesced(outputs, scaled, with_sum(opts));
  }
  std::vector<at::Tensor> all = outputs;
  all.insert(all.end(), inputs.begin(), inputs.end());
  std::vector<std::vector<at::Tensor>> pairs;
  for (size_t i = 0; i < outputs.size() && i < inputs.size(); ++i) {
    pairs.push_back({outputs[i], inputs[i]});
  }
  if (pairs_fit(inputs, outputs, size_) && reduces_complex_as_real(opts.reduceOp, pairs)) {
    std::vector<at::Tensor> real_outputs = real_views(outputs);
    std::vector<at::Tensor> real_inputs = real_views(inputs);
    return shown_as(reduce_scatter_tensor_coalesced(real_outputs, real_inputs, opts), outputs);
  }
  const auto sel = select_gather_scatter("reduce_scatter", all, inputs, outputs, &opts.reduceOp);
  if (sel.path == plan::GatherScatterPath::kFallback) {
    refuse_engine_reduce_scatter("reduce_scatter_tensor_coalesced", outputs, opts.timeout, [&] {
      check_pairs("reduce_scatter_tensor_coalesced", inputs, outputs, size_);  // Gloo's aborts
    });
    return delegated_call().reduce_scatter(
        group_, outputs, opts, reduce_scatter_coalesced_op_type(),
        [&](c10d::Backend& engine, const c10d::ReduceScatterOptions& o,
            std::vector<at::Tensor>& outs, bool in_float) {
          std::vector<at::Tensor> flat_outs = flat_views(outs);
          std::vector<at::Tensor> flat_ins = flattened(inputs, in_float);
          return engine.reduce_scatter_tensor_coalesced(flat_outs, flat_ins, o);
        });
  }
  if (sel.path == plan::GatherScatterPath::kTwoLevel) {
    return two_level_gather_scatter_->reduce_scatter(
        outputs, inputs, *native_op(opts.reduceOp), reduce_scatter_coalesced_op_type(),
        sel.two_level_leader, opts.timeout, opts.asyncOp);
  }
  if (sel.path == plan::GatherScatterPath::kCuda) {  // one pair (the selection's condition)
    return cuda_gather_scatter(plan::GatherScatterKind::kReduceScatter, {inputs.at(0)}, outputs,
                               &opts.reduceOp, reduce_scatter_coalesced_op_type(), opts.timeout);
  }
  return gather_scatter_->reduce_scatter(outputs, inputs, *native_op(opts.reduceOp),
                                         reduce_scatter_coalesced_op_type(), opts.timeout,
                                         opts.asyncOp, sel);
}

}  // namespace xdev::backend
