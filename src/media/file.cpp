#include "media/file.h"

#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace mb {

std::vector<uint8_t> read_media_file(const std::string& path) {
  std::error_code ec;
  MB_CHECK(std::filesystem::is_regular_file(path, ec), "{}: no such file", path);
  const auto size = std::filesystem::file_size(path, ec);
  MB_CHECK(!ec, "{}: cannot read the file size: {}", path, ec.message());
  MB_CHECK(size <= (uintmax_t(1) << 30), "{}: {} bytes is too large for a media file (1 GiB at most)", path, size);
  std::ifstream in(path, std::ios::binary);
  MB_CHECK(in.good(), "{}: cannot open the file", path);
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.read(reinterpret_cast<char*>(bytes.data()), std::streamsize(bytes.size()));
  MB_CHECK(in.gcount() == std::streamsize(bytes.size()), "{}: could not read the whole file", path);
  return bytes;
}

}  // namespace mb
