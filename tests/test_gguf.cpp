// GGUF reader and writer: identical reading of a file written by llama.cpp's gguf-py
// (tests/fixtures/gguf, tools/reference/make_quant_cases.py), byte-identical writing, round trips,
// and a clear mb::Error for every kind of damage.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>

#include "core/error.h"
#include "core/quant.h"
#include "formats/gguf.h"
#include "test_util.h"

using namespace mb;

namespace {

std::string read_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

const std::string& fixture_bytes() {
  static const std::string b = read_bytes(mbtest::fixture("gguf/all_types.gguf"));
  return b;
}

std::shared_ptr<GgufFile> parse_bytes(const std::string& b, const std::string& name = "mem.gguf") {
  return GgufFile::parse(reinterpret_cast<const uint8_t*>(b.data()), b.size(), name);
}

// Expects parsing `b` to fail with an mb::Error naming the file and containing `needle`.
void expect_rejected(const std::string& b, const std::string& needle) {
  try {
    parse_bytes(b, "bad.gguf");
    ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("bad.gguf"), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "missing '" << needle << "' in: " << msg;
  }
}

GgufType type_from_name(const std::string& s) {
  for (uint32_t t = 0; t <= 12; ++t)
    if (gguf_type_name(GgufType(t)) == s) return GgufType(t);
  throw std::runtime_error("unknown type " + s);
}

// Compares one value to gguf-py's rendering in all_types.json.
void expect_value(const GgufValue& v, GgufType type, const nlohmann::ordered_json& want) {
  ASSERT_EQ(v.type, type);
  switch (type) {
    case GgufType::STRING: EXPECT_EQ(v.as_string(), want.get<std::string>()); break;
    case GgufType::BOOL: EXPECT_EQ(v.as_bool(), want.get<bool>()); break;
    case GgufType::F32: case GgufType::F64: EXPECT_EQ(v.as_float(), want.get<double>()); break;
    case GgufType::U64: EXPECT_EQ(v.bits, want.get<uint64_t>()); break;
    default: EXPECT_EQ(v.as_int(), want.get<int64_t>()); break;
  }
}

void expect_array(const GgufValue& v, GgufType elem, const nlohmann::ordered_json& want) {
  ASSERT_TRUE(v.is_array());
  ASSERT_EQ(v.elem, elem);
  ASSERT_EQ(v.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("element " + std::to_string(i));
    switch (elem) {
      case GgufType::STRING: EXPECT_EQ(v.strings()[i], want[i].get<std::string>()); break;
      case GgufType::BOOL: EXPECT_EQ(v.bool_at(i), want[i].get<bool>()); break;
      case GgufType::F32: case GgufType::F64: EXPECT_EQ(v.float_at(i), want[i].get<double>()); break;
      case GgufType::U64: {
        uint64_t b;
        std::memcpy(&b, v.raw.data() + 8 * i, 8);
        EXPECT_EQ(b, want[i].get<uint64_t>());
        break;
      }
      case GgufType::ARRAY:
        expect_array(v.items[i], type_from_name(want[i]["element"]), want[i]["value"]);
        break;
      default: EXPECT_EQ(v.int_at(i), want[i].get<int64_t>()); break;
    }
  }
}

std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) (s += d[p[i] >> 4]) += d[p[i] & 15];
  return s;
}

// Little-endian byte builder for hand-made (and hand-damaged) files.
struct Raw {
  std::string b;
  Raw& u32(uint32_t v) { return put(&v, 4); }
  Raw& u64(uint64_t v) { return put(&v, 8); }
  Raw& str(const std::string& s) {
    u64(s.size());
    b += s;
    return *this;
  }
  Raw& put(const void* p, size_t n) {
    b.append(static_cast<const char*>(p), n);
    return *this;
  }
  Raw& pad(size_t a) {
    b.resize((b.size() + a - 1) / a * a, '\0');
    return *this;
  }
  Raw& header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    return put("GGUF", 4).u32(version).u64(n_tensors).u64(n_kv);
  }
  Raw& kv_str(const std::string& k, const std::string& v) { return str(k).u32(8).str(v); }
  Raw& tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
    str(name).u32(uint32_t(ne.size()));
    for (uint64_t d : ne) u64(d);
    return u32(type).u64(offset);
  }
};

// One F32 tensor of 4 elements after one metadata key.
std::string minimal_file() {
  Raw r;
  r.header(1, 1).kv_str("general.architecture", "x").tensor("t", {4}, 0, 0).pad(32);
  const float v[4] = {1, 2, 3, 4};
  return r.put(v, 16).b;
}

TEST(GgufReader, ReadsGgufPyFixtureIdentically) {
  const auto want = nlohmann::ordered_json::parse(read_bytes(mbtest::fixture("gguf/all_types.json")));
  auto f = GgufFile::open(mbtest::fixture("gguf/all_types.gguf"));
  EXPECT_EQ(f->version(), want["version"].get<uint32_t>());
  EXPECT_EQ(f->alignment(), want["alignment"].get<uint64_t>());

  ASSERT_EQ(f->metadata().size(), want["fields"].size());
  size_t i = 0;
  for (auto& [key, w] : want["fields"].items()) {
    SCOPED_TRACE(key);
    EXPECT_EQ(f->metadata()[i++].first, key) << "metadata order";
    const GgufValue& v = f->get(key);
    const GgufType t = type_from_name(w["type"]);
    if (t == GgufType::ARRAY) expect_array(v, type_from_name(w["element"]), w["value"]);
    else expect_value(v, t, w["value"]);
  }

  ASSERT_EQ(f->tensors().size(), want["tensors"].size());
  for (size_t k = 0; k < f->tensors().size(); ++k) {
    const GgufTensorInfo& t = f->tensors()[k];
    const auto& w = want["tensors"][k];
    SCOPED_TRACE(t.name);
    EXPECT_EQ(t.name, w["name"].get<std::string>());
    EXPECT_EQ(ggml_type_name(t.ggml_type), w["type"].get<std::string>());
    EXPECT_EQ(t.ne, w["ne"].get<std::vector<uint64_t>>());
    EXPECT_EQ(f->data_offset() + t.offset, w["offset"].get<uint64_t>());
    EXPECT_EQ(t.nbytes, w["nbytes"].get<uint64_t>());
    EXPECT_EQ(hex(t.data, size_t(t.nbytes)), w["hex"].get<std::string>());
    const auto& values = w["values"];
    if (t.dtype == DType::I32 || t.dtype == DType::I64) {
      for (size_t e = 0; e < values.size(); ++e) {
        int64_t x = t.dtype == DType::I32 ? int64_t(reinterpret_cast<const int32_t*>(t.data)[e])
                                          : reinterpret_cast<const int64_t*>(t.data)[e];
        EXPECT_EQ(x, values[e].get<int64_t>());
      }
      continue;
    }
    std::vector<float> y(values.size());
    const int64_t cols = int64_t(t.ne[0]);
    const size_t rb = dtype_row_bytes(t.dtype, cols);
    for (size_t r = 0; r < y.size() / size_t(cols); ++r)
      dequantize_row(t.dtype, t.data + r * rb, y.data() + r * size_t(cols), cols);
    for (size_t e = 0; e < y.size(); ++e) ASSERT_EQ(double(y[e]), values[e].get<double>()) << "element " << e;
  }
}

TEST(GgufReader, RegistersTensorsInPyTorchOrder) {
  auto f = GgufFile::open(mbtest::fixture("gguf/all_types.gguf"));
  TensorRegistry reg;
  f->register_tensors(reg, [](const std::string& n) { return n == "i64" ? std::string() : "x." + n; });
  EXPECT_FALSE(reg.contains("x.i64"));
  Tensor q = reg.get("x.q8_0_3d", {2, 3, 32});
  EXPECT_EQ(q.dtype, DType::Q8_0);
  EXPECT_EQ(q.nbytes(), 6u * 34u);
  EXPECT_EQ(reg.get("x.f32_4d", {1, 2, 3, 4}).nbytes(), 96u);
  EXPECT_EQ(reg.get("x.q5_k", {1, 512}).nbytes(), 352u);
  EXPECT_EQ(q.data, static_cast<const void*>(f->find_tensor("q8_0_3d")->data));
  EXPECT_EQ(reg.describe_sources(), mbtest::fixture("gguf/all_types.gguf"));
}

TEST(GgufReader, ReadsVersion2) {
  std::string b = fixture_bytes();
  b[4] = 2;  // v2 and v3 share the little-endian layout
  auto v2 = parse_bytes(b);
  auto v3 = parse_bytes(fixture_bytes());
  EXPECT_EQ(v2->version(), 2u);
  EXPECT_EQ(v2->metadata(), v3->metadata());
  EXPECT_EQ(v2->tensors().size(), v3->tensors().size());
}

TEST(GgufWriter, ReproducesGgufPyBytes) {
  auto f = GgufFile::open(mbtest::fixture("gguf/all_types.gguf"));
  GgufWriter w;
  for (auto& [k, v] : f->metadata()) w.set(k, v);
  for (auto& t : f->tensors()) w.add_tensor(t.name, t.dtype, t.shape(), t.data);
  const std::string out = w.bytes();
  EXPECT_TRUE(out == fixture_bytes()) << "writer output differs from gguf-py's file (" << out.size() << " vs "
                                      << fixture_bytes().size() << " bytes)";
  // `python3 tools/reference/make_quant_cases.py --check $MARKBASE_GGUF_WRITE` then reads it with gguf-py.
  if (const char* p = std::getenv("MARKBASE_GGUF_WRITE")) w.write(p);
}

TEST(GgufWriter, RoundTripsEveryValueAndTensorType) {
  GgufWriter w;
  w.set("general.architecture", GgufValue::make_string("roundtrip"));
  w.set("general.alignment", GgufValue::make_uint(GgufType::U32, 16));
  w.set("a.u8", GgufValue::make_uint(GgufType::U8, 255));
  w.set("a.i8", GgufValue::make_int(GgufType::I8, -128));
  w.set("a.u16", GgufValue::make_uint(GgufType::U16, 65535));
  w.set("a.i16", GgufValue::make_int(GgufType::I16, -1));
  w.set("a.u32", GgufValue::make_uint(GgufType::U32, 0xffffffffu));
  w.set("a.i32", GgufValue::make_int(GgufType::I32, INT32_MIN));
  w.set("a.u64", GgufValue::make_uint(GgufType::U64, UINT64_MAX));
  w.set("a.i64", GgufValue::make_int(GgufType::I64, INT64_MIN));
  w.set("a.f32_nan", GgufValue::make_float(GgufType::F32, std::nan("")));
  w.set("a.f64_neg_zero", GgufValue::make_float(GgufType::F64, -0.0));
  w.set("a.bool", GgufValue::make_bool(true));
  w.set("a.empty_string", GgufValue::make_string(""));
  w.set("a.string_with_nul", GgufValue::make_string(std::string("a\0b", 3)));
  w.set("a.empty_array", GgufValue::make_int_array(GgufType::I32, {}));
  w.set("a.floats", GgufValue::make_float_array(GgufType::F32, {1.5, -2.25}));
  w.set("a.bools", GgufValue::make_bool_array({true, false}));
  w.set("a.strings", GgufValue::make_string_array({"x", "", "yz"}));
  w.set("a.nested", GgufValue::make_array_of_arrays(
                        {GgufValue::make_string_array({}), GgufValue::make_int_array(GgufType::U16, {1, 2}),
                         GgufValue::make_array_of_arrays({GgufValue::make_bool_array({false})})}));
  w.set("a.u8", GgufValue::make_uint(GgufType::U8, 7));  // replaces in place
  std::vector<std::pair<std::string, DType>> types = {
      {"f32", DType::F32},   {"f16", DType::F16},   {"bf16", DType::BF16}, {"i32", DType::I32},
      {"i64", DType::I64},   {"q8_0", DType::Q8_0}, {"q4_0", DType::Q4_0}, {"q4_1", DType::Q4_1},
      {"q5_0", DType::Q5_0}, {"q5_1", DType::Q5_1}, {"q4_k", DType::Q4_K}, {"q5_k", DType::Q5_K},
      {"q6_k", DType::Q6_K}};
  std::vector<std::string> blobs;
  for (size_t i = 0; i < types.size(); ++i) {
    Tensor t;
    t.dtype = types[i].second;
    t.shape = {2, 3, 256};
    std::string data(t.nbytes(), '\0');
    for (size_t k = 0; k < data.size(); ++k) data[k] = char((k * 131 + i * 7) & 0xff);
    w.add_tensor(types[i].first, t.dtype, t.shape, data.data());
    blobs.push_back(data);
  }
  w.add_tensor("empty", DType::F32, {0, 4}, nullptr);
  const std::string path = mbtest::temp_dir("gguf_roundtrip") + "/rt.gguf";
  w.write(path);

  auto f = GgufFile::open(path);
  EXPECT_EQ(f->alignment(), 16u);
  EXPECT_EQ(f->get("a.u8").as_int(), 7);
  EXPECT_EQ(f->metadata()[2].first, "a.u8");
  EXPECT_EQ(f->get("a.u64").bits, UINT64_MAX);
  EXPECT_THROW(f->get("a.u64").as_int(), Error);
  EXPECT_EQ(f->get("a.i64").as_int(), INT64_MIN);
  EXPECT_EQ(f->get("a.i8").as_int(), -128);
  EXPECT_TRUE(std::isnan(f->get("a.f32_nan").as_float()));
  EXPECT_TRUE(std::signbit(f->get("a.f64_neg_zero").as_float()));
  EXPECT_EQ(f->get("a.string_with_nul").as_string(), std::string("a\0b", 3));
  EXPECT_EQ(f->get("a.empty_array").size(), 0u);
  EXPECT_EQ(f->get("a.floats").floats(), (std::vector<double>{1.5, -2.25}));
  EXPECT_EQ(f->get("a.nested").items[2].items[0].bool_at(0), false);
  EXPECT_EQ(f->get("a.nested").items[1].ints(), (std::vector<int64_t>{1, 2}));
  EXPECT_THROW(f->get("a.strings").as_int(), Error);
  EXPECT_THROW(f->get("missing.key"), Error);

  // A second write of what was read gives the same file.
  GgufWriter w2;
  for (auto& [k, v] : f->metadata()) w2.set(k, v);
  for (auto& t : f->tensors()) w2.add_tensor(t.name, t.dtype, t.shape(), t.data);
  EXPECT_TRUE(w2.bytes() == read_bytes(path));

  for (size_t i = 0; i < types.size(); ++i) {
    const GgufTensorInfo* t = f->find_tensor(types[i].first);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->dtype, types[i].second);
    EXPECT_EQ(t->shape(), (std::vector<int64_t>{2, 3, 256}));
    EXPECT_EQ(t->offset % 16, 0u);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(t->data), size_t(t->nbytes)), blobs[i]) << types[i].first;
  }
  EXPECT_EQ(f->find_tensor("empty")->nbytes, 0u);
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

TEST(GgufWriter, RejectsWhatLlamaCppCannotLoad) {
  GgufWriter w;
  float x[32] = {};
  EXPECT_THROW(w.add_tensor(std::string(64, 'n'), DType::F32, {32}, x), Error);
  EXPECT_THROW(w.add_tensor("q", DType::Q8_0, {16}, x), Error);  // half a block
  EXPECT_THROW(w.add_tensor("u8", DType::U8, {4}, x), Error);
  EXPECT_THROW(w.add_tensor("5d", DType::F32, {1, 1, 1, 1, 2}, x), Error);
  w.add_tensor("ok", DType::F32, {32}, x);
  EXPECT_THROW(w.add_tensor("ok", DType::F32, {32}, x), Error);
  EXPECT_THROW(w.set("general.alignment", GgufValue::make_uint(GgufType::U32, 24)), Error);
  EXPECT_THROW(w.set("general.alignment", GgufValue::make_uint(GgufType::U64, 32)), Error);
}

TEST(GgufReader, AcceptsMinimalFile) {
  const std::string b = minimal_file();  // parse() reads the bytes in place
  auto f = parse_bytes(b);
  ASSERT_EQ(f->tensors().size(), 1u);
  EXPECT_EQ(reinterpret_cast<const float*>(f->tensors()[0].data)[3], 4.f);
  // No tensors: the file may end right after the metadata, without padding.
  Raw r;
  r.header(0, 1).kv_str("general.architecture", "x");
  EXPECT_EQ(parse_bytes(r.b)->tensors().size(), 0u);
}

TEST(GgufReader, RejectsDamagedHeaders) {
  std::string b = minimal_file();
  expect_rejected(b.substr(0, 3), "too short");
  std::string m = b;
  m[3] = 'X';
  expect_rejected(m, "not a GGUF file (magic 'GGUX'");
  auto with_version = [&](uint32_t v) {
    std::string s = b;
    std::memcpy(&s[4], &v, 4);
    return s;
  };
  expect_rejected(with_version(1), "version 1 is not supported");
  expect_rejected(with_version(4), "unsupported GGUF version 4");
  expect_rejected(with_version(__builtin_bswap32(3)), "big-endian");
  expect_rejected(Raw().header(uint64_t(1) << 60, 0).b, "tensors cannot fit");
  expect_rejected(Raw().header(0, uint64_t(1) << 40).b, "metadata entries cannot fit");
  expect_rejected(Raw().header(0, 1).u64(uint64_t(1) << 62).b + std::string(16, 'x'), "truncated or corrupt GGUF file");
  expect_rejected(Raw().header(0, 1).str("k").u32(13).u32(0).b, "unknown value type 13");
  expect_rejected(Raw().header(0, 1).str("k").u32(9).u32(4).u64(uint64_t(1) << 61).u64(0).b,
                  "claims 2305843009213693952 array elements");
  expect_rejected(Raw().header(0, 1).str("k").u32(9).u32(77).u64(1).u32(0).b, "unknown array element type 77");
  Raw deep;
  deep.header(0, 1).str("k").u32(9);
  for (int i = 0; i < 6; ++i) deep.u32(9).u64(1);
  expect_rejected(deep.u32(0).u64(0).b, "nests arrays more than 4 deep");
  expect_rejected(Raw().header(0, 2).kv_str("k", "a").kv_str("k", "b").b, "metadata key 'k' appears twice");
  expect_rejected(Raw().header(0, 1).str("general.alignment").u32(4).u32(24).b, "not a power of two");
  expect_rejected(Raw().header(0, 1).str("general.alignment").u32(10).u64(32).b, "must be a UINT32");
}

TEST(GgufReader, RejectsDamagedTensorInfos) {
  auto file = [](std::vector<std::tuple<std::string, std::vector<uint64_t>, uint32_t, uint64_t>> ts,
                 size_t data_bytes) {
    Raw r;
    r.header(ts.size(), 1).kv_str("general.architecture", "x");
    for (auto& [n, ne, type, off] : ts) r.tensor(n, ne, type, off);
    r.pad(32);
    r.b.append(data_bytes, '\0');
    return r.b;
  };
  expect_rejected(file({{"t", {1, 1, 1, 1, 1}, 0, 0}}, 64), "tensor 't' has 5 dimensions (at most 4)");
  expect_rejected(file({{"t", {uint64_t(1) << 40, uint64_t(1) << 40}, 0, 0}}, 64), "dimensions that overflow");
  expect_rejected(file({{"t", {uint64_t(1) << 63}, 0, 0}}, 64), "overflow");
  expect_rejected(file({{"t", {256}, 16, 0}}, 64), "type IQ2_XXS (16), which MarkBase does not support");
  expect_rejected(file({{"t", {4}, 200, 0}}, 64), "unknown type 200");
  expect_rejected(file({{"t", {100}, 12, 0}}, 1024), "not a multiple of its block size 256");
  expect_rejected(file({{"t", {4}, 0, 8}}, 64), "offset 8 is not a multiple of the alignment 32");
  expect_rejected(file({{"t", {4}, 0, 32}}, 40), "lies outside the data section");
  expect_rejected(file({{"t", {uint64_t(1) << 40}, 0, 0}}, 64), "lies outside the data section");
  expect_rejected(file({{"a", {16}, 0, 0}, {"b", {4}, 0, 32}}, 64), "overlap");
  expect_rejected(file({{"a", {4}, 0, 0}, {"a", {4}, 0, 32}}, 64), "tensor 'a' appears twice");
  // Infos that end past the file.
  std::string b = file({{"t", {4}, 0, 0}}, 16);
  expect_rejected(b.substr(0, 60), "truncated or corrupt");
}

// Every prefix of a valid file, and many random corruptions of it, must give an mb::Error or a
// valid parse: never a crash (the sanitizer build runs this too).
TEST(GgufReader, SurvivesTruncationAndRandomDamage) {
  const std::string& b = fixture_bytes();
  // Only the trailing padding after the last tensor may go.
  auto full = parse_bytes(b);
  const GgufTensorInfo& last = full->tensors().back();
  const size_t data_end = size_t(full->data_offset() + last.offset + last.nbytes);
  for (size_t n = 0; n < b.size(); ++n) {
    if (n < data_end) EXPECT_THROW(parse_bytes(b.substr(0, n)), Error) << "prefix " << n;
    else EXPECT_NO_THROW(parse_bytes(b.substr(0, n))) << "prefix " << n;
  }
  std::mt19937 rng(1234);
  int parsed = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string m = b;
    const int flips = 1 + int(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const size_t pos = rng() % (i % 2 ? 512 : m.size());  // half the damage hits the header region
      m[pos] = char(rng() % 3 == 0 ? 0xff : rng());
    }
    try {
      auto f = parse_bytes(m);
      TensorRegistry reg;
      f->register_tensors(reg);
      ++parsed;
    } catch (const Error&) {
    }
  }
  EXPECT_GT(parsed, 0);
}

}  // namespace
