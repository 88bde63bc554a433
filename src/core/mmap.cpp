#include "core/mmap.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "core/error.h"

namespace mb {

namespace {
std::mutex g_maps_mu;
std::vector<std::pair<uintptr_t, uintptr_t>> g_maps;  // live mappings [begin, end)
}  // namespace

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open {}: {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("cannot read {}: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{} is not a regular file{}", path, S_ISDIR(st.st_mode) ? " (it is a directory)" : "");
  }
  std::shared_ptr<MappedFile> f(new MappedFile());
  f->path_ = path;
  f->size_ = size_t(st.st_size);
  if (f->size_ > 0) {
    void* p = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      fail("cannot map {}: {}", path, std::strerror(err));
    }
    f->data_ = static_cast<const uint8_t*>(p);
    std::lock_guard<std::mutex> lock(g_maps_mu);
    g_maps.push_back({uintptr_t(p), uintptr_t(p) + f->size_});
  }
  ::close(fd);
  return f;
}

MappedFile::~MappedFile() {
  if (!data_) return;
  {
    std::lock_guard<std::mutex> lock(g_maps_mu);
    for (size_t i = 0; i < g_maps.size(); ++i)
      if (g_maps[i].first == uintptr_t(data_)) {
        g_maps.erase(g_maps.begin() + long(i));
        break;
      }
  }
  munmap(const_cast<uint8_t*>(data_), size_);
}

namespace {
// madvise over the whole pages of [p, p + n) when the range lies in a live mapping.
void advise_mapped(const void* p, size_t n, int advice) {
  const uintptr_t b = uintptr_t(p), e = b + n;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  std::lock_guard<std::mutex> lock(g_maps_mu);
  for (const auto& m : g_maps)
    if (b >= m.first && e <= m.second) {
      const uintptr_t lo = (b + page - 1) / page * page, hi = e / page * page;
      if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, advice);
      return;
    }
}
}  // namespace

void release_mapped_pages(const void* p, size_t n) { advise_mapped(p, n, MADV_DONTNEED); }

std::shared_ptr<uint8_t> alloc_streamed(size_t bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  if (bytes < kHuge) {
    const size_t padded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
    void* p = std::aligned_alloc(64, padded);
    MB_CHECK(p != nullptr, "out of memory allocating {} bytes", bytes);
    std::memset(p, 0, padded);
    return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [](uint8_t* q) { std::free(q); });
  }
  // An anonymous mapping, 2 MB aligned by mapping 2 MB more and unmapping the slack: its pages
  // arrive zeroed from the kernel on first touch, so callers need not clear them again.
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t len = (bytes + page - 1) / page * page;
  void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  MB_CHECK(raw != MAP_FAILED, "out of memory mapping {} bytes: {}", bytes, std::strerror(errno));
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw), aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) munmap(raw, aligned - start);
  if (const size_t tail = start + len + kHuge - (aligned + len); tail > 0) munmap(reinterpret_cast<void*>(aligned + len), tail);
  uint8_t* p = reinterpret_cast<uint8_t*>(aligned);
  advise_huge_pages(p, bytes / kHuge * kHuge);
  return std::shared_ptr<uint8_t>(p, [len](uint8_t* q) { munmap(q, len); });
}

void advise_huge_pages(void* p, size_t n) {
#if defined(MADV_HUGEPAGE)
  static const bool use_huge = [] {
    const char* env = std::getenv("MARKBASE_HUGEPAGES");
    return !(env && std::string(env) == "0");
  }();
  if (use_huge && n > 0) madvise(p, n, MADV_HUGEPAGE);  // advice: failure is harmless
#endif
}
void advise_random_access(const void* p, size_t n) { advise_mapped(p, n, MADV_RANDOM); }

}  // namespace mb
