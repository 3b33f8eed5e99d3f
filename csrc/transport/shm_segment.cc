#include "shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace xdev::transport {
namespace {

[[noreturn]] void throw_errno(const std::string& what, int err) {
  throw std::runtime_error("xdev shared memory: " + what + ": " + std::strerror(err));
}

// Closes an fd on every path out of create/open.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

void* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw_errno("mmap " + name, errno);
  return p;
}

}  // namespace

ShmSegment::~ShmSegment() {
  reset();
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept {
  *this = std::move(other);
}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    reset();
    name_ = std::move(other.name_);
    data_ = other.data_;
    size_ = other.size_;
    owner_linked_ = other.owner_linked_;
    other.data_ = nullptr;
    other.size_ = 0;
    other.owner_linked_ = false;
  }
  return *this;
}

void ShmSegment::reset() {
  unlink();
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

void fill_random(void* out, size_t bytes) {
  auto* to = static_cast<unsigned char*>(out);
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::getrandom(to + got, bytes - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("getrandom", errno);
    }
    got += static_cast<size_t>(n);
  }
}

std::string ShmSegment::make_name() {
  unsigned char bytes[16];
  fill_random(bytes, sizeof bytes);
  char hex[33];
  for (size_t i = 0; i < sizeof bytes; ++i) std::snprintf(hex + 2 * i, 3, "%02x", bytes[i]);
  return "/xdev-" + std::to_string(::getpid()) + "-" + std::to_string(pid_namespace()) + "-" + hex;
}

uint64_t pid_namespace() {
  struct stat st{};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  FdGuard fd{::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR)};
  if (fd.fd < 0) throw_errno("shm_open(create) " + name, errno);
  ShmSegment seg;
  seg.name_ = name;
  seg.owner_linked_ = true;  // from here on, ~ShmSegment unlinks on any error
  // The umask cannot widen 0600, but be explicit about the promise.
  if (::fchmod(fd.fd, S_IRUSR | S_IWUSR) != 0) throw_errno("fchmod " + name, errno);
  if (::ftruncate(fd.fd, static_cast<off_t>(bytes)) != 0) throw_errno("ftruncate " + name, errno);
  // Reserve the pages now: a full /dev/shm must fail here with a message, not
  // with SIGBUS in the middle of a collective.
  const int err = ::posix_fallocate(fd.fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    throw_errno("reserving " + std::to_string(bytes) + " bytes in /dev/shm for " + name +
                    " (is /dev/shm too small? lower XDEV_SHM_SLOT_BYTES)",
                err);
  }
  seg.data_ = map_fd(fd.fd, bytes, name);
  seg.size_ = bytes;
  return seg;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  FdGuard fd{::shm_open(name.c_str(), O_RDWR, 0)};
  if (fd.fd < 0) throw_errno("shm_open " + name, errno);
  struct stat st{};
  if (::fstat(fd.fd, &st) != 0) throw_errno("fstat " + name, errno);
  if (static_cast<size_t>(st.st_size) != bytes) {
    throw std::runtime_error("xdev shared memory: " + name + " has " + std::to_string(st.st_size) +
                             " bytes, expected " + std::to_string(bytes) +
                             " (ranks disagree on XDEV_SHM_SLOT_BYTES?)");
  }
  ShmSegment seg;
  seg.name_ = name;
  seg.data_ = map_fd(fd.fd, bytes, name);
  seg.size_ = bytes;
  return seg;
}

void ShmSegment::unlink() {
  if (!owner_linked_) return;
  ::shm_unlink(name_.c_str());
  owner_linked_ = false;
}

bool process_exited(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  // /proc/<pid>/stat: "pid (comm) state ...", where comm may hold spaces and parentheses.
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return errno == ENOENT;
  char line[512];
  const bool read = std::fgets(line, sizeof line, f) != nullptr;
  std::fclose(f);
  if (!read) return false;
  const char* close = std::strrchr(line, ')');
  if (close == nullptr || close[1] != ' ') return false;
  return close[2] == 'Z' || close[2] == 'X';
}

int ShmSegment::remove_orphans() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  const uid_t me = ::geteuid();
  const uint64_t our_namespace = pid_namespace();
  while (dirent* e = ::readdir(dir)) {
    long pid = 0;
    unsigned long long ns = 0;
    char rest[64];
    if (std::sscanf(e->d_name, "xdev-%ld-%llu-%63s", &pid, &ns, rest) != 3 || pid <= 0) continue;
    // Another namespace's pid says nothing about a process here.
    if (ns != our_namespace) continue;
    struct stat st{};
    const std::string path = std::string("/dev/shm/") + e->d_name;
    if (::stat(path.c_str(), &st) != 0 || st.st_uid != me) continue;
    if (!process_exited(static_cast<pid_t>(pid))) continue;
    if (::shm_unlink((std::string("/") + e->d_name).c_str()) == 0) ++removed;
  }
  ::closedir(dir);
  return removed;
}

}  // namespace xdev::transport
