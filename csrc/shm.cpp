// Shared-memory primitives of the sglang-hs store and output ring (CPU; always built).
//
//   map_file(dir, name, nbytes, create) -> uint8 tensor over a MAP_SHARED mapping
//       The file is opened relative to `dir` (opened O_DIRECTORY|O_NOFOLLOW) with O_NOFOLLOW, so neither
//       the folder nor the file is ever followed through a symlink. create=True makes a new file
//       (O_EXCL, mode 0600) and reserves its pages with posix_fallocate, so a full /dev/shm fails here
//       with ENOSPC instead of SIGBUS on a later write. create=False maps an existing regular file owned
//       by `owner_uid` (-1: this user; the reader of a dump shared with its group names the server's
//       user), of exactly `nbytes` bytes (or any size if nbytes == 0). The owner is checked on the
//       opened file, so a file swapped after a path check is still refused. Pages are populated at
//       mapping time (MAP_POPULATE). The mapping is unmapped
//       when the last tensor view of it is freed.
//   load_acquire(buf, offset) / store_release(buf, offset, value) / fetch_add(buf, offset, delta)
//       64-bit atomics on an 8-byte-aligned word inside such a mapping, with C++11 acquire / release /
//       acq_rel ordering: a writer fills a record, then store_release()s the counter that publishes it;
//       a reader that load_acquire()s the new counter value sees the whole record.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>

#include "check.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace sglang_hs {
namespace {

[[noreturn]] void fail_errno(const std::string& what, const std::string& path, int err) {
  fail("%s %s: %s (errno %d)", what.c_str(), path.c_str(), std::strerror(err), err);
}

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() { if (fd >= 0) ::close(fd); }
};

uint64_t* word(const at::Tensor& buf, int64_t offset) {
  HS_CHECK(buf.device().is_cpu(), "sglang_hs atomics: buffer must be a CPU (host) tensor");
  HS_CHECK(buf.scalar_type() == at::kByte && buf.is_contiguous(),
           "sglang_hs atomics: buffer must be a contiguous uint8 tensor, got %s", dtype_name(buf.scalar_type()));
  HS_CHECK(offset >= 0 && offset + 8 <= buf.numel(), "sglang_hs atomics: offset %lld outside a buffer of %lld bytes",
           (long long)offset, (long long)buf.numel());
  auto* p = static_cast<uint8_t*>(buf.data_ptr()) + offset;
  HS_CHECK(reinterpret_cast<uintptr_t>(p) % alignof(uint64_t) == 0, "sglang_hs atomics: offset %lld is not 8-byte aligned",
           (long long)offset);
  return reinterpret_cast<uint64_t*>(p);
}

}  // namespace

at::Tensor map_file(const std::string& dir, const std::string& name, int64_t nbytes, bool create,
                    int64_t owner_uid) {
  HS_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..",
           "sglang_hs.map_file: name must be a plain file name, got '%s'", name.c_str());
  HS_CHECK(nbytes >= 0, "sglang_hs.map_file: nbytes must be >= 0, got %lld", (long long)nbytes);
  HS_CHECK(!create || nbytes > 0, "sglang_hs.map_file: a new file needs nbytes > 0");
  const std::string path = dir + "/" + name;

  Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (dfd.fd < 0) fail_errno("cannot open dump folder", dir, errno);
  int flags = O_RDWR | O_NOFOLLOW | O_CLOEXEC | (create ? (O_CREAT | O_EXCL) : 0);
  Fd fd(::openat(dfd.fd, name.c_str(), flags, 0600));
  if (fd.fd < 0) fail_errno(create ? "cannot create" : "cannot open", path, errno);

  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) fail_errno("cannot stat", path, errno);
  HS_CHECK(S_ISREG(st.st_mode), "sglang_hs.map_file: %s is not a regular file", path.c_str());
  const uid_t owner = owner_uid < 0 ? ::geteuid() : static_cast<uid_t>(owner_uid);
  HS_CHECK(st.st_uid == owner, "sglang_hs.map_file: %s is owned by uid %lld, not by uid %lld%s", path.c_str(),
           (long long)st.st_uid, (long long)owner, owner_uid < 0 ? " (this user)" : " (the owner the reader trusts)");
  if (create) {
    if (::fchmod(fd.fd, 0600) != 0) fail_errno("cannot chmod", path, errno);  // despite the umask
    int err = ::posix_fallocate(fd.fd, 0, nbytes);
    if (err != 0) {
      ::unlinkat(dfd.fd, name.c_str(), 0);
      fail_errno("cannot reserve " + std::to_string(nbytes) + " bytes for", path, err);
    }
  } else {
    HS_CHECK(nbytes == 0 || st.st_size == nbytes, "sglang_hs.map_file: %s has %lld bytes, expected %lld", path.c_str(),
             (long long)st.st_size, (long long)nbytes);
    nbytes = st.st_size;
    HS_CHECK(nbytes > 0, "sglang_hs.map_file: %s is empty", path.c_str());
  }
  // MAP_POPULATE: fault every page in now, not one 4 KiB page at a time inside a forward step's copy or
  // a record's publish (on tmpfs that first touch otherwise caps the store and ring at ~1 GB/s).
  void* p = ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.fd, 0);
  if (p == MAP_FAILED) fail_errno("cannot mmap", path, errno);
  const size_t len = static_cast<size_t>(nbytes);
  return at::from_blob(p, {nbytes}, [len](void* q) { ::munmap(q, len); },
                       at::TensorOptions().dtype(at::kByte));
}

int64_t load_acquire(const at::Tensor& buf, int64_t offset) {
  return static_cast<int64_t>(__atomic_load_n(word(buf, offset), __ATOMIC_ACQUIRE));
}

void store_release(const at::Tensor& buf, int64_t offset, int64_t value) {
  __atomic_store_n(word(buf, offset), static_cast<uint64_t>(value), __ATOMIC_RELEASE);
}

int64_t fetch_add(const at::Tensor& buf, int64_t offset, int64_t delta) {
  return static_cast<int64_t>(
      __atomic_fetch_add(word(buf, offset), static_cast<uint64_t>(delta), __ATOMIC_ACQ_REL));
}

}  // namespace sglang_hs
