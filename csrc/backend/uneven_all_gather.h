// An all-gather into a list whose entries differ in size, through an engine
// that gathers one size only (Gloo): every rank sends one message of the same
// length, its input padded to the largest entry, and the entries are copied
// out of the gathered messages.
//
// Each message starts with a header: whether the sender refuses the call
// (check_list: its input does not match its own entry, its list is malformed)
// and a fingerprint of its list's sizes. Every rank reads every header when
// the engine is done, so a rank's wrong input, or lists that differ between
// ranks, fail the call on every rank, with the group usable, instead of
// leaving the peers in the engine until the timeout or copying out the wrong
// elements.
// Nothing waits for the peers before the engine's call: the call stays
// asynchronous (on CPU tensors; CUDA tensors of ranks sharing a GPU wait for
// the engine, as every call FallbackEngines finishes on them does). Lists
// whose largest entries differ still make messages of different lengths,
// which Gloo refuses by aborting the process, as it does for any all-gather
// whose sizes differ between ranks.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace xdev::backend {

struct PaddedAllGather {
  std::vector<at::Tensor> input;                  // this rank's message
  std::vector<std::vector<at::Tensor>> gathered;  // one list: every rank's message
  // After the engine's all-gather: checks every rank's header, then copies
  // the entries out. Throws std::invalid_argument where a rank refused the
  // call (this rank: its own reason) or the lists differ; the caller sees it
  // as the call's failure (DistBackendError at wait() on CPU tensors).
  std::function<void()> finish;
};

// `entries` (the output list) must hold entries of different element counts.
PaddedAllGather pad_uneven_all_gather(const std::vector<at::Tensor>& entries,
                                      const at::Tensor& input, int world, int rank);

}  // namespace xdev::backend
