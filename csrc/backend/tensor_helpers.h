// Small torch-side helpers shared by the CPU and CUDA halves of the backend.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/packing.h"

namespace xdev::backend {

// The kernels' dtype for a torch dtype; nullopt where no native kernel exists.
std::optional<kernels::DType> native_dtype(at::ScalarType t);

// The tensors grouped by dtype, one payload per group, groups in order of first
// appearance (the same on every rank that passes the same list). A group's
// dtype id is the tensors' at::ScalarType.
std::vector<plan::DtypeGroup> group_by_scalar_type(const std::vector<at::Tensor>& tensors);

// The kernels' op for a c10d op; nullopt for ops without a native kernel.
std::optional<kernels::ReduceOp> native_op(const c10d::ReduceOp& op);

// FNV-1a over every tensor's dtype and element count: two ranks with equal
// hashes almost surely pass tensors that pair up, and a mismatch is caught on
// all ranks. Not their shapes: as on Gloo and NCCL, a (6,) tensor pairs with
// a (2, 3) one.
uint64_t counts_hash(const std::vector<at::Tensor>& tensors);

int64_t payload_bytes(const std::vector<at::Tensor>& tensors);

// numel elements of dtype in bytes, for a symmetric heap's block (CPU or
// CUDA); throws std::invalid_argument, naming `what`, when that overflows or
// exceeds what a heap hands out (at::empty refuses such sizes too).
size_t heap_block_bytes(const char* what, int64_t numel, at::ScalarType dtype);

// A contiguous tensor's bytes, as a flat uint8 tensor over the same memory.
// (A tensor of one element or none is contiguous whatever its strides, and
// view() refuses a stride other than 1: it is read as the 1-D tensor it is.)
at::Tensor contiguous_bytes(const at::Tensor& t);

// Each tensor itself when contiguous, else a contiguous copy: executors work on
// contiguous memory, and copy_back writes the copies' results into the originals.
// Executors also read a tensor's input from where they write its result, so a
// tensor that shares bytes with another of the list (the same tensor twice in
// a coalesced call) gets a copy as well; copy_back then writes the results in
// list order, the last winning where they overlap, as Gloo's copies do.
std::vector<at::Tensor> contiguous(const std::vector<at::Tensor>& tensors);
// Per tensor of the list, whether its bytes (from its first element to its
// last) meet another's. Views that interleave without sharing an element
// count as meeting: the answer may be yes where no byte is shared, never no
// where one is.
std::vector<bool> spans_meet_another(const std::vector<at::Tensor>& tensors);
// One-dimensional views of contiguous tensors (what is written through them lands in the
// tensors), and one-dimensional forms of any tensors (copies where a view cannot be had):
// what Gloo is handed, so that it accepts every shape whose element counts fit, as xdev's
// native paths and NCCL do.
std::vector<at::Tensor> flat_views(const std::vector<at::Tensor>& contiguous_tensors);
// With in_float, float16 and bfloat16 tensors come as float32 copies (in_float_if_reduced).
std::vector<at::Tensor> flattened(const std::vector<at::Tensor>& tensors, bool in_float = false);
void copy_back(const std::vector<at::Tensor>& flat, const std::vector<at::Tensor>& tensors);

// Reduce-scatter and all-gather pair a full tensor (world blocks) with a block
// per list entry. Peers read what this rank lends (its reduce-scatter inputs,
// its all-gather inputs) while it writes its outputs, entry after entry, so a
// lent tensor that shares bytes with a written one can be read after it was
// overwritten. Which blocks overlap any of `fulls` other than exactly at
// rank's block of their own full tensor (FSDP's all-gather input is its
// output's own block, which every path handles). Only tensors on one storage
// are compared: linear in the entries where each has its own, quadratic where
// all are views of one buffer (a coalesced call's few entries).
std::vector<bool> overlapping_elsewhere(const std::vector<at::Tensor>& fulls,
                                        const std::vector<at::Tensor>& blocks, int rank);
// The two answers to such an overlap: a reduce-scatter writes an overlapping
// output into a buffer of its own first (copy_back moves it afterwards); an
// all-gather lends a copy of an overlapping input.
void give_overlapping_outputs_own_buffers(std::vector<at::Tensor>& outputs,
                                          const std::vector<at::Tensor>& inputs, int rank);
void lend_copies_of_overlapping_inputs(std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& outputs, int rank);

// ReduceOp.PREMUL_SUM, NCCL's premultiplied sum (FSDP2 asks for it after
// set_gradient_divide_factor): every rank's input times the op's factor, then
// summed. Where the engine has none (Gloo), xdev multiplies first and runs a
// SUM on any path. premultiply_ scales the tensors in place (where the result
// overwrites them: an allreduce's tensors, a reduce's root's), after checking
// them all; premultiplied returns a scaled copy (an input that must stay as it
// is; t itself for a factor of 1.0). Both raise ValueError for tensors that are
// not floating point, or of a float type no path sums (float8).
void premultiply_(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op);
// Raises the ValueError premultiply_ would, without scaling anything.
void check_premultipliable(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op);
at::Tensor premultiplied(const at::Tensor& t, const c10d::ReduceOp& op);
std::vector<at::Tensor> premultiplied(const std::vector<at::Tensor>& tensors,
                                      const c10d::ReduceOp& op);
// c10d hands a complex allreduce of SUM or AVG to the backend as real views
// (view_as_real); it does not for a reduce-scatter. A complex sum is the sum
// of the parts, element by element, so the same views make a reduce-scatter
// native too, with the bits of the allreduce of those views. Whether the
// call's `pairs` (each output with its inputs) hold a complex one, and each is
// complex of one dtype or not complex at all, none conjugated (view_as_real
// refuses those). A call that is not (its own mistake) keeps its tensors, so
// that its errors name them.
bool reduces_complex_as_real(const c10d::ReduceOp& op,
                             const std::vector<std::vector<at::Tensor>>& pairs);
// The complex tensors as view_as_real views, the others as they are.
std::vector<at::Tensor> real_views(const std::vector<at::Tensor>& tensors);

// Raises TypeError for an AVG of bool tensors, as NCCL does: a mean of booleans
// has no bool to go in, and the engine's SUM would have overwritten the tensors
// before the division failed. Checked before anything runs.
void refuse_avg_of_bool(const char* what, const c10d::ReduceOp& op,
                        const std::vector<at::Tensor>& tensors);

// Options with their reduce op replaced by SUM (after premultiply_ / premultiplied).
template <typename Options>
Options with_sum(Options opts) {
  opts.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  return opts;
}

// AVG after a SUM by an engine that has none: t /= divisor in place, as the
// native kernels divide (integers truncated toward zero).
void divide_for_avg(const at::Tensor& t, int64_t divisor);

// Whether an AVG of these tensors through an engine should add in float32: a
// float16 or bfloat16 one (the native kernels add in float32, and a float16
// sum of values whose mean fits can overflow where their float32 sum cannot).
bool avg_adds_in_float(const std::vector<at::Tensor>& tensors);
// t as float32 where it is float16 or bfloat16 (a copy), else t itself.
at::Tensor in_float_if_reduced(const at::Tensor& t);

// Copies consecutive pieces of the 1-D `packed` into `tensors`, each its own numel, in order:
// the inverse of concatenating the tensors' flattened forms.
void unpack_into(const at::Tensor& packed, const std::vector<at::Tensor>& tensors);

// Whether some elements of t share memory (an expand()ed or as_strided view).
bool elements_share_memory(const at::Tensor& t);

// Checks, on the calling thread, that no tensor a collective writes has
// elements that share memory (elements_share_memory): each would
// receive its own result, which no copy into such a tensor can hold, and the
// staged paths' copy back refuses it only after the data has moved
// (ValueError naming `what` otherwise).
void check_written(const char* what, const std::vector<at::Tensor>& written);

// Checks, on the calling thread, that full[i] holds world blocks the size of
// block[i], of its dtype (ValueError naming `what` otherwise).
void check_pairs(const char* what, const std::vector<at::Tensor>& full,
                 const std::vector<at::Tensor>& block, int world);
// Whether check_pairs would find the sizes right (dtypes aside).
bool pairs_fit(const std::vector<at::Tensor>& full, const std::vector<at::Tensor>& block,
               int world);

// What is wrong with a list form's list, if anything: it must hold one tensor
// per rank, of one dtype with `mine`, and this rank's entry must have the size
// of `mine`. `message` says so in words, naming `what`.
struct ListProblem {
  enum Kind : int64_t { kNone = 0, kLength, kDtypes, kOwnEntry };
  Kind kind = kNone;
  std::string message;
};
ListProblem check_list(const char* what, const std::vector<at::Tensor>& list,
                       const at::Tensor& mine, int world, int rank);

// Each rank's block size in a list form (one tensor per rank), after
// check_list (ValueError with its message otherwise).
std::vector<int64_t> list_sizes(const char* what, const std::vector<at::Tensor>& list,
                                const at::Tensor& mine, int world, int rank);

}  // namespace xdev::backend
