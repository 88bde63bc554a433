// Reading a media file whole, with the errors a user should see (no such file, too large).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mb {

// A media file's bytes: a clear error for a missing, unreadable or oversized (> 1 GiB) file.
std::vector<uint8_t> read_media_file(const std::string& path);

}  // namespace mb
