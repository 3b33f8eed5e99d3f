#include "heap_placement.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>

namespace xdev::transport {

int64_t HeapPlacement::block_bytes(size_t bytes, const char* owner) {
  if (bytes > static_cast<size_t>(kMaxBlockBytes)) {
    throw std::invalid_argument(std::string(owner) + ": " + std::to_string(bytes) +
                                " bytes is more than a block can hold");
  }
  const auto b = static_cast<int64_t>(bytes == 0 ? 1 : bytes);
  return (b + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
}

size_t HeapPlacement::next_arena_bytes(size_t need, size_t first_arena_bytes, const char* owner,
                                       int rank) const {
  if (arenas_.size() >= static_cast<size_t>(kMaxArenas)) {
    throw std::runtime_error(std::string(owner) + ": rank " + std::to_string(rank) + " has " +
                             std::to_string(kMaxArenas) + " arenas (" +
                             std::to_string(bytes_reserved() >> 20) +
                             " MiB) and none has room for " + std::to_string(need) + " more bytes");
  }
  constexpr size_t kGranule = size_t{2} << 20;
  const size_t bytes = std::max(
      {need, bytes_reserved(), arenas_.empty() ? first_arena_bytes : size_t{0}, size_t{1}});
  return (bytes + kGranule - 1) / kGranule * kGranule;
}

int HeapPlacement::add_arena(size_t bytes) {
  Arena arena;
  arena.bytes = bytes;
  arena.free_blocks[0] = static_cast<int64_t>(bytes);
  arenas_.push_back(std::move(arena));
  return static_cast<int>(arenas_.size()) - 1;
}

std::optional<HeapLocation> HeapPlacement::place(int64_t need) {
  for (size_t i = 0; i < arenas_.size(); ++i) {
    Arena& a = arenas_[i];
    for (auto it = a.free_blocks.begin(); it != a.free_blocks.end(); ++it) {
      if (it->second < need) continue;
      const int64_t offset = it->first;
      const int64_t rest = it->second - need;
      a.free_blocks.erase(it);
      if (rest > 0) a.free_blocks[offset + need] = rest;
      a.live_blocks[offset] = need;
      return HeapLocation{static_cast<int>(i), offset};
    }
  }
  return std::nullopt;
}

bool HeapPlacement::free(HeapLocation where) {
  if (where.arena < 0 || where.arena >= static_cast<int>(arenas_.size())) return false;
  Arena& a = arenas_[static_cast<size_t>(where.arena)];
  const auto live = a.live_blocks.find(where.offset);
  if (live == a.live_blocks.end()) return false;
  int64_t offset = live->first, bytes = live->second;
  a.live_blocks.erase(live);
  // Coalesce with the free neighbours on both sides.
  auto next = a.free_blocks.lower_bound(offset);
  if (next != a.free_blocks.end() && next->first == offset + bytes) {
    bytes += next->second;
    next = a.free_blocks.erase(next);
  }
  if (next != a.free_blocks.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      bytes += prev->second;
      a.free_blocks.erase(prev);
    }
  }
  a.free_blocks[offset] = bytes;
  return true;
}

size_t HeapPlacement::bytes_reserved() const {
  size_t total = 0;
  for (const Arena& a : arenas_) total += a.bytes;
  return total;
}

size_t HeapPlacement::bytes_in_use() const {
  size_t total = 0;
  for (const Arena& a : arenas_) {
    for (const auto& [offset, bytes] : a.live_blocks) total += static_cast<size_t>(bytes);
  }
  return total;
}

int64_t HeapPlacement::live_blocks() const {
  int64_t n = 0;
  for (const Arena& a : arenas_) n += static_cast<int64_t>(a.live_blocks.size());
  return n;
}

HeapLocation locate_in_arenas(const HeapPlacement& placement, const std::vector<char*>& bases,
                              const void* p, size_t n) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  for (size_t i = 0; i < bases.size(); ++i) {
    const auto begin = reinterpret_cast<uintptr_t>(bases[i]);
    const size_t bytes = placement.arena_bytes(static_cast<int>(i));
    if (at >= begin && at - begin <= bytes && n <= bytes - (at - begin)) {
      return HeapLocation{static_cast<int>(i), static_cast<int64_t>(at - begin)};
    }
  }
  return {};
}

}  // namespace xdev::transport
