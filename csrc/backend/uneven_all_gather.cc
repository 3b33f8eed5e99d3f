#include "uneven_all_gather.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "tensor_helpers.h"

namespace xdev::backend {
namespace {

enum HeaderField : int64_t { kRefusal = 0, kEntries, kElements, kLargest, kFingerprint, kFields };
// The payload starts on a 64-byte boundary of the message, so that entries of
// any dtype can be read out of it in place.
constexpr int64_t kHeaderBytes = 64;
static_assert(kFields * 8 <= kHeaderBytes, "the header outgrew its room");

const char* refusal_reason(int64_t refusal) {
  switch (refusal) {
    case ListProblem::kLength:
      return "its output list does not hold one tensor per rank";
    case ListProblem::kDtypes:
      return "its output list mixes dtypes";
    case ListProblem::kOwnEntry:
      return "its input's size differs from its own entry of the output list";
    default:
      return "a reason this build does not know";
  }
}

std::string describe_list(const int64_t* fields) {
  return std::to_string(fields[kEntries]) + " entries of " + std::to_string(fields[kElements]) +
         " elements in all, the largest " + std::to_string(fields[kLargest]);
}

}  // namespace

PaddedAllGather pad_uneven_all_gather(const std::vector<at::Tensor>& entries,
                                      const at::Tensor& input, int world, int rank) {
  const ListProblem problem = check_list("all_gather", entries, input, world, rank);
  at::Tensor header = at::zeros({kHeaderBytes / 8}, at::kLong);
  int64_t* fields = header.data_ptr<int64_t>();
  fields[kRefusal] = problem.kind;
  fields[kEntries] = static_cast<int64_t>(entries.size());
  // An FNV-style hash (a word at a time) of the dtype and every entry's
  // element count: the shapes may differ between ranks, the sizes may not.
  uint64_t fingerprint = 1469598103934665603ull;
  const auto mix = [&](int64_t v) {
    fingerprint = (fingerprint ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  };
  mix(static_cast<int64_t>(input.scalar_type()));
  for (const at::Tensor& t : entries) {
    mix(t.numel());
    fields[kElements] += t.numel();
    fields[kLargest] = std::max(fields[kLargest], t.numel());
  }
  fields[kFingerprint] = static_cast<int64_t>(fingerprint);

  // The message's length comes from the list alone, as on every rank that
  // passes the same list, whatever this rank's input (a refused one too).
  int64_t largest_bytes = 0;
  for (const at::Tensor& t : entries) {
    largest_bytes = std::max(largest_bytes, t.numel() * static_cast<int64_t>(t.element_size()));
  }
  const int64_t message = kHeaderBytes + largest_bytes;
  const at::TensorOptions bytes = input.options().dtype(at::kByte);
  PaddedAllGather call;
  call.input.push_back(at::zeros({message}, bytes));
  at::Tensor& mine = call.input[0];
  mine.narrow(0, 0, kHeaderBytes).copy_(contiguous_bytes(header));
  if (problem.kind == ListProblem::kNone) {
    mine.narrow(0, kHeaderBytes, input.numel() * static_cast<int64_t>(input.element_size()))
        .copy_(contiguous_bytes(input.contiguous()));
  }
  call.gathered.resize(1);
  for (int r = 0; r < world; ++r) call.gathered[0].push_back(at::empty({message}, bytes));

  call.finish = [entries, gathered = call.gathered[0], own_header = header,
                 own_error = problem.message, rank, world] {
    std::vector<at::Tensor> headers;
    for (const at::Tensor& m : gathered) {
      headers.push_back(m.narrow(0, 0, kHeaderBytes).to(at::kCPU).view(at::kLong));
    }
    if (!own_error.empty()) throw std::invalid_argument(own_error);
    for (int r = 0; r < world; ++r) {
      const int64_t theirs = headers[static_cast<size_t>(r)].data_ptr<int64_t>()[kRefusal];
      if (theirs != ListProblem::kNone) {
        throw std::invalid_argument("xdev all_gather: rank " + std::to_string(r) +
                                    " refused the call: " + refusal_reason(theirs) +
                                    " (its own error says more). The group stays usable.");
      }
    }
    const int64_t* own = own_header.data_ptr<int64_t>();
    for (int r = 0; r < world; ++r) {
      const int64_t* theirs = headers[static_cast<size_t>(r)].data_ptr<int64_t>();
      if (theirs[kFingerprint] != own[kFingerprint]) {
        throw std::invalid_argument(
            "xdev all_gather: the ranks' output lists differ: rank " + std::to_string(rank) +
            " has " + describe_list(own) + ", rank " + std::to_string(r) + " " +
            describe_list(theirs) +
            ". Every rank must pass entries of the same sizes, in the same order. The group "
            "stays usable.");
      }
    }
    for (size_t j = 0; j < entries.size(); ++j) {
      const at::Tensor& t = entries[j];
      const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
      t.copy_(gathered[j].narrow(0, kHeaderBytes, n).view(t.scalar_type()).view(t.sizes()));
    }
  };
  return call;
}

}  // namespace xdev::backend
