// Block quantization: bit-exact against llama.cpp's gguf-py (tools/reference/make_quant_cases.py),
// round-trip error per type, and the fast dot product against its scalar twin.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include "backends/cpu/cpu_kernels.h"
#include "core/error.h"
#include "core/quant.h"
#include "core/tensor.h"
#include "test_util.h"

using namespace mb;

namespace {

const std::vector<DType> kBlockTypes = {DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0,
                                        DType::Q5_1, DType::Q4_K, DType::Q5_K, DType::Q6_K};

std::string type_param_name(const testing::TestParamInfo<DType>& info) {
  return std::string(dtype_name(info.param));
}

struct Cases {
  nlohmann::json index;
  std::string blob;
};

const Cases& cases() {
  static Cases c = [] {
    Cases c;
    c.index = mbtest::read_json(mbtest::fixture("quant/cases.json"));
    std::ifstream in(mbtest::fixture("quant/cases.bin"), std::ios::binary);
    c.blob.assign(std::istreambuf_iterator<char>(in), {});
    return c;
  }();
  return c;
}

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0;
}

std::vector<float> normal_floats(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

class QuantType : public testing::TestWithParam<DType> {};

TEST_P(QuantType, MatchesGgufPyBitForBit) {
  const DType t = GetParam();
  const Cases& c = cases();
  int checked = 0;
  for (const auto& cs : c.index["cases"]) {
    if (cs["type"] != dtype_name(t)) continue;
    SCOPED_TRACE(cs["name"].get<std::string>());
    const int64_t rows = cs["rows"], n = cs["n"];
    const size_t rb = dtype_row_bytes(t, n);
    // The blob packs arrays back to back; copy them out to get aligned storage.
    auto read = [&](const char* key, void* dst, size_t bytes) {
      const size_t off = cs[key].get<size_t>();
      ASSERT_LE(off + bytes, c.blob.size());
      std::memcpy(dst, c.blob.data() + off, bytes);
    };
    std::vector<uint8_t> want_q(rb * size_t(rows));
    std::vector<float> want_y(static_cast<size_t>(rows * n)), y(want_y.size());
    read("quantized", want_q.data(), want_q.size());
    read("dequantized", want_y.data(), want_y.size() * 4);
    if (cs["input"].get<int64_t>() >= 0) {
      std::vector<float> x(want_y.size());
      read("input", x.data(), x.size() * 4);
      std::vector<uint8_t> q(want_q.size());
      for (int64_t r = 0; r < rows; ++r) quantize_row(t, x.data() + r * n, q.data() + r * rb, n);
      for (size_t i = 0; i < q.size(); ++i)
        ASSERT_EQ(int(q[i]), int(want_q[i])) << "quantized byte " << i << " (row " << i / rb << ")";
    }
    for (int64_t r = 0; r < rows; ++r) dequantize_row(t, want_q.data() + r * rb, y.data() + r * n, n);
    for (size_t i = 0; i < y.size(); ++i)
      ASSERT_TRUE(same_float(y[i], want_y[i])) << "element " << i << ": " << y[i] << " vs " << want_y[i];
    ++checked;
  }
  EXPECT_GE(checked, 5) << "fixture has too few cases for " << dtype_name(t);
}

// Relative RMS error of quantize -> dequantize on Gaussian rows: catches a broken quantizer
// that the fixture (gguf-py cannot quantize K types) would not.
TEST_P(QuantType, RoundTripError) {
  const DType t = GetParam();
  // Measured: Q8_0 0.0055, Q6_K 0.018-0.020, Q5_* 0.037-0.044, Q4_* 0.073-0.088.
  const double bound = t == DType::Q8_0 ? 0.007
                       : t == DType::Q6_K ? 0.023
                       : (t == DType::Q5_0 || t == DType::Q5_1 || t == DType::Q5_K) ? 0.05
                                                                                    : 0.1;
  const int64_t n = 1024;
  for (float scale : {1e-3f, 1.f, 500.f}) {
    std::vector<float> x = normal_floats(size_t(n), 42, scale), y(static_cast<size_t>(n));
    std::vector<uint8_t> q(dtype_row_bytes(t, n));
    quantize_row(t, x.data(), q.data(), n);
    dequantize_row(t, q.data(), y.data(), n);
    double err = 0, ref = 0;
    for (int64_t i = 0; i < n; ++i) {
      err += (double(x[size_t(i)]) - y[size_t(i)]) * (double(x[size_t(i)]) - y[size_t(i)]);
      ref += double(x[size_t(i)]) * x[size_t(i)];
    }
    EXPECT_LT(std::sqrt(err / ref), bound) << "scale " << scale;
  }
}

TEST_P(QuantType, EdgeRowsStayFinite) {
  const DType t = GetParam();
  const int64_t n = 256;
  std::vector<std::vector<float>> rows = {std::vector<float>(size_t(n), 0.f), std::vector<float>(size_t(n), -2.5f),
                                          normal_floats(size_t(n), 1, 1e-25f), normal_floats(size_t(n), 2, 100.f)};
  rows.back()[17] = 3e4f;
  for (auto& x : rows) {
    std::vector<uint8_t> q(dtype_row_bytes(t, n));
    std::vector<float> y(static_cast<size_t>(n));
    quantize_row(t, x.data(), q.data(), n);
    dequantize_row(t, q.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite(y[size_t(i)])) << i;
    if (x[0] == 0.f && x[1] == 0.f) {
      for (float v : y) EXPECT_EQ(v, 0.f);
    }
  }
  // NaN and inf inputs give garbage, but defined garbage (the sanitizer build checks this).
  std::vector<float> bad = normal_floats(size_t(n), 3);
  bad[5] = NAN;
  bad[9] = INFINITY;
  std::vector<uint8_t> q(dtype_row_bytes(t, n));
  quantize_row(t, bad.data(), q.data(), n);
}

TEST_P(QuantType, VecDotMatchesScalarTwin) {
  const DType t = GetParam();
  for (int64_t n : {dtype_block_size(t), int64_t(2048)}) {
    for (uint32_t seed : {1u, 2u, 3u}) {
      std::vector<float> w = normal_floats(size_t(n), seed), x = normal_floats(size_t(n), seed + 100);
      w[size_t(seed)] = 7.f;  // an outlier sets a coarse scale for its block
      std::vector<uint8_t> q(dtype_row_bytes(t, n));
      quantize_row(t, w.data(), q.data(), n);
      std::vector<float> wd(static_cast<size_t>(n));
      dequantize_row(t, q.data(), wd.data(), n);
      double mag = 0;
      for (int64_t i = 0; i < n; ++i) mag += std::fabs(double(wd[size_t(i)]) * x[size_t(i)]);
      const float ref = vec_dot_ref(t, q.data(), x.data(), n), fast = cpu::vec_dot(t, q.data(), x.data(), n);
      EXPECT_NEAR(fast, ref, 2e-6 * mag + 1e-30) << "n " << n << " seed " << seed;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Quant, QuantType, testing::ValuesIn(kBlockTypes), type_param_name);

TEST(Quant, VecDotPlainTypes) {
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    for (int64_t n : {1, 7, 8, 100, 4099}) {
      std::vector<float> w = normal_floats(size_t(n), 5), x = normal_floats(size_t(n), 6);
      std::vector<uint8_t> row(dtype_row_bytes(t, n));
      quantize_row(t, w.data(), row.data(), n);
      double mag = 0;
      for (int64_t i = 0; i < n; ++i) mag += std::fabs(double(w[size_t(i)]) * x[size_t(i)]);
      EXPECT_NEAR(cpu::vec_dot(t, row.data(), x.data(), n), vec_dot_ref(t, row.data(), x.data(), n), 2e-6 * mag)
          << dtype_name(t) << " n " << n;
    }
  }
}

TEST(Quant, BlockSizesMatchGgml) {
  // GGML_QUANT_SIZES in gguf-py's constants.py.
  const std::vector<std::tuple<DType, int64_t, size_t>> want = {
      {DType::Q8_0, 32, 34},  {DType::Q4_0, 32, 18},   {DType::Q4_1, 32, 20},   {DType::Q5_0, 32, 22},
      {DType::Q5_1, 32, 24},  {DType::Q4_K, 256, 144}, {DType::Q5_K, 256, 176}, {DType::Q6_K, 256, 210},
      {DType::F32, 1, 4},     {DType::BF16, 1, 2}};
  for (auto [t, bs, bytes] : want) {
    EXPECT_EQ(dtype_block_size(t), bs) << dtype_name(t);
    EXPECT_EQ(dtype_block_bytes(t), bytes) << dtype_name(t);
    EXPECT_EQ(dtype_is_quantized(t), bs > 1);
  }
  EXPECT_EQ(dtype_row_bytes(DType::Q4_K, 512), 288u);
  EXPECT_EQ(dtype_row_bytes(DType::F16, 3), 6u);
  EXPECT_THROW(dtype_row_bytes(DType::Q8_0, 33), Error);
  EXPECT_THROW(dtype_size(DType::Q6_K), Error);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
}

TEST(Quant, TensorBytesOfBlockTypes) {
  Tensor t = host_tensor(DType::Q4_K, {3, 512});
  EXPECT_EQ(t.nbytes(), 3u * 288u);
  Tensor r = t.slice_rows(1, 2);
  EXPECT_EQ(r.nbytes(), 2u * 288u);
  EXPECT_EQ(static_cast<uint8_t*>(r.data) - static_cast<uint8_t*>(t.data), 288);
  Tensor e = host_tensor(DType::Q8_0, {4, 2, 64});  // experts [E, out, in]
  EXPECT_EQ(e.nbytes(), 8u * 68u);
  EXPECT_EQ(e.slice_rows(3, 1).nbytes(), 2u * 68u);
}

}  // namespace
