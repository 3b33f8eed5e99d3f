#include "tensor_helpers.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/view_as_real.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "../transport/heap_placement.h"

namespace xdev::backend {

std::optional<kernels::DType> native_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kDouble:
      return kernels::DType::kFloat64;
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    case at::kChar:
      return kernels::DType::kInt8;
    case at::kByte:
      return kernels::DType::kUInt8;
    case at::kInt:
      return kernels::DType::kInt32;
    case at::kLong:
      return kernels::DType::kInt64;
    default:
      return std::nullopt;
  }
}

std::vector<plan::DtypeGroup> group_by_scalar_type(const std::vector<at::Tensor>& tensors) {
  std::vector<plan::TensorDesc> descs;
  descs.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    descs.push_back(
        {static_cast<int>(t.scalar_type()), static_cast<size_t>(t.element_size()), t.numel()});
  }
  return plan::group_by_dtype(descs);
}

std::optional<kernels::ReduceOp> native_op(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return kernels::ReduceOp::kSum;
    case c10d::ReduceOp::AVG:
      return kernels::ReduceOp::kAvg;
    case c10d::ReduceOp::MIN:
      return kernels::ReduceOp::kMin;
    case c10d::ReduceOp::MAX:
      return kernels::ReduceOp::kMax;
    case c10d::ReduceOp::PRODUCT:
      return kernels::ReduceOp::kProduct;
    default:
      return std::nullopt;
  }
}

uint64_t counts_hash(const std::vector<at::Tensor>& tensors) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const at::Tensor& t : tensors) {
    mix(static_cast<uint64_t>(t.scalar_type()));
    mix(static_cast<uint64_t>(t.numel()));
  }
  return h;
}

size_t heap_block_bytes(const char* what, int64_t numel, at::ScalarType dtype) {
  int64_t bytes = 0;
  if (numel < 0 ||
      __builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(dtype)), &bytes) ||
      bytes > transport::HeapPlacement::kMaxBlockBytes) {
    throw std::invalid_argument(std::string("xdev ") + what + ": a tensor of " +
                                (numel < 0 ? "this many" : std::to_string(numel)) + " " +
                                c10::toString(dtype) + " elements is too large");
  }
  return static_cast<size_t>(bytes);
}

int64_t payload_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  return bytes;
}

at::Tensor contiguous_bytes(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "xdev: contiguous_bytes of a non-contiguous tensor");
  return t.as_strided({t.numel()}, {1}).view(at::kByte);
}

std::vector<bool> spans_meet_another(const std::vector<at::Tensor>& tensors) {
  std::vector<bool> meets(tensors.size(), false);
  if (tensors.size() < 2) return meets;  // nothing to overlap (the common call)
  // Each strided tensor's bytes from its first element to its last, by start.
  struct Span {
    uintptr_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.layout() != at::kStrided || t.numel() == 0) continue;
    int64_t last = 0;  // torch's strides are never negative
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.push_back({begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size()), i});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t a = 0; a < spans.size(); ++a) {
    for (size_t b = a + 1; b < spans.size() && spans[b].begin < spans[a].end; ++b) {
      meets[spans[a].index] = meets[spans[b].index] = true;
    }
  }
  return meets;
}

std::vector<at::Tensor> contiguous(const std::vector<at::Tensor>& tensors) {
  const std::vector<bool> meets = spans_meet_another(tensors);
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    flat.push_back(meets[i] ? tensors[i].clone(at::MemoryFormat::Contiguous)
                            : tensors[i].contiguous());
  }
  return flat;
}

void copy_back(const std::vector<at::Tensor>& flat, const std::vector<at::Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!flat[i].is_same(tensors[i])) tensors[i].copy_(flat[i]);
  }
}

std::vector<bool> overlapping_elsewhere(const std::vector<at::Tensor>& fulls,
                                        const std::vector<at::Tensor>& blocks, int rank) {
  // Storages that alias one another share their data pointer, so the full
  // tensors are grouped by it and each block is compared with its group only.
  std::unordered_map<const void*, std::vector<size_t>> fulls_by_data;
  for (size_t j = 0; j < fulls.size(); ++j) {
    if (fulls[j].has_storage()) fulls_by_data[fulls[j].storage().data()].push_back(j);
  }
  std::vector<bool> overlapping(blocks.size(), false);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const at::Tensor& block = blocks[i];
    if (!block.has_storage()) continue;
    const auto same_data = fulls_by_data.find(block.storage().data());
    if (same_data == fulls_by_data.end()) continue;
    for (const size_t j : same_data->second) {
      const at::Tensor& full = fulls[j];
      if (!full.storage().is_alias_of(block.storage()) ||
          at::get_overlap_status(full, block) == at::MemOverlapStatus::No) {
        continue;
      }
      const int64_t bytes = block.numel() * static_cast<int64_t>(block.element_size());
      const char* own = static_cast<const char*>(full.data_ptr()) + rank * bytes;
      const bool own_block = j == i && full.is_contiguous() && block.is_contiguous() &&
                             static_cast<const char*>(block.data_ptr()) == own;
      if (!own_block) {
        overlapping[i] = true;
        break;
      }
    }
  }
  return overlapping;
}

void give_overlapping_outputs_own_buffers(std::vector<at::Tensor>& outputs,
                                          const std::vector<at::Tensor>& inputs, int rank) {
  const std::vector<bool> overlapping = overlapping_elsewhere(inputs, outputs, rank);
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (overlapping[i]) outputs[i] = at::empty_like(outputs[i]);
  }
}

void lend_copies_of_overlapping_inputs(std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& outputs, int rank) {
  const std::vector<bool> overlapping = overlapping_elsewhere(outputs, inputs, rank);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (overlapping[i]) inputs[i] = inputs[i].clone();
  }
}

namespace {

// The factor of a PREMUL_SUM, as a scalar tensor on t's device, or its double.
struct PremulFactor {
  at::Tensor tensor;  // undefined: use value
  double value = 0;
  // x * 1 is x: a factor of 1.0 (FSDP2's divide factor for a plain sum) costs no pass.
  bool is_one() const { return !tensor.defined() && value == 1.0; }
};

PremulFactor premul_factor(const at::Tensor& t, const c10d::ReduceOp& op) {
  TORCH_CHECK_VALUE(at::isFloatingType(t.scalar_type()),
                    "xdev: ReduceOp.PREMUL_SUM multiplies every input by a real factor, so it "
                    "needs floating-point tensors; got ",
                    t.scalar_type(), ". Use SUM, then scale the result.");
  // The SUM that follows runs on xdev's kernels or on Gloo, and neither sums float8: refused
  // here, before any tensor is scaled.
  TORCH_CHECK_VALUE(native_dtype(t.scalar_type()).has_value(), "xdev: ReduceOp.PREMUL_SUM of ",
                    t.scalar_type(),
                    " tensors: neither xdev nor Gloo sums that dtype. Cast to float32 (or "
                    "bfloat16) first.");
  // NCCLPreMulSumSupplement: the name every supported torch has (later ones alias it).
  const auto* supplement = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK_VALUE(supplement != nullptr, "xdev: a ReduceOp.PREMUL_SUM without its factor");
  if (!supplement->tensor_factor.defined()) return {at::Tensor(), supplement->double_factor};
  return {supplement->tensor_factor.to(t.device()).reshape({}), 0};
}

}  // namespace

void premultiply_(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) {
  // Every tensor is checked before any is scaled: a refused call leaves them all as they were.
  std::vector<PremulFactor> factors;
  for (const at::Tensor& t : tensors) factors.push_back(premul_factor(t, op));
  const auto product = [&](size_t i) {
    return factors[i].tensor.defined() ? tensors[i].mul(factors[i].tensor)
                                       : tensors[i].mul(factors[i].value);
  };
  // Memory listed twice (the same tensor twice in a coalesced call, or
  // overlapping views) is scaled once: those tensors' products are all taken
  // before any is written back.
  const std::vector<bool> meets = spans_meet_another(tensors);
  std::vector<at::Tensor> products(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (meets[i] && !factors[i].is_one()) products[i] = product(i);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (factors[i].is_one()) continue;
    if (meets[i]) {
      tensors[i].copy_(products[i]);
    } else if (factors[i].tensor.defined()) {
      tensors[i].mul_(factors[i].tensor);
    } else {
      tensors[i].mul_(factors[i].value);
    }
  }
}

std::vector<at::Tensor> flat_views(const std::vector<at::Tensor>& contiguous_tensors) {
  std::vector<at::Tensor> views;
  for (const at::Tensor& t : contiguous_tensors) views.push_back(t.view({-1}));
  return views;
}

std::vector<at::Tensor> flattened(const std::vector<at::Tensor>& tensors, bool in_float) {
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : tensors) {
    flat.push_back(in_float ? in_float_if_reduced(t.reshape({-1})) : t.reshape({-1}));
  }
  return flat;
}

void check_premultipliable(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) {
  for (const at::Tensor& t : tensors) premul_factor(t, op);
}

bool reduces_complex_as_real(const c10d::ReduceOp& op,
                             const std::vector<std::vector<at::Tensor>>& pairs) {
  if (op.op_ != c10d::ReduceOp::SUM && op.op_ != c10d::ReduceOp::AVG) return false;
  bool complex = false;
  for (const std::vector<at::Tensor>& pair : pairs) {
    for (const at::Tensor& t : pair) {
      // A pair is complex of one dtype throughout, or not complex: a mix, viewed,
      // would pass the dtype checks it must fail.
      if (t.is_conj() || t.is_complex() != pair[0].is_complex() ||
          (t.is_complex() && t.scalar_type() != pair[0].scalar_type())) {
        return false;
      }
    }
    complex = complex || (!pair.empty() && pair[0].is_complex());
  }
  return complex;
}

std::vector<at::Tensor> real_views(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views;
  for (const at::Tensor& t : tensors) views.push_back(t.is_complex() ? at::view_as_real(t) : t);
  return views;
}

void refuse_avg_of_bool(const char* what, const c10d::ReduceOp& op,
                        const std::vector<at::Tensor>& tensors) {
  if (op.op_ != c10d::ReduceOp::AVG) return;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK_TYPE(t.scalar_type() != at::kBool, "xdev ", what,
                     ": ReduceOp.AVG of bool tensors has no bool result (NCCL refuses it too); "
                     "use ReduceOp.MAX for a logical or, ReduceOp.MIN for a logical and, or "
                     "average a floating-point copy. Nothing was changed; the group stays usable.");
  }
}

at::Tensor premultiplied(const at::Tensor& t, const c10d::ReduceOp& op) {
  const PremulFactor factor = premul_factor(t, op);
  if (factor.is_one()) return t;  // a reduce-scatter leaves its input unchanged anyway
  return factor.tensor.defined() ? t.mul(factor.tensor) : t.mul(factor.value);
}

std::vector<at::Tensor> premultiplied(const std::vector<at::Tensor>& tensors,
                                      const c10d::ReduceOp& op) {
  std::vector<at::Tensor> scaled;
  for (const at::Tensor& t : tensors) scaled.push_back(premultiplied(t, op));
  return scaled;
}

void divide_for_avg(const at::Tensor& t, int64_t divisor) {
  if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
    t.div_(divisor, "trunc");
  } else {
    t.div_(divisor);
  }
}

namespace {
bool half_or_bfloat16(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}
}  // namespace

bool avg_adds_in_float(const std::vector<at::Tensor>& tensors) {
  return std::any_of(tensors.begin(), tensors.end(), half_or_bfloat16);
}

at::Tensor in_float_if_reduced(const at::Tensor& t) {
  return half_or_bfloat16(t)
             ? t.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous)
             : t;
}

void unpack_into(const at::Tensor& packed, const std::vector<at::Tensor>& tensors) {
  int64_t start = 0;
  for (const at::Tensor& t : tensors) {
    at::Tensor(t).copy_(packed.narrow(0, start, t.numel()).view(t.sizes()));
    start += t.numel();
  }
}

bool elements_share_memory(const at::Tensor& t) {
  return at::has_internal_overlap(t) == at::MemOverlap::Yes;
}

void check_written(const char* what, const std::vector<at::Tensor>& written) {
  for (size_t i = 0; i < written.size(); ++i) {
    TORCH_CHECK_VALUE(!elements_share_memory(written[i]), "xdev ", what, ": tensor ", i, " (",
                      written[i].sizes(), ", strides ", written[i].strides(),
                      ") has elements that share memory (an expand()ed or as_strided view), and "
                      "the collective writes every element; pass a tensor whose elements are "
                      "distinct, e.g. its clone(). The group stays usable.");
  }
}

void check_pairs(const char* what, const std::vector<at::Tensor>& full,
                 const std::vector<at::Tensor>& block, int world) {
  TORCH_CHECK_VALUE(full.size() == block.size(), "xdev ", what, ": ", full.size(),
                    " full tensor(s) for ", block.size(), " block tensor(s)");
  for (size_t i = 0; i < full.size(); ++i) {
    TORCH_CHECK_VALUE(full[i].scalar_type() == block[i].scalar_type(), "xdev ", what,
                      ": input and output dtypes differ (", full[i].scalar_type(), " and ",
                      block[i].scalar_type(), ")");
    TORCH_CHECK_VALUE(full[i].numel() == block[i].numel() * world, "xdev ", what, ": tensor ", i,
                      " has ", full[i].numel(), " element(s) where ", world, " x ",
                      block[i].numel(), " are needed");
  }
}

bool pairs_fit(const std::vector<at::Tensor>& full, const std::vector<at::Tensor>& block,
               int world) {
  if (full.size() != block.size()) return false;
  for (size_t i = 0; i < full.size(); ++i) {
    if (full[i].numel() != block[i].numel() * world) return false;
  }
  return true;
}

ListProblem check_list(const char* what, const std::vector<at::Tensor>& list,
                       const at::Tensor& mine, int world, int rank) {
  if (static_cast<int>(list.size()) != world) {
    return {ListProblem::kLength, c10::str("xdev ", what, ": a list needs one tensor per rank (",
                                           world, "); got ", list.size())};
  }
  for (const at::Tensor& t : list) {
    if (t.scalar_type() != mine.scalar_type()) {
      return {ListProblem::kDtypes,
              c10::str("xdev ", what, ": every tensor must have one dtype; got ", t.scalar_type(),
                       " and ", mine.scalar_type())};
    }
  }
  const int64_t own = list[static_cast<size_t>(rank)].numel();
  if (own != mine.numel()) {
    return {ListProblem::kOwnEntry, c10::str("xdev ", what, ": this rank's entry of the list has ",
                                             own, " element(s), its own tensor ", mine.numel())};
  }
  return {};
}

std::vector<int64_t> list_sizes(const char* what, const std::vector<at::Tensor>& list,
                                const at::Tensor& mine, int world, int rank) {
  const ListProblem problem = check_list(what, list, mine, world, rank);
  TORCH_CHECK_VALUE(problem.kind == ListProblem::kNone, problem.message);
  std::vector<int64_t> sizes;
  for (const at::Tensor& t : list) sizes.push_back(t.numel());
  return sizes;
}

}  // namespace xdev::backend
