// The AMX-BF16 path of cpu::matmul (backends/cpu/matmul_amx.*): near the f32 fma chain on shapes
// with token, row and k tails, finite on extreme magnitudes, the same per token whatever the batch;
// switched off, or under another kernel table, matmul is the fma chain bit for bit again.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backends/cpu/cpu_kernels.h"
#include "core/dtype.h"

namespace {

using mb::DType;
using mb::cpu::Isa;

struct Bf16Weights {
  std::vector<uint16_t> bits;
  std::vector<float> f32;  // the exact values
};

Bf16Weights bf16_weights(size_t count, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> nd(0.f, scale);
  Bf16Weights w;
  w.bits.resize(count + 1);  // one past the end: nothing may read it
  w.f32.resize(count);
  for (size_t i = 0; i < count; ++i) {
    w.bits[i] = mb::f32_to_bf16(nd(rng));
    w.f32[i] = mb::bf16_to_f32(w.bits[i]);
  }
  return w;
}

std::vector<float> randn(size_t count, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(count);
  for (auto& x : v) x = nd(rng);
  return v;
}

// The AVX-512 table with the AMX path on, for the test's lifetime; previous settings after.
struct AmxScope {
  Isa prev_isa;
  bool prev_on;
  explicit AmxScope(Isa isa = Isa::Avx512, bool on = true)
      : prev_isa(mb::cpu::set_isa(isa)), prev_on(mb::cpu::set_amx_bf16_matmul(on)) {}
  ~AmxScope() {
    mb::cpu::set_amx_bf16_matmul(prev_on);
    mb::cpu::set_isa(prev_isa);
  }
};

bool amx_runs() { return mb::cpu::kernels_for(Isa::Avx512) && mb::cpu::cpu_amx_bf16_ready(); }

struct Case {
  int64_t n, k, m;
};

// y = x · wᵀ through cpu::matmul with row strides ldx >= k, ldy >= m; cells past m stay -7.
std::vector<float> run(const Case& c, const std::vector<float>& x, int64_t ldx, const Bf16Weights& w, int64_t ldy) {
  std::vector<float> y(size_t(c.n * ldy) + 1, -7.f);
  mb::cpu::matmul(x.data(), ldx, c.n, c.k, DType::BF16, w.bits.data(), size_t(c.k) * 2, c.m, y.data(), ldy);
  return y;
}

// |y - fma chain| <= 1e-6 Σ|x·w| + 1e-6 for every output, all finite, nothing written past m. The
// split activations are exact, so only the f32 additions' order differs (a two-part split would
// be off by up to 2^-16 Σ|x·w|).
void expect_near_fma_chain(const Case& c, const std::vector<float>& x, int64_t ldx, const Bf16Weights& w,
                           const std::vector<float>& y, int64_t ldy) {
  std::vector<float> xd(size_t(c.n * c.k)), ref(size_t(c.n * c.m));
  for (int64_t t = 0; t < c.n; ++t) std::memcpy(&xd[size_t(t * c.k)], &x[size_t(t * ldx)], size_t(c.k) * 4);
  mb::cpu::matmul_ref(xd.data(), c.n, c.k, DType::BF16, w.bits.data(), c.m, ref.data());
  for (int64_t t = 0; t < c.n; ++t) {
    for (int64_t r = 0; r < c.m; ++r) {
      double mag = 0;
      for (int64_t i = 0; i < c.k; ++i) mag += std::fabs(double(xd[size_t(t * c.k + i)]) * w.f32[size_t(r * c.k + i)]);
      const float got = y[size_t(t * ldy + r)], want = ref[size_t(t * c.m + r)];
      ASSERT_TRUE(std::isfinite(got)) << "n=" << c.n << " k=" << c.k << " m=" << c.m << " t=" << t << " r=" << r;
      ASSERT_NEAR(got, want, 1e-6 * mag + 1e-6)
          << "n=" << c.n << " k=" << c.k << " m=" << c.m << " t=" << t << " r=" << r;
    }
    for (int64_t r = c.m; r < ldy; ++r) ASSERT_EQ(y[size_t(t * ldy + r)], -7.f) << "wrote past m";
  }
  ASSERT_EQ(y.back(), -7.f) << "wrote past y";
}

TEST(AmxBf16Matmul, NearTheFmaChainWithTokenRowAndKTails) {
  if (!amx_runs()) GTEST_SKIP() << "no AMX-BF16 on this CPU/OS/build";
  AmxScope on;
  ASSERT_TRUE(mb::cpu::amx_bf16_matmul_active());
  std::vector<Case> cases;
  for (int64_t n : {9, 16, 17, 33, 100})
    for (int64_t m : {16, 17, 40})
      for (int64_t k : {1, 17, 32, 64, 96, 100}) cases.push_back({n, k, m});
  for (Case c : std::vector<Case>{{512, 1536, 40}, {17, 1536, 1000}, {100, 2080, 1000}, {33, 2049, 40},
                                  {512, 2144, 17}, {48, 2048 + 3 * 32, 300}})
    cases.push_back(c);
  std::mt19937 rng(11);
  for (const Case& c : cases) {
    auto x = randn(size_t(c.n * c.k), rng);
    auto w = bf16_weights(size_t(c.m * c.k), rng);
    expect_near_fma_chain(c, x, c.k, w, run(c, x, c.k, w, c.m), c.m);
  }
}

TEST(AmxBf16Matmul, StridedRowsAndPerTokenResultsIndependentOfTheBatch) {
  if (!amx_runs()) GTEST_SKIP() << "no AMX-BF16 on this CPU/OS/build";
  AmxScope on;
  std::mt19937 rng(12);
  const Case c{70, 301, 77};
  const int64_t ldx = 310, ldy = 80;
  auto x = randn(size_t(c.n * ldx), rng);
  auto w = bf16_weights(size_t(c.m * c.k), rng);
  const auto all = run(c, x, ldx, w, ldy);
  expect_near_fma_chain(c, x, ldx, w, all, ldy);
  // A token's row of y is one C tile column, summed over k alone: the same bits in any batch of
  // kAmxMinTokens or more.
  for (int64_t n : {mb::cpu::kAmxMinTokens, int64_t(16), int64_t(33)}) {
    const auto part = run({n, c.k, c.m}, x, ldx, w, ldy);
    for (int64_t i = 0; i < n * ldy; ++i) ASSERT_EQ(std::memcmp(&part[size_t(i)], &all[size_t(i)], 4), 0) << n << " " << i;
  }
}

TEST(AmxBf16Matmul, ExtremeMagnitudesStayFinite) {
  if (!amx_runs()) GTEST_SKIP() << "no AMX-BF16 on this CPU/OS/build";
  AmxScope on;
  std::mt19937 rng(13);
  const Case c{33, 100, 40};
  // Activations of 1e30 times unit weights; unit activations times weights of 1e30; activations
  // at the largest floats (whose bf16 rounding would overflow) times tiny weights.
  struct Scales {
    float x, w;
  };
  for (Scales s : {Scales{1e30f, 1.f}, Scales{1.f, 1e30f}, Scales{1e-30f, 1.f}}) {
    auto x = randn(size_t(c.n * c.k), rng, s.x);
    auto w = bf16_weights(size_t(c.m * c.k), rng, s.w);
    expect_near_fma_chain(c, x, c.k, w, run(c, x, c.k, w, c.m), c.m);
  }
  std::vector<float> x(size_t(c.n * c.k));
  for (size_t i = 0; i < x.size(); ++i) x[i] = (i % 3 ? 1.f : -1.f) * std::numeric_limits<float>::max() * (i % 2 ? 1.f : 0.999999f);
  auto w = bf16_weights(size_t(c.m * c.k), rng, 1e-6f);
  expect_near_fma_chain(c, x, c.k, w, run(c, x, c.k, w, c.m), c.m);
}

// With the switch off, and under the AVX2 table (AMX on), BF16 matmuls are the fma chain again.
TEST(AmxBf16Matmul, OffOrOtherTablesGiveTheFmaChainBitForBit) {
  std::mt19937 rng(14);
  const Case c{40, 600, 50};
  auto x = randn(size_t(c.n * c.k), rng);
  auto w = bf16_weights(size_t(c.m * c.k), rng);
  std::vector<float> ref(size_t(c.n * c.m));
  mb::cpu::matmul_ref(x.data(), c.n, c.k, DType::BF16, w.bits.data(), c.m, ref.data());
  struct Setting {
    Isa isa;
    bool amx;
  };
  for (Setting s : {Setting{Isa::Avx512, false}, Setting{Isa::Avx2, true}, Setting{Isa::Scalar, true}}) {
    if (!mb::cpu::kernels_for(s.isa)) continue;
    AmxScope scope(s.isa, s.amx);
    EXPECT_FALSE(mb::cpu::amx_bf16_matmul_active()) << mb::cpu::isa_name(s.isa);
    if (s.isa == Isa::Scalar) continue;  // the scalar table's dot is not the fma chain
    const auto y = run(c, x, c.k, w, c.m);
    for (size_t i = 0; i < ref.size(); ++i)
      ASSERT_EQ(std::memcmp(&y[i], &ref[i], 4), 0) << mb::cpu::isa_name(s.isa) << " amx " << s.amx << " at " << i;
  }
}

}  // namespace
