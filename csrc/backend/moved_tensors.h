// Tensors handed to a fallback engine (Gloo, NCCL) in a form it can move:
// contiguous, and where Gloo lacks the dtype (int16, uint16/32/64, float8,
// complex...), as bytes. The engine's Work then shows the caller's tensors,
// not those stand-ins.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <utility>
#include <vector>

namespace xdev::backend {

// The dtypes both Gloo and NCCL reduce and move (Gloo's "Invalid scalar type"
// for any other).
bool engines_take(at::ScalarType dtype);

class MovedTensors {
 public:
  // `given` as an engine can move it: itself where it is contiguous and both
  // engines have its dtype; else a contiguous copy (which the engine's writes
  // do not reach: pass outputs contiguous), and, where the dtype is one Gloo
  // lacks, its bytes with its rows kept, (rows, bytes per row), so that an
  // all-to-all's split sizes (in rows) still hold. Sparse tensors are the
  // engine's own business and pass as they are.
  at::Tensor move(const at::Tensor& given);
  std::vector<at::Tensor> move(const std::vector<at::Tensor>& given);
  // The bytes of `given`, whatever its dtype (Gloo's all_gather_coalesced
  // packs its list into one buffer of one dtype).
  at::Tensor as_bytes(const at::Tensor& given);

  // Shows `given` where the engine's Work holds `stand_in`, a view of it made
  // for the engine (the last record for a stand-in counts).
  void show_as(const at::Tensor& stand_in, const at::Tensor& given);

  // Runs `call`, the engine's collective on tensors this moved. Where any went
  // as other tensors, the returned Work's result() and future value show the
  // caller's tensors in their place, in the structure the engine gives, and an
  // error the engine raises at once (a wrong argument) says that the sizes it
  // names count bytes.
  c10::intrusive_ptr<c10d::Work> run(
      c10d::OpType type, const std::function<c10::intrusive_ptr<c10d::Work>()>& call) const;

 private:
  at::Tensor remember(const at::Tensor& given, at::Tensor moved);

  // The stand-ins, by identity, and the caller's tensor for each.
  std::vector<std::pair<const c10::TensorImpl*, at::Tensor>> shown_;
  bool any_bytes_ = false;
};

}  // namespace xdev::backend
