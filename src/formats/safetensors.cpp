#include "formats/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstring>

#include "core/error.h"

namespace mb {

static DType parse_dtype(const std::string& s, const std::string& path, const std::string& name) {
  if (s == "F32") return DType::F32;
  if (s == "F16") return DType::F16;
  if (s == "BF16") return DType::BF16;
  if (s == "I32") return DType::I32;
  if (s == "I64") return DType::I64;
  if (s == "U8") return DType::U8;
  if (s == "BOOL") return DType::BOOL;
  fail("{}: tensor '{}' has unsupported dtype '{}' (supported: F32, F16, BF16, I32, I64, U8, BOOL)",
       path, name, s);
}

void load_safetensors(const std::string& path, TensorRegistry& reg,
                      const std::function<bool(const std::string&)>& keep) {
  auto file = MappedFile::open(path);
  const size_t size = file->size();
  MB_CHECK(size >= 8, "{}: truncated safetensors file ({} bytes, need at least 8 for the header size)",
           path, size);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t(file->data()[i]) << (8 * i);
  MB_CHECK(header_len <= size - 8,
           "{}: corrupt safetensors header: header length {} exceeds file size {}", path, header_len,
           size);
  const char* hdr = reinterpret_cast<const char*>(file->data() + 8);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(hdr, hdr + header_len);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: corrupt safetensors header (not valid JSON): {}", path, e.what());
  }
  MB_CHECK(j.is_object(), "{}: corrupt safetensors header: expected a JSON object", path);
  const uint8_t* base = file->data() + 8 + header_len;
  const size_t data_size = size - 8 - header_len;

  for (auto& [name, info] : j.items()) {
    if (name == "__metadata__") continue;
    if (keep && !keep(name)) continue;
    MB_CHECK(info.is_object() && info.contains("dtype") && info.contains("shape") &&
                 info.contains("data_offsets") && info["dtype"].is_string() &&
                 info["shape"].is_array() && info["data_offsets"].is_array() &&
                 info["data_offsets"].size() == 2,
             "{}: corrupt safetensors header entry for tensor '{}'", path, name);
    TensorEntry e;
    e.name = name;
    e.file = path;
    e.dtype = parse_dtype(info["dtype"].get<std::string>(), path, name);
    uint64_t numel = 1;
    for (auto& d : info["shape"]) {
      MB_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
               "{}: tensor '{}' has an invalid dimension {}", path, name, d.dump());
      uint64_t v = d.get<uint64_t>();
      MB_CHECK(v == 0 || numel <= (uint64_t(1) << 62) / v, "{}: tensor '{}' shape overflows", path,
               name);
      numel *= v;
      e.shape.push_back(int64_t(v));
    }
    auto& off = info["data_offsets"];
    MB_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(),
             "{}: tensor '{}' has invalid data_offsets", path, name);
    uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    MB_CHECK(begin <= end && end <= data_size,
             "{}: tensor '{}' data offsets [{}, {}) lie outside the file's data section ({} bytes); "
             "the file is truncated or corrupt",
             path, name, begin, end, data_size);
    MB_CHECK(end - begin == numel * dtype_size(e.dtype),
             "{}: tensor '{}' holds {} bytes but dtype {} and shape need {}", path, name,
             end - begin, dtype_name(e.dtype), numel * dtype_size(e.dtype));
    e.data = base + begin;
    e.nbytes = end - begin;
    if (reinterpret_cast<uintptr_t>(e.data) % dtype_size(e.dtype) != 0) {
      // The format does not promise aligned data; kernels read whole elements, so copy the rare
      // misaligned tensor once instead of making every load unaligned-safe.
      Tensor copy = host_tensor(e.dtype, e.shape);
      std::memcpy(copy.data, e.data, e.nbytes);
      e.data = static_cast<const uint8_t*>(copy.data);
      e.owner = copy.owner;
    }
    reg.add(std::move(e));
  }
  reg.add_file(std::move(file));
}

}  // namespace mb
