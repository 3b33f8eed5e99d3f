#include "shared_buffers.h"

#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>

#include "setup_waits.h"
#include "tensor_helpers.h"

namespace xdev::backend {
namespace {

std::string shared_empty_prefix(int64_t id) {
  return "xdev/shared/" + std::to_string(id) + "/";
}

// A rank's store keys of shared_empty call `id` (its entry and its arrival at
// the mapping barrier; rank 0 also the barrier's failure count), once every
// rank is past that call: a job that calls shared_empty every step would
// otherwise grow the store by 2W+1 keys a call. Best effort: a key left
// behind costs a few bytes, a failed call a peer's tensor.
void forget_shared_empty_keys(c10d::Store& store, int64_t id, int rank) {
  const std::string prefix = shared_empty_prefix(id);
  try {
    store.deleteKey(prefix + std::to_string(rank));
    store.deleteKey(prefix + "mapped/arrived/" + std::to_string(rank));
    if (rank == 0) store.deleteKey(prefix + "mapped/failures");
  } catch (const std::exception&) {
  }
}

// A shared_empty segment's size: its bytes (at least one) in whole pages.
size_t page_round(size_t bytes) {
  constexpr size_t kPage = 4096;
  return (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
}

// Shared memory takes its pages when they are first written, not when it is
// made, so a tensor larger than the machine would be made here and kill the
// process when filled. at::empty refuses such a size at once; so does this.
void refuse_more_than_memory(const char* what, int64_t numel, at::ScalarType dtype, size_t bytes) {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_bytes = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_bytes <= 0) return;
  const auto memory = static_cast<size_t>(pages) * static_cast<size_t>(page_bytes);
  if (bytes <= memory) return;
  throw std::invalid_argument(std::string("xdev ") + what + ": a tensor of " +
                              std::to_string(numel) + " " + c10::toString(dtype) +
                              " elements is too large (" + std::to_string(bytes) +
                              " bytes; this machine has " + std::to_string(memory) + ")");
}

// What a rank asked shared_empty for, in one word (no spaces: it follows the
// segment's name in the rank's Store entry): "Float[2,3]".
std::string shape_word(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
  std::string word = std::string(c10::toString(dtype)) + "[";
  for (size_t i = 0; i < sizes.size(); ++i) word += (i ? "," : "") + std::to_string(sizes[i]);
  return word + "]";
}

// The segment names in every rank's entry of shared_empty call `id` (entries
// are "name shape", or "!why" where the rank failed), read alike on every
// rank. Throws, on every rank alike, where a rank failed (this one: its own
// error) or the ranks asked for different shapes.
std::vector<std::string> agreed_segment_names(c10d::Store& store, const std::string& prefix,
                                              int size, int64_t id, const std::string& asked_for,
                                              const std::exception_ptr& my_failure) {
  std::vector<std::string> names(static_cast<size_t>(size));
  std::string asked;
  std::string failed;
  bool same = true;
  for (int r = 0; r < size; ++r) {
    const std::string entry = store.get_to_str(prefix + std::to_string(r));
    if (!entry.empty() && entry[0] == '!') {
      failed += "\n  rank " + std::to_string(r) + ": " + entry.substr(1);
      continue;
    }
    const size_t space = entry.find(' ');
    names[static_cast<size_t>(r)] = entry.substr(0, space);
    const std::string theirs = entry.substr(space + 1);
    same = same && theirs == asked_for;
    asked += (r ? ", rank " : "rank ") + std::to_string(r) + ": " + theirs;
  }
  if (my_failure) std::rethrow_exception(my_failure);
  if (!failed.empty()) {
    throw std::runtime_error("torch_xdev.shared_empty #" + std::to_string(id) +
                             ": another rank could not make its part, so no rank's tensor was "
                             "made:" +
                             failed);
  }
  if (!same) {
    throw std::invalid_argument("torch_xdev.shared_empty #" + std::to_string(id) +
                                ": ranks asked for different sizes or dtypes (" + asked +
                                "); every rank must call it with the same size and dtype");
  }
  return names;
}

}  // namespace

SharedBuffers::SharedBuffers(GroupContext& group) : group_(group) {
  if (group.size() == 1) {
    heap_note_ = "off: a world of one";
    return;
  }
  if (!group.config().shared_buckets) {
    heap_note_ = "off: Options.shared_buckets / XDEV_SHARED_BUCKETS is off";
    return;
  }
  // On one host the heap is the group's; on several, each host's ranks share
  // one over their host channel, and the in-host steps of the two-level
  // allreduce read it. Whether a rank has that channel follows from what all
  // ranks learned when the group was made: alike on every rank.
  transport::ShmChannel* channel = heap_channel();
  if (channel == nullptr) {
    heap_note_ = "off: no shared memory (" + group.no_channel_reason() + ")";
    return;
  }
  // Each rank makes its first arena and publishes it in the channel; once all
  // have (a Store barrier), each maps every peer's, and all agree whether
  // every rank could. That costs two Store round trips per group.
  std::string why;
  auto heap = std::make_shared<transport::SymmetricHeap>(
      channel->rank(), channel->world_size(), transport::HeapPlacement::kFirstArenaBytes,
      [this](int arena, const transport::ArenaAddress& address) {
        heap_channel()->publish_arena(arena, address);
      });
  try {
    heap->first_arena();
  } catch (const std::exception& e) {
    why = e.what();
  }
  c10d::Store& store = group.store();
  store_barrier(store, "xdev/heap/published/", group.rank(), group.size(), group.config().timeout,
                "publishing the symmetric heap");
  for (int r = 0; r < channel->world_size() && why.empty(); ++r) {
    if (!channel->shares_pid_namespace(r)) {
      // Its arena's /proc/<pid>/fd path would name another process here.
      why = "local rank " + std::to_string(r) + " runs in another pid namespace";
      break;
    }
    try {
      heap->arena_of(r, 0, channel->arena_of(r, 0));
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  if (count_failures_across_ranks(store, "xdev/heap/", !why.empty(), group.rank(), group.size(),
                                  group.config().timeout, "mapping the symmetric heap") == 0) {
    heap_ = std::move(heap);
    heap_note_ = std::string("on: CPU tensors from allocateTensor (DDP's buckets) lie in memory ") +
                 (group.num_hosts() == 1 ? "every rank maps" : "every rank of their host maps");
  } else {
    heap_note_ = why.empty() ? "off: a peer cannot map this host's ranks' memory (see its log)"
                             : "off: " + why;
    group.log_once("heap-off", "symmetric heap " + heap_note_);
  }
}

transport::ShmChannel* SharedBuffers::heap_channel() const {
  return group_.num_hosts() > 1 ? group_.host_channel() : group_.channel();
}

void SharedBuffers::close() {
  std::shared_ptr<transport::SymmetricHeap> heap;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    heap = std::move(heap_);
    closed_ = true;
  }
  if (heap != nullptr) heap->close();  // waits for an allocation under way
}

at::Tensor SharedBuffers::allocate(int64_t numel, at::ScalarType dtype) {
  std::shared_ptr<transport::SymmetricHeap> heap;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) {
      throw std::invalid_argument("xdev allocateTensor: this process group has been destroyed");
    }
    heap = heap_;
  }
  if (heap == nullptr) {
    throw std::invalid_argument("xdev allocateTensor: this group has no symmetric heap (" +
                                heap_note_ + ")");
  }
  if (numel < 0) {
    throw std::invalid_argument("xdev allocateTensor: negative size " + std::to_string(numel));
  }
  const size_t bytes = heap_block_bytes("allocateTensor", numel, dtype);
  refuse_more_than_memory("allocateTensor", numel, dtype, bytes);
  const auto ordinary = [&] {
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(at::kCPU));
  };
  if (group_.poisoned()) {
    // A peer that failed or fell behind may still write into blocks of this
    // rank's heap (an in-place allreduce writes every copy) after this rank
    // gave up on the call: hand out no heap memory again, so that what the
    // caller freed never comes back holding data of its own.
    group_.log_once("heap-poisoned",
                    "allocateTensor gives ordinary tensors: the group is unusable after a failure");
    return ordinary();
  }
  // Closed since the check above: the heap refuses, saying the group has been
  // destroyed (std::invalid_argument, which goes to the caller).
  std::optional<transport::SymmetricHeap::Block> placed;
  try {
    placed = heap->allocate(bytes);
  } catch (const std::runtime_error& e) {
    // The heap cannot grow on this rank (memory, an address-space limit, its
    // last arena). Its peers' may have: raising here alone would leave them
    // waiting for this rank at the next collective (DDP builds its buckets
    // on every rank, then allreduces). An ordinary tensor is always right:
    // every call checks that all ranks' tensors are at one heap place, and
    // stages where they are not.
    group_.log_once("heap-cannot-grow",
                    std::string("allocateTensor gives ordinary tensors where the symmetric heap "
                                "cannot grow (") +
                        e.what() + "); collectives on them are staged");
    return ordinary();
  }
  const transport::SymmetricHeap::Block block = *placed;
  if (group_.config().debug) {
    std::fprintf(stderr,
                 "[xdev] group '%s' rank %d: allocateTensor %" PRId64
                 " x %s (%zu bytes) at heap arena %d offset %" PRId64 " (%zu bytes in use)\n",
                 group_.config().group_name.c_str(), group_.rank(), numel, c10::toString(dtype),
                 bytes, block.where.arena, block.where.offset, heap->bytes_in_use());
  }
  // The tensor's storage returns the block; it holds the heap, which may so outlive the group.
  return at::from_blob(
      block.data, {numel}, [heap, where = block.where](void*) { heap->free(where); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

std::vector<char*> copies_of(const SharedPlacement& placement,
                             const transport::ShmChannel& channel) {
  std::vector<char*> copies;
  for (int r = 0; r < channel.world_size(); ++r) {
    if (placement.buffer != nullptr) {
      copies.push_back(placement.buffer->data(r) + placement.offset);
    } else {
      const transport::HeapLocation& at = placement.heap_location;
      copies.push_back(placement.heap->arena_of(r, at.arena, channel.arena_of(r, at.arena)) +
                       at.offset);
    }
  }
  return copies;
}

bool map_peers_copies(GroupContext& group, const SharedPlacement& placement,
                      const transport::ShmChannel& channel) {
  const int arena = placement.heap_location.arena;
  try {
    for (int r = 0; r < channel.world_size(); ++r) {
      const transport::ArenaAddress address = channel.arena_of(r, arena);
      // Not published yet: the peer allocates its copy after this rank
      // reached the call. It will have by the first barrier, but mapping it
      // there could fail on this rank alone (see the header): stage this once.
      if (r != channel.rank() && address.bytes == 0) return false;
      placement.heap->arena_of(r, arena, address);
    }
    return true;
  } catch (const std::exception& e) {
    // Out of reach here (an address-space limit, say); the next call tries again.
    group.log_once("heap-peer-arena",
                   std::string("a peer's symmetric heap arena cannot be mapped (") + e.what() +
                       "); tensors in it are staged until it can be");
    return false;
  }
}

at::Tensor SharedBuffers::empty(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
  const int rank = group_.rank(), size = group_.size();
  // A world of one has no one to share with, and a group on one host without
  // shared memory (algorithm='fallback', say) runs every call on Gloo: an
  // ordinary tensor does the same there. Both are alike on every rank.
  const auto ordinary = [&] {
    return at::zeros(sizes, at::TensorOptions().dtype(dtype).device(at::kCPU));
  };
  if (size == 1) return ordinary();
  if (group_.channel() == nullptr && group_.num_hosts() == 1) {
    group_.log_once("shared-empty-ordinary",
                    "torch_xdev.shared_empty gives ordinary tensors: no shared memory (" +
                        group_.no_channel_reason() + ")");
    return ordinary();
  }
  if (group_.channel() == nullptr) {
    throw std::invalid_argument(
        "torch_xdev.shared_empty needs all ranks of the group on one host (this group's " +
        std::to_string(size) + " ranks are on " + std::to_string(group_.num_hosts()) +
        " hosts); use an ordinary tensor");
  }
  // Every rank first meets its peers in the host's channel, which names a
  // peer that died or never came (a wait on the Store alone would wait out
  // the group's timeout, then name no one). A rank in another collective
  // fails both calls there, before either takes a number.
  const auto timeout = group_.config().timeout;
  group_.meet_peers(Collective::kSharedEmpty, "torch_xdev.shared_empty", timeout);
  // The call takes its number next, and what this rank could not do (its
  // arguments, its segment) goes to the peers in its Store entry: every rank
  // then refuses the same call, and the calls after it stay paired.
  int64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    id = next_id_++;
  }
  size_t bytes = 0;
  transport::ShmSegment mine;
  std::exception_ptr my_failure;
  std::string my_reason;
  const std::string asked_for = shape_word(sizes, dtype);
  try {
    int64_t numel = 1;
    for (int64_t d : sizes) {
      if (d < 0) {
        // Formatted here: c10::str of an int64 array crashed with torch 2.11 (C++17).
        std::string shape;
        for (int64_t e : sizes) shape += (shape.empty() ? "" : ", ") + std::to_string(e);
        throw std::invalid_argument("torch_xdev.shared_empty: negative dimension " +
                                    std::to_string(d) + " in size [" + shape + "]");
      }
      if (__builtin_mul_overflow(numel, d, &numel))
        numel = -1;  // too large: heap_block_bytes says so
    }
    bytes = heap_block_bytes("torch_xdev.shared_empty", numel, dtype);
    refuse_more_than_memory("torch_xdev.shared_empty", numel, dtype, bytes);
    mine = transport::ShmSegment::create(transport::ShmSegment::make_name(), page_round(bytes));
  } catch (const std::exception& e) {
    my_failure = std::current_exception();
    my_reason = e.what();
  }
  c10d::Store& store = group_.store();
  const std::string prefix = shared_empty_prefix(id);
  store.set(prefix + std::to_string(rank),
            my_failure ? "!" + my_reason : mine.name() + " " + asked_for);
  // A rank that never calls it: the group's timeout.
  wait_for_peers([&] {
    wait_for_ranks(store, prefix, size, timeout, "torch_xdev.shared_empty #" + std::to_string(id));
  });
  // Every rank has left the call before (it set its key of this one after).
  if (id > 0) forget_shared_empty_keys(store, id - 1, rank);
  // Every rank read the same entries, so every rank refuses together.
  const std::vector<std::string> names =
      agreed_segment_names(store, prefix, size, id, asked_for, my_failure);
  const size_t segment_bytes = page_round(bytes);
  std::vector<transport::ShmSegment> segments(static_cast<size_t>(size));
  std::string open_failure;
  try {
    for (int r = 0; r < size; ++r) {
      if (r != rank) {
        segments[static_cast<size_t>(r)] =
            transport::ShmSegment::open(names[static_cast<size_t>(r)], segment_bytes);
      }
    }
  } catch (const std::exception& e) {
    open_failure = e.what();
  }
  // Every rank has opened its peers' segments (or failed to) before any name goes.
  const int64_t failures = wait_for_peers([&] {
    return count_failures_across_ranks(store, prefix + "mapped/", !open_failure.empty(), rank, size,
                                       timeout, "torch_xdev.shared_empty #" + std::to_string(id));
  });
  mine.unlink();
  if (!open_failure.empty()) throw std::runtime_error(open_failure);
  if (failures > 0) {
    throw std::runtime_error("torch_xdev.shared_empty #" + std::to_string(id) + ": " +
                             std::to_string(failures) +
                             " rank(s) could not map their peers' memory (see their errors), "
                             "so no rank's tensor was made");
  }
  segments[static_cast<size_t>(rank)] = std::move(mine);
  auto buffer = std::make_shared<transport::SharedBuffer>(id, rank, std::move(segments));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto expired = [](const std::weak_ptr<transport::SharedBuffer>& w) { return w.expired(); };
    buffers_.erase(std::remove_if(buffers_.begin(), buffers_.end(), expired), buffers_.end());
    buffers_.push_back(buffer);
  }
  // The tensor's storage owns the buffer: the mappings go when it does.
  void* data = buffer->data(rank);
  return at::from_blob(
      data, sizes, [buffer](void*) mutable { buffer.reset(); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

int64_t SharedBuffers::live() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::count_if(
      buffers_.begin(), buffers_.end(),
      [](const std::weak_ptr<transport::SharedBuffer>& w) { return !w.expired(); });
}

SharedPlacement SharedBuffers::find(const at::Tensor& t) const {
  if (!t.is_cpu() || !t.is_contiguous()) return {};
  const auto bytes = static_cast<size_t>(t.numel()) * t.element_size();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& weak : buffers_) {
    std::shared_ptr<transport::SharedBuffer> b = weak.lock();
    if (!b) continue;
    const int64_t offset = b->offset_of(t.data_ptr(), bytes);
    if (offset >= 0) return {std::move(b), offset, nullptr, {}};
  }
  if (heap_ != nullptr) {
    const transport::HeapLocation where = heap_->locate(t.data_ptr(), bytes);
    if (where.arena >= 0) return {nullptr, 0, heap_, where};
  }
  return {};
}

}  // namespace xdev::backend
