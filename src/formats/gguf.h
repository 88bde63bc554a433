// GGUF, llama.cpp's single-file model format (versions 2 and 3; both little-endian):
//   "GGUF" u32 version, u64 tensor count, u64 metadata count,
//   metadata: key (u64 length + bytes), u32 value type, value (arrays: u32 element type, u64 count, elements),
//   tensor infos: name, u32 n_dims, u64 ne[n_dims] (ne[0] innermost), u32 ggml type, u64 offset,
//   zero padding to general.alignment (default 32), tensor data (offsets relative to its start).
// The reader validates every count, length, dimension and offset against the file size before
// using it, so a damaged or hostile file gives an mb::Error naming the file, never a crash.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/mmap.h"
#include "formats/tensor_registry.h"

namespace mb {

enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7, STRING = 8, ARRAY = 9,
  U64 = 10, I64 = 11, F64 = 12,
};
std::string_view gguf_type_name(GgufType t);

// One metadata value. Scalars keep their exact bits; arrays keep numeric elements as stored, so a
// read-then-write round trip is lossless. Accessors throw mb::Error on a type mismatch.
struct GgufValue {
  GgufType type = GgufType::U8;
  GgufType elem = GgufType::U8;     // arrays: element type
  uint64_t bits = 0;                // scalar numbers and bools, zero-extended little-endian bits
  std::string str;                  // STRING
  std::vector<uint8_t> raw;         // arrays of numbers or bools: the elements' bytes
  // Arrays of strings: the elements back to back, element i ending at str_ends[i] (one block
  // instead of a std::string each: a 262144-token vocabulary takes ~4 MB, not ~10).
  std::string str_bytes;
  std::vector<uint64_t> str_ends;
  std::vector<GgufValue> items;     // arrays of arrays

  static GgufValue make_int(GgufType t, int64_t v);   // any integer type (truncated to its width)
  static GgufValue make_uint(GgufType t, uint64_t v);
  static GgufValue make_float(GgufType t, double v);  // F32 or F64
  static GgufValue make_bool(bool v);
  static GgufValue make_string(std::string v);
  static GgufValue make_int_array(GgufType elem, const std::vector<int64_t>& v);
  static GgufValue make_float_array(GgufType elem, const std::vector<double>& v);
  static GgufValue make_bool_array(const std::vector<bool>& v);
  static GgufValue make_string_array(std::vector<std::string> v);
  static GgufValue make_array_of_arrays(std::vector<GgufValue> v);

  bool is_int() const;  // an integer scalar (not BOOL)
  bool is_array() const { return type == GgufType::ARRAY; }
  int64_t as_int() const;  // integer scalars; U64 above INT64_MAX throws
  double as_float() const;  // F32, F64 and integer scalars
  bool as_bool() const;
  const std::string& as_string() const;

  size_t size() const;  // array length
  int64_t int_at(size_t i) const;
  double float_at(size_t i) const;
  bool bool_at(size_t i) const;
  std::vector<int64_t> ints() const;
  std::vector<double> floats() const;
  std::string_view string_at(size_t i) const;
  std::vector<std::string> strings() const;  // a copy of every element

  std::string describe() const;  // type and a short rendering of the value, for messages and dumps

  bool operator==(const GgufValue&) const = default;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> ne;  // GGUF order: ne[0] is the innermost (contiguous) dimension
  uint32_t ggml_type = 0;
  DType dtype = DType::F32;
  uint64_t offset = 0;  // from the start of the data section
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;

  std::vector<int64_t> shape() const;  // PyTorch order: ne reversed
};

// ggml type id <-> DType; the name covers ggml types MarkBase cannot use (for error messages).
std::string ggml_type_name(uint32_t ggml_type);
bool ggml_type_to_dtype(uint32_t ggml_type, DType& out);
uint32_t dtype_to_ggml_type(DType t);  // throws for dtypes GGUF cannot store (U8, BOOL)

// Whether the file at `path` starts with the GGUF magic: files are told apart by content, not by
// their name's ending. False for a folder or a file that cannot be read.
bool is_gguf_file(const std::string& path);

class GgufFile {
 public:
  static std::shared_ptr<GgufFile> open(const std::string& path);
  // Parses bytes the caller keeps alive; `name` stands for the file in errors.
  static std::shared_ptr<GgufFile> parse(const uint8_t* data, size_t size, const std::string& name);

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // file offset of the tensor data section

  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }  // file order
  const GgufValue* find(const std::string& key) const;
  const GgufValue& get(const std::string& key) const;  // throws naming the file and the key

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }  // file order
  const GgufTensorInfo* find_tensor(const std::string& name) const;

  // Registers each tensor as name_map(name) (skipped when that is empty; identity when no map),
  // shape in PyTorch order, and keeps the mapping alive through the registry.
  void register_tensors(TensorRegistry& reg,
                        const std::function<std::string(const std::string&)>& name_map = nullptr) const;

 private:
  GgufFile() = default;
  void parse_all(const uint8_t* data, size_t size);

  std::string path_;
  std::shared_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

// Builds a GGUF v3 file the way gguf-py's GGUFWriter and llama.cpp do: metadata in insertion
// order, tensor data in insertion order, each padded to the alignment (general.alignment when
// set, else 32). Given the same keys and tensors it reproduces gguf-py's bytes exactly.
class GgufWriter {
 public:
  void set(const std::string& key, GgufValue v);  // replaces an existing key in place
  // `shape` in PyTorch order; `data` holds Tensor-layout bytes and is copied.
  void add_tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape, const void* data);
  // The same without the copy: `data` must stay valid and unchanged until write()/bytes() return.
  void add_tensor_view(const std::string& name, DType dtype, const std::vector<int64_t>& shape, const void* data);
  // Streams the header, then each tensor's bytes straight from where they are held.
  void write(const std::string& path) const;
  std::string bytes() const;

 private:
  struct PendingTensor {
    std::string name;
    std::vector<uint64_t> ne;
    DType dtype;
    std::vector<uint8_t> owned;
    const uint8_t* data = nullptr;  // owned.data() or the caller's bytes
    size_t nbytes = 0;
  };
  size_t check_tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape) const;
  uint64_t alignment() const;
  std::string header() const;  // everything before the tensor data, padded to the alignment
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::vector<PendingTensor> tensors_;
};

}  // namespace mb
