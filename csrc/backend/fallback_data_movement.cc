// FallbackEngines' collectives that move data without reducing it: all-gather,
// broadcast, gather, scatter and all-to-all on the engine, on tensors it can
// move (MovedTensors): contiguous (Gloo's scatter wrote a strided output as if
// it were contiguous), and a dtype Gloo lacks as bytes.

#include <ATen/ATen.h>

#include <algorithm>

#include "fallback_engines.h"
#include "moved_tensors.h"
#include "tensor_helpers.h"
#include "uneven_all_gather.h"

namespace xdev::backend {
namespace {

template <typename Pred>
bool all_of_entries(const std::vector<at::Tensor>& entries, Pred pred) {
  return std::all_of(entries.begin(), entries.end(), pred);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> FallbackEngines::allgather(
    GroupContext& group, std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  c10d::Backend* engine = for_tensors(inputs);
  // The engine's all-gather on tensors it can move; `gathered` holds
  // contiguous tensors, which byte views write through.
  const auto engine_allgather = [engine, &opts](std::vector<std::vector<at::Tensor>>& gathered,
                                                std::vector<at::Tensor>& input) {
    MovedTensors moved;
    std::vector<std::vector<at::Tensor>> moved_outputs;
    for (const std::vector<at::Tensor>& list : gathered) moved_outputs.push_back(moved.move(list));
    std::vector<at::Tensor> moved_input = moved.move(input);
    return moved.run(c10d::OpType::ALLGATHER,
                     [&] { return engine->allgather(moved_outputs, moved_input, opts); });
  };
  const bool one_list = inputs.size() == 1 && outputs.size() == 1 && !outputs[0].empty();
  // Gloo wants every entry shaped as the input; NCCL, and xdev, only sized alike.
  if (engine != gloo_.get() || !one_list || all_of_entries(outputs[0], [&](const at::Tensor& t) {
        return t.sizes() == inputs[0].sizes();
      })) {
    if (!one_list || engines_take(inputs[0].scalar_type())) {
      return track(engine->allgather(outputs, inputs, opts));  // the engine checks the call
    }
    return on_contiguous(group, outputs[0], c10d::OpType::ALLGATHER, "xdev:all_gather",
                         [&](std::vector<at::Tensor>& contiguous) {
                           std::vector<std::vector<at::Tensor>> gathered{contiguous};
                           return engine_allgather(gathered, inputs);
                         });
  }
  const std::vector<at::Tensor> entries = outputs[0];
  const auto padded = [&](std::vector<std::vector<at::Tensor>>& gathered,
                          std::vector<at::Tensor>& input, std::function<void()> finish) {
    c10::intrusive_ptr<c10d::Work> work = track(engine_allgather(gathered, input));
    return then(group, work, entries, c10d::OpType::ALLGATHER, "xdev:all_gather",
                "all-gather of entries padded to one size", std::move(finish));
  };
  if (all_of_entries(entries,
                     [&](const at::Tensor& t) { return t.numel() == entries[0].numel(); })) {
    // One size, other shapes than the input's: the same bytes travel as flat
    // copies (what a rank whose entries are shaped as its input sends), with
    // no header, so ranks may pass either.
    list_sizes("all_gather", entries, inputs[0], group.size(), group.rank());
    std::vector<at::Tensor> flat{inputs[0].reshape({-1}).contiguous()};
    std::vector<std::vector<at::Tensor>> gathered(1);
    for (size_t j = 0; j < entries.size(); ++j) gathered[0].push_back(at::empty_like(flat[0]));
    return padded(gathered, flat, [entries, gathered] {
      for (size_t j = 0; j < entries.size(); ++j) {
        entries[j].copy_(gathered[0][j].view(entries[j].sizes()));
      }
    });
  }
  PaddedAllGather call = pad_uneven_all_gather(entries, inputs[0], group.size(), group.rank());
  return padded(call.gathered, call.input, std::move(call.finish));
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::allgather_coalesced(
    GroupContext& group, std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  c10d::Backend* engine = for_tensors(inputs);
  std::vector<at::Tensor> entries;  // every rank's list, in order
  for (const std::vector<at::Tensor>& list : outputs) {
    entries.insert(entries.end(), list.begin(), list.end());
  }
  return on_contiguous(group, entries, c10d::OpType::ALLGATHER_COALESCED,
                       "xdev:all_gather_coalesced", [&](std::vector<at::Tensor>& contiguous) {
                         MovedTensors moved;
                         std::vector<at::Tensor> byte_inputs;
                         for (const at::Tensor& t : inputs)
                           byte_inputs.push_back(moved.as_bytes(t));
                         std::vector<std::vector<at::Tensor>> byte_outputs;
                         size_t next = 0;
                         for (const std::vector<at::Tensor>& list : outputs) {
                           byte_outputs.emplace_back();
                           for (size_t i = 0; i < list.size(); ++i) {
                             byte_outputs.back().push_back(moved.as_bytes(contiguous.at(next++)));
                           }
                         }
                         return moved.run(c10d::OpType::ALLGATHER_COALESCED, [&] {
                           return engine->allgather_coalesced(byte_outputs, byte_inputs, opts);
                         });
                       });
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::broadcast(GroupContext& group,
                                                          std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  c10d::Backend* engine = for_tensors(tensors);
  return on_contiguous(group, tensors, c10d::OpType::BROADCAST, "xdev:broadcast",
                       [engine, &opts](std::vector<at::Tensor>& contiguous) {
                         MovedTensors moved;
                         std::vector<at::Tensor> moved_tensors = moved.move(contiguous);
                         return moved.run(c10d::OpType::BROADCAST,
                                          [&] { return engine->broadcast(moved_tensors, opts); });
                       });
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::gather(
    GroupContext& group, std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  c10d::Backend* engine = for_tensors(inputs);
  // Only the root passes outputs, one list of entries (the engine checks that).
  if (outputs.size() != 1) {
    MovedTensors moved;
    std::vector<at::Tensor> moved_inputs = moved.move(inputs);
    return track(moved.run(c10d::OpType::GATHER,
                           [&] { return engine->gather(outputs, moved_inputs, opts); }));
  }
  return on_contiguous(group, outputs[0], c10d::OpType::GATHER, "xdev:gather",
                       [&](std::vector<at::Tensor>& contiguous) {
                         MovedTensors moved;
                         std::vector<std::vector<at::Tensor>> moved_outputs{moved.move(contiguous)};
                         std::vector<at::Tensor> moved_inputs = moved.move(inputs);
                         return moved.run(c10d::OpType::GATHER, [&] {
                           return engine->gather(moved_outputs, moved_inputs, opts);
                         });
                       });
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::scatter(
    GroupContext& group, std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs, const c10d::ScatterOptions& opts) {
  c10d::Backend* engine = for_tensors(outputs);
  return on_contiguous(group, outputs, c10d::OpType::SCATTER, "xdev:scatter",
                       [&](std::vector<at::Tensor>& contiguous) {
                         MovedTensors moved;
                         std::vector<at::Tensor> moved_outputs = moved.move(contiguous);
                         std::vector<std::vector<at::Tensor>> moved_inputs;
                         for (const std::vector<at::Tensor>& list : inputs) {
                           moved_inputs.push_back(moved.move(list));
                         }
                         return moved.run(c10d::OpType::SCATTER, [&] {
                           return engine->scatter(moved_outputs, moved_inputs, opts);
                         });
                       });
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::alltoall_base(
    GroupContext& group, at::Tensor& output, at::Tensor& input,
    std::vector<int64_t>& output_split_sizes, std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  c10d::Backend* engine = for_tensor(input);
  std::vector<at::Tensor> outputs{output};
  return on_contiguous(group, outputs, c10d::OpType::ALLTOALL_BASE, "xdev:all_to_all_single",
                       [&](std::vector<at::Tensor>& contiguous) {
                         MovedTensors moved;
                         at::Tensor moved_output = moved.move(contiguous.at(0));
                         at::Tensor moved_input = moved.move(input);
                         return moved.run(c10d::OpType::ALLTOALL_BASE, [&] {
                           return engine->alltoall_base(moved_output, moved_input,
                                                        output_split_sizes, input_split_sizes,
                                                        opts);
                         });
                       });
}

c10::intrusive_ptr<c10d::Work> FallbackEngines::alltoall(GroupContext& group,
                                                         std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  c10d::Backend* engine = for_tensors(inputs);
  return on_contiguous(group, outputs, c10d::OpType::ALLTOALL, "xdev:all_to_all",
                       [&](std::vector<at::Tensor>& contiguous) {
                         MovedTensors moved;
                         std::vector<at::Tensor> moved_outputs = moved.move(contiguous);
                         std::vector<at::Tensor> moved_inputs = moved.move(inputs);
                         return moved.run(c10d::OpType::ALLTOALL, [&] {
                           return engine->alltoall(moved_outputs, moved_inputs, opts);
                         });
                       });
}

}  // namespace xdev::backend
