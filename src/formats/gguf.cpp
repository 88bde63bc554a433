#include "formats/gguf.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>

#include "core/error.h"
#include "core/printable.h"
#include "core/tensor.h"

namespace mb {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxArrayDepth = 4;  // deeper nesting is never written and would only recurse
constexpr size_t kMaxDims = 4;     // GGML_MAX_DIMS

size_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::BOOL: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    case GgufType::U64: case GgufType::I64: case GgufType::F64: return 8;
    default: return 0;
  }
}

bool known_type(uint32_t t) { return t <= uint32_t(GgufType::F64); }

// Smallest encoding of one array element: a bound for validating counts before allocating.
size_t min_encoded_size(GgufType t) {
  if (t == GgufType::STRING) return 8;
  if (t == GgufType::ARRAY) return 12;
  return scalar_size(t);
}

bool is_signed(GgufType t) { return t == GgufType::I8 || t == GgufType::I16 || t == GgufType::I32 || t == GgufType::I64; }
bool is_integer(GgufType t) { return is_signed(t) || t == GgufType::U8 || t == GgufType::U16 || t == GgufType::U32 || t == GgufType::U64; }

int64_t sign_extend(uint64_t bits, size_t bytes) {
  if (bytes == 8) return int64_t(bits);
  const unsigned shift = unsigned(64 - 8 * bytes);
  return int64_t(bits << shift) >> shift;
}

uint64_t load_bits(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  std::memcpy(&v, p, n);  // little-endian host
  return v;
}

double float_from_bits(GgufType t, uint64_t bits) {
  if (t == GgufType::F32) {
    float f;
    uint32_t b = uint32_t(bits);
    std::memcpy(&f, &b, 4);
    return f;
  }
  double d;
  std::memcpy(&d, &bits, 8);
  return d;
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }  // callers keep x + a in range

// Bounds-checked little-endian reads over the file bytes.
class Cursor {
 public:
  Cursor(const uint8_t* p, size_t size, const std::string& name) : p_(p), size_(size), name_(name) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  void need(uint64_t n, std::string_view what) const {
    if (n > remaining())
      fail("{}: truncated or corrupt GGUF file: {} at offset {} needs {} bytes, but only {} remain", name_, what,
           pos_, n, remaining());
  }
  template <class T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  const uint8_t* take(uint64_t n, std::string_view what) {
    need(n, what);
    const uint8_t* q = p_ + pos_;
    pos_ += size_t(n);
    return q;
  }
  std::string read_string(std::string_view what) {
    const uint64_t len = read<uint64_t>(what);
    const uint8_t* q = take(len, what);
    return std::string(reinterpret_cast<const char*>(q), size_t(len));
  }

 private:
  const uint8_t* p_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& name_;
};

GgufType read_type(Cursor& c, const std::string& file, const std::string& key, std::string_view what) {
  const uint32_t t = c.read<uint32_t>(what);
  MB_CHECK(known_type(t), "{}: metadata key '{}' has unknown {} {} (known: 0..12)", file, printable(key), what, t);
  return GgufType(t);
}

GgufValue read_value(Cursor& c, GgufType type, const std::string& file, const std::string& key, int depth) {
  GgufValue v;
  v.type = type;
  if (type == GgufType::STRING) {
    v.str = c.read_string("a string value");
    return v;
  }
  if (type != GgufType::ARRAY) {
    const size_t n = scalar_size(type);
    v.bits = load_bits(c.take(n, "a scalar value"), n);
    return v;
  }
  MB_CHECK(depth < kMaxArrayDepth, "{}: metadata key '{}' nests arrays more than {} deep", file, printable(key),
           kMaxArrayDepth);
  v.elem = read_type(c, file, key, "array element type");
  const uint64_t count = c.read<uint64_t>("an array length");
  const size_t min = min_encoded_size(v.elem);
  MB_CHECK(count <= c.remaining() / min,
           "{}: metadata key '{}' claims {} array elements of type {}, more than the {} bytes left in the file hold",
           file, printable(key), count, gguf_type_name(v.elem), c.remaining());
  if (v.elem == GgufType::STRING) {
    v.str_ends.reserve(size_t(count));
    for (uint64_t i = 0; i < count; ++i) {
      v.str_bytes += c.read_string("an array string");
      v.str_ends.push_back(v.str_bytes.size());
    }
  } else if (v.elem == GgufType::ARRAY) {
    v.items.reserve(size_t(count));
    for (uint64_t i = 0; i < count; ++i) v.items.push_back(read_value(c, GgufType::ARRAY, file, key, depth + 1));
  } else {
    const uint8_t* q = c.take(count * min, "array elements");
    v.raw.assign(q, q + count * min);
  }
  return v;
}

void append(std::string& out, const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }
template <class T>
void append_pod(std::string& out, T v) {
  append(out, &v, sizeof v);
}
void append_string(std::string& out, std::string_view s) {
  append_pod<uint64_t>(out, s.size());
  out += s;
}

void write_value(std::string& out, const GgufValue& v) {
  switch (v.type) {
    case GgufType::STRING: append_string(out, v.str); return;
    case GgufType::ARRAY:
      append_pod<uint32_t>(out, uint32_t(v.elem));
      append_pod<uint64_t>(out, v.size());
      if (v.elem == GgufType::STRING)
        for (size_t i = 0; i < v.str_ends.size(); ++i) append_string(out, v.string_at(i));
      else if (v.elem == GgufType::ARRAY)
        for (auto& item : v.items) write_value(out, item);
      else
        append(out, v.raw.data(), v.raw.size());
      return;
    default: append(out, &v.bits, scalar_size(v.type)); return;
  }
}

struct GgmlTypeInfo {
  uint32_t id;
  const char* name;
  bool has_dtype;
  DType dtype;
};

// ggml_type ids (ggml.h); ids 4, 5 and 31-33 were removed upstream.
constexpr GgmlTypeInfo kGgmlTypes[] = {
    {0, "F32", true, DType::F32},       {1, "F16", true, DType::F16},       {2, "Q4_0", true, DType::Q4_0},
    {3, "Q4_1", true, DType::Q4_1},     {6, "Q5_0", true, DType::Q5_0},     {7, "Q5_1", true, DType::Q5_1},
    {8, "Q8_0", true, DType::Q8_0},     {9, "Q8_1", false, {}},             {10, "Q2_K", false, {}},
    {11, "Q3_K", false, {}},            {12, "Q4_K", true, DType::Q4_K},    {13, "Q5_K", true, DType::Q5_K},
    {14, "Q6_K", true, DType::Q6_K},    {15, "Q8_K", false, {}},            {16, "IQ2_XXS", false, {}},
    {17, "IQ2_XS", false, {}},          {18, "IQ3_XXS", false, {}},         {19, "IQ1_S", false, {}},
    {20, "IQ4_NL", false, {}},          {21, "IQ3_S", false, {}},           {22, "IQ2_S", false, {}},
    {23, "IQ4_XS", false, {}},          {24, "I8", false, {}},              {25, "I16", false, {}},
    {26, "I32", true, DType::I32},      {27, "I64", true, DType::I64},      {28, "F64", false, {}},
    {29, "IQ1_M", false, {}},           {30, "BF16", true, DType::BF16},    {34, "TQ1_0", false, {}},
    {35, "TQ2_0", false, {}},           {39, "MXFP4", false, {}},           {40, "NVFP4", false, {}},
    {41, "Q1_0", false, {}},
};

std::string supported_ggml_types() {
  std::string s;
  for (auto& t : kGgmlTypes)
    if (t.has_dtype) s += (s.empty() ? "" : ", ") + std::string(t.name);
  return s;
}

}  // namespace

std::string_view gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::U8: return "UINT8";
    case GgufType::I8: return "INT8";
    case GgufType::U16: return "UINT16";
    case GgufType::I16: return "INT16";
    case GgufType::U32: return "UINT32";
    case GgufType::I32: return "INT32";
    case GgufType::F32: return "FLOAT32";
    case GgufType::BOOL: return "BOOL";
    case GgufType::STRING: return "STRING";
    case GgufType::ARRAY: return "ARRAY";
    case GgufType::U64: return "UINT64";
    case GgufType::I64: return "INT64";
    case GgufType::F64: return "FLOAT64";
  }
  return "?";
}

std::string ggml_type_name(uint32_t id) {
  for (auto& t : kGgmlTypes)
    if (t.id == id) return t.name;
  return "unknown type " + std::to_string(id);
}

bool ggml_type_to_dtype(uint32_t id, DType& out) {
  for (auto& t : kGgmlTypes)
    if (t.id == id && t.has_dtype) {
      out = t.dtype;
      return true;
    }
  return false;
}

uint32_t dtype_to_ggml_type(DType d) {
  for (auto& t : kGgmlTypes)
    if (t.has_dtype && t.dtype == d) return t.id;
  fail("GGUF cannot store {} tensors", dtype_name(d));
}

// ---- GgufValue ------------------------------------------------------------------------------------

GgufValue GgufValue::make_int(GgufType t, int64_t v) { return make_uint(t, uint64_t(v)); }

GgufValue GgufValue::make_uint(GgufType t, uint64_t v) {
  MB_CHECK(is_integer(t), "GgufValue::make_int: {} is not an integer type", gguf_type_name(t));
  GgufValue g;
  g.type = t;
  const size_t n = scalar_size(t);
  g.bits = n == 8 ? v : v & ((uint64_t(1) << (8 * n)) - 1);
  return g;
}

GgufValue GgufValue::make_float(GgufType t, double v) {
  MB_CHECK(t == GgufType::F32 || t == GgufType::F64, "GgufValue::make_float: {} is not a float type",
           gguf_type_name(t));
  GgufValue g;
  g.type = t;
  if (t == GgufType::F32) {
    const float f = float(v);
    uint32_t b;
    std::memcpy(&b, &f, 4);
    g.bits = b;
  } else {
    std::memcpy(&g.bits, &v, 8);
  }
  return g;
}

GgufValue GgufValue::make_bool(bool v) {
  GgufValue g;
  g.type = GgufType::BOOL;
  g.bits = v ? 1 : 0;
  return g;
}

GgufValue GgufValue::make_string(std::string v) {
  GgufValue g;
  g.type = GgufType::STRING;
  g.str = std::move(v);
  return g;
}

namespace {
// An array of `elem` scalars, each encoded by make(elem, value) and appended as its raw bits.
template <class T, class Make>
GgufValue scalar_array(GgufType elem, const std::vector<T>& v, Make make) {
  GgufValue g;
  g.type = GgufType::ARRAY;
  g.elem = elem;
  for (const T& x : v) {
    const GgufValue s = make(elem, x);
    g.raw.insert(g.raw.end(), reinterpret_cast<const uint8_t*>(&s.bits),
                 reinterpret_cast<const uint8_t*>(&s.bits) + scalar_size(elem));
  }
  return g;
}
}  // namespace

GgufValue GgufValue::make_int_array(GgufType elem, const std::vector<int64_t>& v) {
  return scalar_array(elem, v, GgufValue::make_int);
}

GgufValue GgufValue::make_float_array(GgufType elem, const std::vector<double>& v) {
  return scalar_array(elem, v, GgufValue::make_float);
}

GgufValue GgufValue::make_bool_array(const std::vector<bool>& v) {
  GgufValue g;
  g.type = GgufType::ARRAY;
  g.elem = GgufType::BOOL;
  for (bool b : v) g.raw.push_back(b ? 1 : 0);
  return g;
}

GgufValue GgufValue::make_string_array(std::vector<std::string> v) {
  GgufValue g;
  g.type = GgufType::ARRAY;
  g.elem = GgufType::STRING;
  for (const std::string& e : v) {
    g.str_bytes += e;
    g.str_ends.push_back(g.str_bytes.size());
  }
  return g;
}

GgufValue GgufValue::make_array_of_arrays(std::vector<GgufValue> v) {
  for (auto& item : v) MB_CHECK(item.is_array(), "GgufValue::make_array_of_arrays: an item is not an array");
  GgufValue g;
  g.type = GgufType::ARRAY;
  g.elem = GgufType::ARRAY;
  g.items = std::move(v);
  return g;
}

bool GgufValue::is_int() const { return is_integer(type); }

int64_t GgufValue::as_int() const {
  MB_CHECK(is_integer(type), "expected an integer, found {}", describe());
  if (is_signed(type)) return sign_extend(bits, scalar_size(type));
  MB_CHECK(bits <= uint64_t(std::numeric_limits<int64_t>::max()), "integer {} is too large", bits);
  return int64_t(bits);
}

double GgufValue::as_float() const {
  if (type == GgufType::F32 || type == GgufType::F64) return float_from_bits(type, bits);
  if (is_integer(type)) return is_signed(type) ? double(sign_extend(bits, scalar_size(type))) : double(bits);
  fail("expected a number, found {}", describe());
}

bool GgufValue::as_bool() const {
  MB_CHECK(type == GgufType::BOOL, "expected a BOOL, found {}", describe());
  return bits != 0;
}

const std::string& GgufValue::as_string() const {
  MB_CHECK(type == GgufType::STRING, "expected a STRING, found {}", describe());
  return str;
}

size_t GgufValue::size() const {
  MB_CHECK(type == GgufType::ARRAY, "expected an ARRAY, found {}", describe());
  if (elem == GgufType::STRING) return str_ends.size();
  if (elem == GgufType::ARRAY) return items.size();
  return raw.size() / scalar_size(elem);
}

int64_t GgufValue::int_at(size_t i) const {
  MB_CHECK(i < size() && is_integer(elem), "expected an integer array element {}, found {}", i, describe());
  const size_t n = scalar_size(elem);
  const uint64_t b = load_bits(raw.data() + i * n, n);
  if (is_signed(elem)) return sign_extend(b, n);
  MB_CHECK(b <= uint64_t(std::numeric_limits<int64_t>::max()), "array element {} = {} is too large", i, b);
  return int64_t(b);
}

double GgufValue::float_at(size_t i) const {
  MB_CHECK(i < size(), "array index {} out of range for {}", i, describe());
  if (elem == GgufType::F32 || elem == GgufType::F64) {
    const size_t n = scalar_size(elem);
    return float_from_bits(elem, load_bits(raw.data() + i * n, n));
  }
  return double(int_at(i));
}

bool GgufValue::bool_at(size_t i) const {
  MB_CHECK(elem == GgufType::BOOL && i < size(), "expected a BOOL array element {}, found {}", i, describe());
  return raw[i] != 0;
}

std::vector<int64_t> GgufValue::ints() const {
  std::vector<int64_t> out(size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = int_at(i);
  return out;
}

std::vector<double> GgufValue::floats() const {
  std::vector<double> out(size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = float_at(i);
  return out;
}

std::string_view GgufValue::string_at(size_t i) const {
  MB_CHECK(type == GgufType::ARRAY && elem == GgufType::STRING && i < str_ends.size(),
           "expected an array of strings with an element {}, found {}", i, describe());
  const uint64_t begin = i == 0 ? 0 : str_ends[i - 1];
  return std::string_view(str_bytes).substr(size_t(begin), size_t(str_ends[i] - begin));
}

std::vector<std::string> GgufValue::strings() const {
  MB_CHECK(type == GgufType::ARRAY && elem == GgufType::STRING, "expected an array of strings, found {}", describe());
  std::vector<std::string> out;
  out.reserve(str_ends.size());
  for (size_t i = 0; i < str_ends.size(); ++i) out.emplace_back(string_at(i));
  return out;
}

std::string GgufValue::describe() const {
  auto quote = [](std::string_view s) { return "\"" + printable(s, 60) + "\""; };
  switch (type) {
    case GgufType::STRING: return "STRING " + quote(str);
    case GgufType::BOOL: return bits ? "BOOL true" : "BOOL false";
    case GgufType::F32: case GgufType::F64: return fmt::format("{} {}", gguf_type_name(type), as_float());
    case GgufType::ARRAY: {
      const size_t n = size();
      std::string s = fmt::format("ARRAY of {} {} [", n, gguf_type_name(elem));
      for (size_t i = 0; i < std::min<size_t>(n, 8); ++i) {
        if (i) s += ", ";
        if (elem == GgufType::STRING) s += quote(string_at(i));
        else if (elem == GgufType::ARRAY) s += items[i].describe();
        else if (elem == GgufType::BOOL) s += bool_at(i) ? "true" : "false";
        else if (elem == GgufType::F32 || elem == GgufType::F64) s += fmt::format("{}", float_at(i));
        else if (is_signed(elem)) s += std::to_string(int_at(i));
        else s += std::to_string(load_bits(raw.data() + i * scalar_size(elem), scalar_size(elem)));
      }
      return s + (n > 8 ? ", ...]" : "]");
    }
    default:
      return fmt::format("{} {}", gguf_type_name(type),
                         is_signed(type) ? std::to_string(sign_extend(bits, scalar_size(type))) : std::to_string(bits));
  }
}

std::vector<int64_t> GgufTensorInfo::shape() const {
  std::vector<int64_t> s(ne.rbegin(), ne.rend());
  return s;
}

// ---- GgufFile ---------------------------------------------------------------------------------

bool is_gguf_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

std::shared_ptr<GgufFile> GgufFile::open(const std::string& path) {
  auto file = MappedFile::open(path);
  std::shared_ptr<GgufFile> g(new GgufFile());
  g->path_ = path;
  g->file_ = file;
  g->parse_all(file->data(), file->size());
  // Everything before the tensor data is parsed into kv_ and tensors_ now: give its pages back
  // (a tokenizer's metadata is several MB).
  release_mapped_pages(file->data(), size_t(std::min<uint64_t>(g->data_offset_, file->size())));
  return g;
}

std::shared_ptr<GgufFile> GgufFile::parse(const uint8_t* data, size_t size, const std::string& name) {
  std::shared_ptr<GgufFile> g(new GgufFile());
  g->path_ = name;
  g->parse_all(data, size);
  return g;
}

void GgufFile::parse_all(const uint8_t* data, size_t size) {
  const std::string& f = path_;
  Cursor c(data, size, f);
  MB_CHECK(size >= 4, "{}: not a GGUF file ({} bytes, too short for the magic)", f, size);
  const uint32_t magic = c.read<uint32_t>("magic");
  if (magic != kMagic) {
    char m[5] = {};
    std::memcpy(m, data, 4);
    for (char& ch : m)
      if (ch && (ch < 32 || ch > 126)) ch = '?';
    fail("{}: not a GGUF file (magic '{}', expected 'GGUF')", f, m);
  }
  version_ = c.read<uint32_t>("version");
  if (version_ != 2 && version_ != 3) {
    const uint32_t swapped = __builtin_bswap32(version_);
    if (swapped == 2 || swapped == 3) fail("{}: big-endian GGUF files are not supported", f);
    if (version_ == 1) fail("{}: GGUF version 1 is not supported (a pre-release format); reconvert the model", f);
    fail("{}: unsupported GGUF version {} (supported: 2, 3)", f, version_);
  }
  const uint64_t n_tensors = c.read<uint64_t>("tensor count");
  const uint64_t n_kv = c.read<uint64_t>("metadata count");
  // Each metadata entry takes at least 13 bytes and each tensor info 24: reject impossible counts
  // before reserving anything.
  MB_CHECK(n_kv <= c.remaining() / 13, "{}: corrupt GGUF header: {} metadata entries cannot fit in {} bytes", f,
           n_kv, size);
  MB_CHECK(n_tensors <= c.remaining() / 24, "{}: corrupt GGUF header: {} tensors cannot fit in {} bytes", f,
           n_tensors, size);

  kv_.reserve(size_t(n_kv));
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = c.read_string("a metadata key");
    const GgufType t = read_type(c, f, key, "value type");
    GgufValue v = read_value(c, t, f, key, 0);
    MB_CHECK(kv_index_.emplace(key, kv_.size()).second, "{}: metadata key '{}' appears twice", f, printable(key));
    kv_.emplace_back(std::move(key), std::move(v));
  }

  if (const GgufValue* a = find("general.alignment")) {
    MB_CHECK(a->type == GgufType::U32, "{}: general.alignment must be a UINT32, found {}", f, a->describe());
    alignment_ = a->bits;
    MB_CHECK(alignment_ > 0 && (alignment_ & (alignment_ - 1)) == 0,
             "{}: general.alignment {} is not a power of two", f, alignment_);
  }

  tensors_.reserve(size_t(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo ti;
    ti.name = c.read_string("a tensor name");
    const uint32_t n_dims = c.read<uint32_t>("tensor dimension count");
    MB_CHECK(n_dims <= kMaxDims, "{}: tensor '{}' has {} dimensions (at most {})", f, printable(ti.name), n_dims,
             kMaxDims);
    uint64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t ne = c.read<uint64_t>("a tensor dimension");
      MB_CHECK(ne <= uint64_t(std::numeric_limits<int64_t>::max()) && (ne == 0 || numel <= (uint64_t(1) << 62) / ne),
               "{}: tensor '{}' has dimensions that overflow (dimension {} = {})", f, printable(ti.name), d, ne);
      numel *= ne;
      ti.ne.push_back(ne);
    }
    ti.ggml_type = c.read<uint32_t>("tensor type");
    if (!ggml_type_to_dtype(ti.ggml_type, ti.dtype))
      fail("{}: tensor '{}' has type {} ({}), which MarkBase does not support (supported: {})", f, printable(ti.name),
           ggml_type_name(ti.ggml_type), ti.ggml_type, supported_ggml_types());
    ti.offset = c.read<uint64_t>("tensor data offset");
    const uint64_t inner = ti.ne.empty() ? 1 : ti.ne[0];
    const int64_t bs = dtype_block_size(ti.dtype);
    MB_CHECK(inner % uint64_t(bs) == 0, "{}: tensor '{}' of type {} has rows of {} elements, not a multiple of its block size {}",
             f, printable(ti.name), dtype_name(ti.dtype), inner, bs);
    ti.nbytes = numel / uint64_t(bs) * dtype_block_bytes(ti.dtype);  // numel < 2^62, block bytes <= 210
    MB_CHECK(ti.offset % alignment_ == 0, "{}: tensor '{}' data offset {} is not a multiple of the alignment {}", f,
             printable(ti.name), ti.offset, alignment_);
    MB_CHECK(tensor_index_.emplace(ti.name, tensors_.size()).second, "{}: tensor '{}' appears twice", f,
             printable(ti.name));
    tensors_.push_back(std::move(ti));
  }

  // The data section starts at the next alignment boundary; a file without tensor data may end
  // before it.
  data_offset_ = std::min<uint64_t>(align_up(c.pos(), alignment_), size);  // pos + alignment < 2^33
  const uint64_t data_size = size - data_offset_;

  std::vector<const GgufTensorInfo*> by_offset;
  for (auto& ti : tensors_) {
    MB_CHECK(ti.offset <= data_size && ti.nbytes <= data_size - ti.offset,
             "{}: tensor '{}' data [{}, {}) lies outside the data section ({} bytes from offset {}); the file is "
             "truncated or corrupt",
             f, printable(ti.name), ti.offset, ti.offset + ti.nbytes, data_size, data_offset_);
    ti.data = data + data_offset_ + ti.offset;
    if (ti.nbytes) by_offset.push_back(&ti);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensorInfo& a = *by_offset[i - 1];
    const GgufTensorInfo& b = *by_offset[i];
    MB_CHECK(a.offset + a.nbytes <= b.offset, "{}: tensors '{}' [{}, {}) and '{}' [{}, {}) overlap", f,
             printable(a.name), a.offset, a.offset + a.nbytes, printable(b.name), b.offset, b.offset + b.nbytes);
  }
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const GgufValue& GgufFile::get(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) fail("{}: missing metadata key '{}'", path_, printable(key));
  return *v;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

void GgufFile::register_tensors(TensorRegistry& reg,
                                const std::function<std::string(const std::string&)>& name_map) const {
  for (const GgufTensorInfo& ti : tensors_) {
    std::string name = name_map ? name_map(ti.name) : ti.name;
    if (name.empty()) continue;
    TensorEntry e;
    e.name = std::move(name);
    e.dtype = ti.dtype;
    e.shape = ti.shape();
    e.data = ti.data;
    e.nbytes = size_t(ti.nbytes);
    e.file = path_;
    // Alignments below the element size (legal, if unusual) leave data misaligned for kernels.
    const size_t elem_align = dtype_is_quantized(ti.dtype) ? 2 : dtype_block_bytes(ti.dtype);
    if (reinterpret_cast<uintptr_t>(e.data) % elem_align != 0) {
      Tensor copy = host_tensor(e.dtype, e.shape);
      std::memcpy(copy.data, e.data, e.nbytes);
      e.data = static_cast<const uint8_t*>(copy.data);
      e.owner = copy.owner;
    }
    reg.add(std::move(e));
  }
  if (file_) reg.add_file(file_);
}

// ---- GgufWriter -------------------------------------------------------------------------------

void GgufWriter::set(const std::string& key, GgufValue v) {
  if (key == "general.alignment") {
    MB_CHECK(v.type == GgufType::U32 && v.bits > 0 && (v.bits & (v.bits - 1)) == 0,
             "general.alignment must be a UINT32 power of two, got {}", v.describe());
  }
  for (auto& [k, old] : kv_)
    if (k == key) {
      old = std::move(v);
      return;
    }
  kv_.emplace_back(key, std::move(v));
}

size_t GgufWriter::check_tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape) const {
  MB_CHECK(!name.empty() && name.size() < 64, "GGUF tensor name '{}' must have 1 to 63 bytes (llama.cpp's limit)",
           printable(name));
  for (auto& t : tensors_) MB_CHECK(t.name != name, "GGUF tensor '{}' added twice", printable(name));
  MB_CHECK(shape.size() <= kMaxDims, "GGUF tensor '{}' has {} dimensions (at most {})", printable(name), shape.size(),
           kMaxDims);
  dtype_to_ggml_type(dtype);
  Tensor t;
  t.dtype = dtype;
  t.shape = shape;
  for (int64_t d : shape) MB_CHECK(d >= 0, "GGUF tensor '{}' has a negative dimension", printable(name));
  MB_CHECK(t.cols() % dtype_block_size(dtype) == 0, "GGUF tensor '{}': rows of {} elements are not whole {} blocks",
           printable(name), t.cols(), dtype_name(dtype));
  return t.nbytes();
}

void GgufWriter::add_tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape, const void* data) {
  const size_t n = check_tensor(name, dtype, shape);
  PendingTensor p{name, {}, dtype, {}, nullptr, n};
  p.ne.assign(shape.rbegin(), shape.rend());
  const uint8_t* b = static_cast<const uint8_t*>(data);
  p.owned.assign(b, b + n);
  p.data = p.owned.data();
  tensors_.push_back(std::move(p));
}

void GgufWriter::add_tensor_view(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                                 const void* data) {
  const size_t n = check_tensor(name, dtype, shape);
  PendingTensor p{name, {}, dtype, {}, static_cast<const uint8_t*>(data), n};
  p.ne.assign(shape.rbegin(), shape.rend());
  tensors_.push_back(std::move(p));
}

uint64_t GgufWriter::alignment() const {
  uint64_t alignment = kDefaultAlignment;
  for (auto& [k, v] : kv_)
    if (k == "general.alignment") alignment = v.bits;
  return alignment;
}

std::string GgufWriter::header() const {
  const uint64_t alignment = this->alignment();
  std::string out;
  append_pod<uint32_t>(out, kMagic);
  append_pod<uint32_t>(out, 3);
  append_pod<uint64_t>(out, tensors_.size());
  append_pod<uint64_t>(out, kv_.size());
  for (auto& [k, v] : kv_) {
    append_string(out, k);
    append_pod<uint32_t>(out, uint32_t(v.type));
    write_value(out, v);
  }
  uint64_t offset = 0;
  for (auto& t : tensors_) {
    append_string(out, t.name);
    append_pod<uint32_t>(out, uint32_t(t.ne.size()));
    for (uint64_t ne : t.ne) append_pod<uint64_t>(out, ne);
    append_pod<uint32_t>(out, dtype_to_ggml_type(t.dtype));
    append_pod<uint64_t>(out, offset);
    offset += align_up(t.nbytes, alignment);
  }
  out.resize(size_t(align_up(out.size(), alignment)), '\0');
  return out;
}

std::string GgufWriter::bytes() const {
  const uint64_t alignment = this->alignment();
  std::string out = header();
  for (auto& t : tensors_) {
    append(out, t.data, t.nbytes);
    out.resize(size_t(align_up(out.size(), alignment)), '\0');
  }
  return out;
}

void GgufWriter::write(const std::string& path) const {
  const uint64_t alignment = this->alignment();
  // stdio, not iostreams: its failures set errno, so the message can say why (no space left ...).
  std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(path.c_str(), "wb"), std::fclose);
  if (!out) fail("cannot open {} for writing: {}", path, std::strerror(errno));
  auto put = [&](const void* p, size_t n) {
    if (n > 0 && std::fwrite(p, 1, n, out.get()) != n) fail("error writing {}: {}", path, std::strerror(errno));
  };
  const std::string h = header();
  put(h.data(), h.size());
  const std::string zeros(size_t(alignment), '\0');
  for (auto& t : tensors_) {
    put(t.data, t.nbytes);
    put(zeros.data(), size_t(align_up(t.nbytes, alignment) - t.nbytes));
  }
  if (std::fclose(out.release()) != 0) fail("error writing {}: {}", path, std::strerror(errno));
}

}  // namespace mb
