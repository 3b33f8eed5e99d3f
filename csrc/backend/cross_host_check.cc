#include "cross_host_check.h"

#include <ATen/ATen.h>

#include <cstring>
#include <optional>
#include <vector>

#include "../plan/two_level.h"
#include "tensor_helpers.h"
#include "two_level_allreduce.h"

namespace xdev::backend {
namespace {

// The header: the fields that say what a call is (num_packs: the pieces a
// two-level allreduce is cut into), then the payload's length;
// seq (each host numbers its own steps) and where tensors lie in memory (per
// rank) are left out.
constexpr int kFields = 9;
static_assert(kFields * sizeof(int64_t) <= plan::kCrossHostHeaderBytes, "header too long");
// num_tensors of a host that refused the call (no call has it).
constexpr int64_t kRefused = -1;

std::vector<int64_t> fields_of(const transport::OpDescriptor& d, int64_t payload_bytes) {
  return {d.collective,
          d.reduce_op,
          d.dtype,
          d.root,
          d.num_tensors,
          d.total_elems,
          static_cast<int64_t>(d.counts_hash),
          d.num_packs,
          payload_bytes};
}

transport::OpDescriptor from_fields(const int64_t* f) {
  transport::OpDescriptor d;
  d.collective = static_cast<int32_t>(f[0]);
  d.reduce_op = static_cast<int32_t>(f[1]);
  d.dtype = static_cast<int32_t>(f[2]);
  d.root = f[3];
  d.num_tensors = f[4];
  d.total_elems = f[5];
  d.counts_hash = static_cast<uint64_t>(f[6]);
  d.num_packs = f[7];
  d.algorithm = static_cast<int32_t>(plan::Algorithm::kFlat);  // how describe() names two levels
  return d;
}

at::Tensor message_with(const std::vector<int64_t>& fields) {
  at::Tensor message = at::zeros({plan::kCrossHostMessageBytes}, at::kByte);
  std::memcpy(message.data_ptr(), fields.data(), fields.size() * sizeof(int64_t));
  return message;
}

const int64_t* fields_in(const at::Tensor& messages, int host) {
  return reinterpret_cast<const int64_t*>(messages.const_data_ptr<uint8_t>() +
                                          host * plan::kCrossHostMessageBytes);
}

}  // namespace

CrossHostCheck::CrossHostCheck(GroupContext& group, std::shared_ptr<CrossHostEngine> engine)
    : group_(group), engine_(std::move(engine)) {}

const char* CrossHostCheck::payload_of(const at::Tensor& messages, int host) {
  return reinterpret_cast<const char*>(messages.const_data_ptr<uint8_t>()) +
         host * plan::kCrossHostMessageBytes + plan::kCrossHostHeaderBytes;
}

void CrossHostCheck::reduce_payloads(const at::Tensor& messages, int64_t offset_bytes,
                                     kernels::ReduceOp op, const at::Tensor& out) const {
  if (out.numel() == 0) return;
  const int hosts = group_.num_hosts();
  std::vector<const void*> partials;
  for (int h = 0; h < hosts; ++h) partials.push_back(payload_of(messages, h) + offset_bytes);
  kernels::reduce(*native_dtype(out.scalar_type()), op, out.data_ptr(), partials.data(), hosts,
                  out.numel(), op == kernels::ReduceOp::kAvg ? group_.size() : 0);
}

c10::intrusive_ptr<c10d::Work> CrossHostCheck::start_all_gather(
    const at::Tensor& message, const at::Tensor& all, transport::Clock::time_point deadline) {
  at::Tensor in = message;
  at::Tensor out = all;
  c10d::AllgatherOptions opts;
  opts.timeout = engine_timeout(deadline);
  return engine_->get()._allgather_base(out, in, opts);
}

void CrossHostCheck::wait_all_gather(const c10::intrusive_ptr<c10d::Work>& work,
                                     transport::Clock::time_point deadline) {
  wait_for_engine(work, engine_timeout(deadline),
                  "two-level collective: the engine's exchange of calls across hosts");
}

CrossHostCheck::Exchange CrossHostCheck::start_refusal(transport::Clock::time_point deadline) {
  std::vector<int64_t> fields(kFields, 0);
  fields[4] = kRefused;
  Exchange sent;
  sent.all = at::empty({group_.num_hosts() * plan::kCrossHostMessageBytes}, at::kByte);
  sent.work = start_all_gather(message_with(fields), sent.all, deadline);
  return sent;
}

void CrossHostCheck::refuse(transport::Clock::time_point deadline) {
  wait_all_gather(start_refusal(deadline).work, deadline);
}

void CrossHostCheck::check_with_peers(Collective collective, const char* name,
                                      std::chrono::milliseconds timeout,
                                      const std::function<void()>& check) {
  try {
    check();
  } catch (const std::exception&) {
    auto take_part = [this, collective, name, timeout] {
      const auto deadline = group_.deadline_for(timeout);
      // The refusal leaves first and is waited for last: a collective that
      // crosses hosts before its host's check (the all-gather in slices)
      // holds a local peer in the exchange until this rank's partners there
      // have theirs, and they may be refusing ranks of other hosts, held in
      // their own hosts' checks until then.
      const Exchange refusal = start_refusal(deadline);
      transport::OpDescriptor refused = group_.next_descriptor(collective);
      refused.num_tensors = kRefusedCall;
      try {
        group_.host_channel()->open_collective(group_.make_context(refused, name, deadline));
      } catch (const transport::MismatchError&) {
        // Expected where a local peer called validly: it fails here as well.
      }
      wait_all_gather(refusal.work, deadline);
    };
    try {
      group_.enqueue(c10d::OpType::UNKNOWN, name, {}, take_part, /*async_op=*/false)->wait();
    } catch (const std::exception&) {
      // A peer gone meanwhile: this rank's own error says more.
    }
    throw;
  }
}

CrossHostCheck::Exchange CrossHostCheck::start(const transport::OpDescriptor& call,
                                               const void* payload, int64_t payload_bytes,
                                               transport::Clock::time_point deadline) {
  Exchange sent;
  sent.call = call;
  sent.fields = fields_of(call, payload_bytes);
  at::Tensor message = message_with(sent.fields);
  if (payload != nullptr && plan::carried_across_hosts(payload_bytes) && payload_bytes > 0) {
    std::memcpy(static_cast<char*>(message.data_ptr()) + plan::kCrossHostHeaderBytes, payload,
                static_cast<size_t>(payload_bytes));
  }
  sent.all = at::empty({group_.num_hosts() * plan::kCrossHostMessageBytes}, at::kByte);
  sent.work = start_all_gather(message, sent.all, deadline);
  return sent;
}

at::Tensor CrossHostCheck::exchange_around_host_step(
    const transport::OpDescriptor& call, bool carried, const void* payload, int64_t payload_bytes,
    bool host_step_follows, const char* what, transport::Clock::time_point deadline,
    const std::function<void(std::function<void()> after_check)>& host_step) {
  std::optional<Exchange> sent;
  try {
    host_step(carried ? std::function<void()>{}
                      : [&] { sent = start(call, nullptr, payload_bytes, deadline); });
  } catch (const transport::MismatchError&) {
    // The other hosts' ranks of this local index must not wait. (A rank that
    // sent its call had passed the host's check: nothing after it refuses.)
    if (!sent) refuse(deadline);
    throw;
  }
  if (carried) return exchange(call, payload, payload_bytes, host_step_follows, what, deadline);
  TORCH_INTERNAL_ASSERT(sent, "xdev ", what, ": the check across hosts was not started");
  return finish(*sent, host_step_follows, what, deadline);
}

at::Tensor CrossHostCheck::finish(Exchange& sent, bool host_step_follows, const char* what,
                                  transport::Clock::time_point deadline) {
  wait_all_gather(sent.work, deadline);
  sent.work.reset();
  const transport::OpDescriptor& call = sent.call;
  const std::vector<int64_t>& mine = sent.fields;
  const at::Tensor& all = sent.all;
  const int hosts = group_.num_hosts();
  bool same = true;
  for (int h = 0; h < hosts && same; ++h)
    same = std::memcmp(fields_in(all, h), mine.data(), kFields * sizeof(int64_t)) == 0;
  if (same) return all;

  // Step 2: this host's other ranks must stop too; a descriptor no call has
  // fails their next check unless they refuse as well.
  const std::string name = std::string(what) + " (the check across hosts)";
  if (host_step_follows) {
    transport::OpDescriptor refused =
        group_.next_descriptor(static_cast<Collective>(call.collective));
    refused.num_tensors = kRefused;
    try {
      group_.host_channel()->open_collective(group_.make_context(refused, name.c_str(), deadline));
    } catch (const transport::MismatchError&) {
      // Expected where a local peer's group agreed: it now fails as well.
    }
  }
  std::string msg = "xdev: ranks on different hosts called mismatched collectives at " +
                    std::string(what) + ": the ranks of local index " +
                    std::to_string(group_.local_rank()) + ", one per host, passed";
  for (int h = 0; h < hosts; ++h) {
    const int64_t* f = fields_in(all, h);
    if (f[4] == kRefused) {
      msg += "\n  host " + std::to_string(h) +
             ": nothing (its ranks stopped before crossing hosts: they called different "
             "collectives among themselves, a rank there refused its own arguments, or, in "
             "the leader form, a host's call differed from theirs; their errors name the "
             "calls)";
      continue;
    }
    const transport::OpDescriptor d = from_fields(f);
    msg += "\n  host " + std::to_string(h) + ": " + group_.describe_call(d);
    if (d.num_packs > 1) msg += ", cut in " + std::to_string(d.num_packs) + " pieces";
  }
  msg +=
      "\nEvery rank must pass tensors of the same shapes and dtypes, in the same order, "
      "with the same op and options. The group is still usable.";
  throw transport::MismatchError(msg);
}

}  // namespace xdev::backend
