#include "cross_host_check.h"

#include <ATen/ATen.h>

#include <vector>

#include "two_level_allreduce.h"

namespace xdev::backend {
namespace {

// The fields that say what a call is; seq (each host numbers its own steps)
// and where tensors lie in memory (per rank) are left out.
std::vector<int64_t> fields_of(const transport::OpDescriptor& d) {
  return {d.collective,
          d.reduce_op,
          d.dtype,
          d.root,
          d.num_tensors,
          d.total_elems,
          static_cast<int64_t>(d.shape_hash)};
}

transport::OpDescriptor from_fields(const int64_t* f) {
  transport::OpDescriptor d;
  d.collective = static_cast<int32_t>(f[0]);
  d.reduce_op = static_cast<int32_t>(f[1]);
  d.dtype = static_cast<int32_t>(f[2]);
  d.root = f[3];
  d.num_tensors = f[4];
  d.total_elems = f[5];
  d.shape_hash = static_cast<uint64_t>(f[6]);
  d.algorithm = static_cast<int32_t>(plan::Algorithm::kFlat);  // how describe() names two levels
  return d;
}

}  // namespace

CrossHostCheck::CrossHostCheck(GroupContext& group, c10::intrusive_ptr<c10d::Backend> engine)
    : group_(group), engine_(std::move(engine)) {}

void CrossHostCheck::check(const transport::OpDescriptor& call, const char* what,
                           transport::Clock::time_point deadline) {
  const std::vector<int64_t> mine = fields_of(call);
  const auto k = static_cast<int64_t>(mine.size());
  const int hosts = group_.num_hosts();
  at::Tensor in = at::tensor(mine, at::kLong);
  at::Tensor all = at::empty({hosts * k}, at::kLong);
  c10d::AllgatherOptions opts;
  opts.timeout = engine_timeout(deadline);
  wait_for_engine(engine_->_allgather_base(all, in, opts), opts.timeout,
                  "two-level collective: the engine's exchange of calls across hosts");
  const int64_t* rows = all.const_data_ptr<int64_t>();
  bool same = true;
  for (int64_t i = 0; i < hosts * k; ++i)
    same = same && rows[i] == mine[static_cast<size_t>(i % k)];
  if (same) return;

  // Step 2: this host's other ranks must stop too; a descriptor no call has
  // fails their next check unless they refuse as well.
  transport::OpDescriptor refused =
      group_.next_descriptor(static_cast<Collective>(call.collective));
  refused.num_tensors = -1;
  const std::string name = std::string(what) + " (the check across hosts)";
  try {
    group_.host_channel()->open_collective(group_.make_context(refused, name.c_str(), deadline));
  } catch (const transport::MismatchError&) {
    // Expected where a local peer's group agreed: it now fails as well.
  }
  std::string msg = "xdev: ranks on different hosts called mismatched collectives at " +
                    std::string(what) + ": the ranks of local index " +
                    std::to_string(group_.local_rank()) + ", one per host, passed";
  for (int h = 0; h < hosts; ++h) {
    transport::OpDescriptor d = from_fields(rows + h * k);
    d.seq = refused.seq;
    msg += "\n  host " + std::to_string(h) + ": " + group_.describe_op(d);
  }
  msg +=
      "\nEvery rank must pass tensors of the same shapes and dtypes, in the same order, "
      "with the same op and options. The group is still usable.";
  throw transport::MismatchError(msg);
}

}  // namespace xdev::backend
