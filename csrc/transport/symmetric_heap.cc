#include "symmetric_heap.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <stdexcept>

namespace xdev::transport {
namespace {

[[noreturn]] void throw_errno(const std::string& what, int err) {
  throw std::runtime_error("xdev symmetric heap: " + what + ": " + std::strerror(err));
}

}  // namespace

SymmetricHeap::SymmetricHeap(int rank, int world_size, size_t first_arena_bytes, Publish publish)
    : rank_(rank),
      world_size_(world_size),
      first_arena_bytes_(first_arena_bytes),
      publish_(std::move(publish)),
      peers_(static_cast<size_t>(world_size),
             std::vector<std::pair<size_t, char*>>(kMaxArenas, {0, nullptr})) {
  if (rank < 0 || rank >= world_size) throw std::invalid_argument("SymmetricHeap: bad rank");
}

SymmetricHeap::~SymmetricHeap() {
  for (Arena& a : own_) {
    ::munmap(a.data, a.bytes);
    ::close(a.fd);
  }
  unmap_peers();
}

void SymmetricHeap::unmap_peers() {
  for (auto& arenas : peers_) {
    for (auto& [bytes, data] : arenas) {
      if (data != nullptr) ::munmap(data, bytes);
      data = nullptr;
    }
  }
}

void SymmetricHeap::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  closed_ = true;
  unmap_peers();
}

bool SymmetricHeap::closed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closed_;
}

int SymmetricHeap::add_arena(size_t at_least) {
  const size_t bytes =
      placement_.next_arena_bytes(at_least, first_arena_bytes_, "xdev symmetric heap", rank_);
  // MFD_CLOEXEC: a program the rank execs gets no handle on the group's
  // memory. (A child forked without exec, such as a DataLoader worker, keeps
  // the mapping, as it keeps every other page of its parent.)
  const int fd = ::memfd_create("xdev-heap", MFD_CLOEXEC);
  if (fd < 0) throw_errno("memfd_create", errno);
  // Peers open it through /proc/<pid>/fd, which the kernel allows only to
  // processes that may inspect this one (same user); 0600 says the same.
  if (::fchmod(fd, S_IRUSR | S_IWUSR) != 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    throw_errno("sizing an arena of " + std::to_string(bytes) + " bytes", err);
  }
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    throw_errno("mapping an arena of " + std::to_string(bytes) + " bytes", err);
  }
  own_.push_back(Arena{fd, static_cast<char*>(data), bytes});
  own_data_.push_back(static_cast<char*>(data));
  const int index = placement_.add_arena(bytes);
  if (publish_) publish_(index, ArenaAddress{static_cast<int32_t>(::getpid()), fd, bytes});
  return index;
}

SymmetricHeap::Block SymmetricHeap::allocate(size_t bytes) {
  const int64_t need = HeapPlacement::block_bytes(bytes, "xdev symmetric heap");
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) {
    throw std::invalid_argument("xdev symmetric heap: its process group has been destroyed");
  }
  std::optional<HeapLocation> where = placement_.place(need);
  if (!where) {
    add_arena(static_cast<size_t>(need));
    where = placement_.place(need);  // the new arena holds it
  }
  return Block{own_[static_cast<size_t>(where->arena)].data + where->offset, *where};
}

void SymmetricHeap::free(HeapLocation where) {
  std::lock_guard<std::mutex> lock(mutex_);
  placement_.free(where);
}

HeapLocation SymmetricHeap::locate(const void* p, size_t n) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return locate_in_arenas(placement_, own_data_, p, n);
}

void* SymmetricHeap::map_peer_arena(const ArenaAddress& address) {
  const std::string path =
      "/proc/" + std::to_string(address.pid) + "/fd/" + std::to_string(address.fd);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) throw_errno("opening a peer's arena at " + path, errno);
  struct stat st{};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < address.bytes) {
    ::close(fd);
    throw std::runtime_error("xdev symmetric heap: " + path + " is not the peer's arena (" +
                             std::to_string(st.st_size) + " bytes, expected " +
                             std::to_string(address.bytes) + ")");
  }
  void* data = ::mmap(nullptr, address.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the memory
  if (data == MAP_FAILED) throw_errno("mapping a peer's arena " + path, err);
  return data;
}

char* SymmetricHeap::arena_of(int r, int arena, const ArenaAddress& address) {
  if (arena < 0 || arena >= kMaxArenas || r < 0 || r >= world_size_) {
    throw std::out_of_range("SymmetricHeap::arena_of: no arena " + std::to_string(arena) +
                            " of rank " + std::to_string(r));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (r == rank_) {
    if (arena >= static_cast<int>(own_.size())) {
      throw std::out_of_range("SymmetricHeap::arena_of: this rank has no arena " +
                              std::to_string(arena));
    }
    return own_[static_cast<size_t>(arena)].data;
  }
  if (closed_)
    throw std::runtime_error("xdev symmetric heap: its process group has been destroyed");
  auto& slot = peers_[static_cast<size_t>(r)][static_cast<size_t>(arena)];
  if (slot.second == nullptr) {
    if (address.bytes == 0) {
      throw std::runtime_error("xdev symmetric heap: rank " + std::to_string(r) +
                               " has published no arena " + std::to_string(arena));
    }
    slot = {address.bytes, static_cast<char*>(map_peer_arena(address))};
  }
  return slot.second;
}

ArenaAddress SymmetricHeap::first_arena() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (own_.empty()) add_arena(first_arena_bytes_);
  const Arena& a = own_.front();
  return ArenaAddress{static_cast<int32_t>(::getpid()), a.fd, a.bytes};
}

int SymmetricHeap::arenas() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return placement_.arenas();
}

size_t SymmetricHeap::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return placement_.bytes_in_use();
}

size_t SymmetricHeap::bytes_reserved() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return placement_.bytes_reserved();
}

int64_t SymmetricHeap::live_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return placement_.live_blocks();
}

}  // namespace xdev::transport
