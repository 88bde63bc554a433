// Read-only memory map of a model file: weights are used in place, never copied unless a
// backend needs another layout, and pages the run never touches are never read.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace mb {

class MappedFile {
 public:
  static std::shared_ptr<MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Drops the resident pages of [p, p + n) when that range lies inside a live MappedFile (whole pages
// only; the next read pages them in again from the file); does nothing for other memory. For
// weights read once to build another layout.
void release_mapped_pages(const void* p, size_t n);
// Marks [p, p + n) of a live MappedFile as read at random (row lookups): no read-ahead around
// each fault, so a lookup table's resident share is the rows read. Does nothing for other memory.
void advise_random_access(const void* p, size_t n);

// Memory read front to back over and over (packed weights that decode streams every token, the
// bandwidth probe): 64-byte aligned, and from 2 MB up, 2 MB aligned with its whole 2 MB pages
// marked for transparent huge pages where the kernel offers them (Linux's "madvise" mode). With
// 4 KB pages the hardware prefetcher stops at every page boundary and each page costs a TLB walk:
// E2B q4_0 decode went from ~80% to ~95% of the read bandwidth. The tail past the last whole 2 MB
// keeps small pages, so nothing beyond the bytes asked for becomes resident.
// MARKBASE_HUGEPAGES=0 turns the advice off. Zeroed (large ones by the kernel, page by page on
// first touch); freed by the returned pointer.
std::shared_ptr<uint8_t> alloc_streamed(size_t bytes);
// Marks [p, p + n) (whole 2 MB pages, 2 MB aligned) for transparent huge pages, unless
// MARKBASE_HUGEPAGES=0; alloc_streamed and the scratch pool's large blocks.
void advise_huge_pages(void* p, size_t n);

}  // namespace mb
