#include "moved_tensors.h"

#include <c10/util/Exception.h>

#include <string>
#include <typeinfo>

#include "xdev_work.h"

namespace xdev::backend {
namespace {

// The bytes of `t` (contiguous) with its rows kept: (rows, bytes per row).
// Restrided first: a contiguous tensor may still have a size-1 dimension of any
// stride (a (1, n) tensor transposed), which a view as bytes refuses.
at::Tensor bytes_by_rows(const at::Tensor& t) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const int64_t per_row = t.dim() <= 1 ? 1 : c10::multiply_integers(t.sizes().slice(1));
  return t.as_strided({rows, per_row}, {per_row, 1}).view(at::kByte);
}

constexpr const char* kBytesNote =
    " (xdev hands the engine tensors of a dtype it lacks as their bytes, shaped (rows, bytes per "
    "row): the sizes above count bytes)";

}  // namespace

bool engines_take(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kBool:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

at::Tensor MovedTensors::remember(const at::Tensor& given, at::Tensor moved) {
  if (!moved.is_same(given)) shown_.emplace_back(moved.unsafeGetTensorImpl(), given);
  return moved;
}

at::Tensor MovedTensors::move(const at::Tensor& given) {
  if (given.layout() != at::kStrided) return given;
  const at::Tensor contiguous = given.contiguous();
  if (engines_take(given.scalar_type())) return remember(given, contiguous);
  any_bytes_ = true;
  return remember(given, bytes_by_rows(contiguous));
}

std::vector<at::Tensor> MovedTensors::move(const std::vector<at::Tensor>& given) {
  std::vector<at::Tensor> moved;
  moved.reserve(given.size());
  for (const at::Tensor& t : given) moved.push_back(move(t));
  return moved;
}

at::Tensor MovedTensors::as_bytes(const at::Tensor& given) {
  any_bytes_ = true;
  return remember(given, bytes_by_rows(given.contiguous()));
}

void MovedTensors::show_as(const at::Tensor& stand_in, const at::Tensor& given) {
  any_bytes_ = any_bytes_ || stand_in.scalar_type() != given.scalar_type();
  shown_.emplace_back(stand_in.unsafeGetTensorImpl(), given);
}

c10::intrusive_ptr<c10d::Work> MovedTensors::run(
    c10d::OpType type, const std::function<c10::intrusive_ptr<c10d::Work>()>& call) const {
  if (shown_.empty()) return call();
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = call();
  } catch (const c10::Error& e) {
    // A refusal of the arguments (a ValueError, or Gloo's plain error) gets the
    // note; any other kind (a broken engine's DistBackendError) passes as it is.
    const bool value_error = typeid(e) == typeid(c10::ValueError);
    if (!any_bytes_ || !(value_error || typeid(e) == typeid(c10::Error))) throw;
    TORCH_CHECK_VALUE(!value_error, e.what_without_backtrace(), kBytesNote);
    TORCH_CHECK(false, e.what_without_backtrace(), kBytesNote);
  }
  return c10::make_intrusive<ShownResultWork>(
      std::move(work), type, [shown = shown_](const at::Tensor& t) {
        for (auto it = shown.rbegin(); it != shown.rend(); ++it) {
          if (t.unsafeGetTensorImpl() == it->first) return it->second;
        }
        return t;
      });
}

}  // namespace xdev::backend
