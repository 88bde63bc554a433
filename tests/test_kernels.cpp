// Every CPU kernel path this machine can run (scalar, AVX2, AVX-512) against its scalar twin, on
// random shapes with odd sizes, tails and zero lengths; the AMX-BF16 matmul against the fma chain
// within f32 rounding; the thread pool's contract.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/cpu_kernels.h"
#include "core/error.h"
#include "core/quant.h"
#include "core/thread_pool.h"
#include "test_util.h"

namespace {

using mb::DType;
using mb::cpu::Isa;

std::vector<Isa> paths() { return mbtest::kernel_tables(); }

struct UseIsa {
  Isa prev;
  explicit UseIsa(Isa i) : prev(mb::cpu::set_isa(i)) {}
  ~UseIsa() { mb::cpu::set_isa(prev); }
};

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Weights of `dt` as raw bytes, plus their exact f32 values.
struct Weights {
  std::vector<uint8_t> bytes;
  std::vector<float> f32;
};
Weights make_weights(DType dt, size_t n, std::mt19937& rng, float scale = 1.f) {
  Weights w;
  w.f32 = randn(n, rng, scale);
  w.bytes.resize(n * mb::dtype_size(dt) + 1);
  for (size_t i = 0; i < n; ++i) {
    if (dt == DType::F32) {
      std::memcpy(w.bytes.data() + 4 * i, &w.f32[i], 4);
      continue;
    }
    uint16_t h = dt == DType::BF16 ? mb::f32_to_bf16(w.f32[i]) : mb::f32_to_f16(w.f32[i]);
    std::memcpy(w.bytes.data() + 2 * i, &h, 2);
    w.f32[i] = dt == DType::BF16 ? mb::bf16_to_f32(h) : mb::f16_to_f32(h);
  }
  return w;
}

// The fma-chain paths only: bf16 matmuls of 16+ tokens would otherwise run on AMX tiles, whose
// near-f32 results test_matmul_amx.cpp checks.
struct AmxOff {
  bool prev = mb::cpu::set_amx_bf16_matmul(false);
  ~AmxOff() { mb::cpu::set_amx_bf16_matmul(prev); }
};

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0 || (a == 0 && b == 0); }

TEST(KernelDispatch, PathsAndOverride) {
  auto ps = paths();
  ASSERT_FALSE(ps.empty());
  EXPECT_EQ(ps.front(), Isa::Scalar);
  EXPECT_EQ(mb::cpu::best_isa(), ps.back());
  for (Isa i : ps) {
    UseIsa u(i);
    EXPECT_EQ(mb::cpu::kernels().isa, i);
    EXPECT_STREQ(mb::cpu::kernels().name, mb::cpu::isa_name(i));
  }
  if (!mb::cpu::kernels_for(Isa::Avx512)) {
    EXPECT_THROW(mb::cpu::set_isa(Isa::Avx512), mb::Error);
  }
  std::printf("[ figure ] kernel paths on this CPU:");
  for (Isa i : ps) std::printf(" %s", mb::cpu::isa_name(i));
  std::printf(" (active by default: %s)\n", mb::cpu::isa_name(mb::cpu::best_isa()));
}

// Shapes around every vector width, register tile (12 rows, 32 tokens), k block (256) and GEMV
// cut-over (8 tokens), plus zero lengths.
struct Shape {
  int64_t n, k, m;
};
std::vector<Shape> matmul_shapes() {
  std::vector<Shape> s = {{0, 5, 3},  {3, 0, 4},   {2, 7, 0},    {1, 1, 1},     {1, 16, 16},   {2, 17, 33},
                          {3, 15, 7}, {8, 64, 20}, {9, 33, 13},  {16, 16, 12},  {17, 31, 25},  {31, 100, 5},
                          {32, 8, 24}, {33, 257, 97}, {40, 600, 200}, {70, 513, 31}, {5, 1000, 130}};
  std::mt19937 rng(7);
  for (int i = 0; i < 20; ++i)
    s.push_back({int64_t(rng() % 60 + 1), int64_t(rng() % 300 + 1), int64_t(rng() % 150 + 1)});
  return s;
}

TEST(KernelMatmul, EveryPathMatchesTheFmaChain) {
  AmxOff fma_chains;
  std::mt19937 rng(1);
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (const Shape& sh : matmul_shapes()) {
      auto x = randn(size_t(sh.n * sh.k) + 1, rng);
      auto w = make_weights(dt, size_t(sh.m * sh.k), rng);
      std::vector<float> ref(size_t(sh.n * sh.m) + 1, -7.f), y;
      mb::cpu::matmul_ref(x.data(), sh.n, sh.k, dt, w.bytes.data(), sh.m, ref.data());
      for (Isa isa : paths()) {
        UseIsa u(isa);
        y.assign(ref.size(), -7.f);
        mb::cpu::matmul(x.data(), sh.k, sh.n, sh.k, dt, w.bytes.data(), size_t(sh.k) * mb::dtype_size(dt), sh.m,
                        y.data(), sh.m);
        EXPECT_EQ(y.back(), -7.f) << "wrote past y";
        for (int64_t t = 0; t < sh.n; ++t)
          for (int64_t r = 0; r < sh.m; ++r) {
            const float a = y[size_t(t * sh.m + r)], b = ref[size_t(t * sh.m + r)];
            if (isa == Isa::Scalar) {
              double mag = 0;
              for (int64_t i = 0; i < sh.k; ++i)
                mag += std::fabs(double(x[size_t(t * sh.k + i)]) * w.f32[size_t(r * sh.k + i)]);
              ASSERT_NEAR(a, b, 1e-6 * mag + 1e-30)
                  << mb::cpu::isa_name(isa) << " " << mb::dtype_name(dt) << " n=" << sh.n << " k=" << sh.k << " m=" << sh.m;
            } else {
              ASSERT_TRUE(same_bits(a, b)) << mb::cpu::isa_name(isa) << " " << mb::dtype_name(dt) << " n=" << sh.n
                                           << " k=" << sh.k << " m=" << sh.m << " t=" << t << " r=" << r << ": " << a
                                           << " vs " << b;
            }
          }
      }
    }
  }
}

// Block-quantized weights on the GEMM path: panels dequantized exactly, then the same fma chain.
TEST(KernelMatmul, BlockWeightsMatchTheFmaChainOverDequantizedRows) {
  std::mt19937 rng(7);
  for (DType dt : {DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::Q4_1, DType::Q4_K, DType::Q5_K, DType::Q6_K}) {
    const int64_t n = 37, m = 29, k = mb::dtype_block_size(dt) == 256 ? 768 : 608;  // a partial KC panel
    auto x = randn(size_t(n * k), rng);
    auto f = randn(size_t(m * k), rng);
    const size_t rb = mb::dtype_row_bytes(dt, k);
    std::vector<uint8_t> w(rb * size_t(m));
    for (int64_t r = 0; r < m; ++r) mb::quantize_row(dt, f.data() + r * k, w.data() + size_t(r) * rb, k);
    std::vector<float> ref(size_t(n * m));
    mb::cpu::matmul_ref(x.data(), n, k, dt, w.data(), m, ref.data());
    for (Isa isa : paths()) {
      UseIsa u(isa);
      if (!mb::cpu::matmul_blocks_supported(n)) continue;
      std::vector<float> y(size_t(n * m) + 1, -7.f);
      mb::cpu::matmul(x.data(), k, n, k, dt, w.data(), rb, m, y.data(), m);
      EXPECT_EQ(y.back(), -7.f) << "wrote past y";
      for (size_t i = 0; i + 1 < y.size(); ++i)
        ASSERT_TRUE(same_bits(y[i], ref[i])) << mb::cpu::isa_name(isa) << " " << mb::dtype_name(dt) << " at " << i;
    }
  }
}

TEST(KernelMatmul, StridedRowsAndBatchInvariance) {
  // A token's output is the same whether it comes alone (GEMV) or with 44 others (GEMM), and
  // whatever the row strides of x and y.
  AmxOff fma_chains;
  std::mt19937 rng(2);
  const int64_t n = 45, k = 301, m = 77, ldx = 310, ldy = 80;
  auto x = randn(size_t(n * ldx), rng);
  auto w = make_weights(DType::BF16, size_t(m * k), rng);
  for (Isa isa : paths()) {
    UseIsa u(isa);
    std::vector<float> all(size_t(n * ldy), -3.f), one(static_cast<size_t>(m));
    mb::cpu::matmul(x.data(), ldx, n, k, DType::BF16, w.bytes.data(), size_t(k) * 2, m, all.data(), ldy);
    for (int64_t t = 0; t < n; ++t) {
      mb::cpu::matmul(x.data() + t * ldx, ldx, 1, k, DType::BF16, w.bytes.data(), size_t(k) * 2, m, one.data(), m);
      for (int64_t r = 0; r < m; ++r) {
        if (isa == Isa::Scalar) {
          ASSERT_NEAR(all[size_t(t * ldy + r)], one[size_t(r)], 1e-4);
        } else {
          ASSERT_TRUE(same_bits(all[size_t(t * ldy + r)], one[size_t(r)])) << mb::cpu::isa_name(isa) << " t=" << t;
        }
      }
      for (int64_t r = m; r < ldy; ++r) ASSERT_EQ(all[size_t(t * ldy + r)], -3.f);
    }
  }
}

// ---------------------------------------------------------------- AMX-BF16 matmul

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

// y = x · wᵀ through cpu::matmul with row strides ldx >= k, ldy >= m; cells past m stay -7.
std::vector<float> run(const Shape& c, const std::vector<float>& x, int64_t ldx, const Weights& w, int64_t ldy) {
  std::vector<float> y(size_t(c.n * ldy) + 1, -7.f);
  mb::cpu::matmul(x.data(), ldx, c.n, c.k, DType::BF16, w.bytes.data(), size_t(c.k) * 2, c.m, y.data(), ldy);
  return y;
}

// |y - fma chain| <= 1e-6 Σ|x·w| + 1e-6 for every output, all finite, nothing written past m. The
// split activations are exact, so only the f32 additions' order differs (a two-part split would
// be off by up to 2^-16 Σ|x·w|).
void expect_near_fma_chain(const Shape& c, const std::vector<float>& x, int64_t ldx, const Weights& w,
                           const std::vector<float>& y, int64_t ldy) {
  std::vector<float> xd(size_t(c.n * c.k)), ref(size_t(c.n * c.m));
  for (int64_t t = 0; t < c.n; ++t) std::memcpy(&xd[size_t(t * c.k)], &x[size_t(t * ldx)], size_t(c.k) * 4);
  mb::cpu::matmul_ref(xd.data(), c.n, c.k, DType::BF16, w.bytes.data(), c.m, ref.data());
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
  std::vector<Shape> cases;
  for (int64_t n : {9, 16, 17, 33, 100})
    for (int64_t m : {16, 17, 40})
      for (int64_t k : {1, 17, 32, 64, 96, 100}) cases.push_back({n, k, m});
  for (Shape c : std::vector<Shape>{{512, 1536, 40}, {17, 1536, 1000}, {100, 2080, 1000}, {33, 2049, 40},
                                   {512, 2144, 17}, {48, 2048 + 3 * 32, 300}})
    cases.push_back(c);
  std::mt19937 rng(11);
  for (const Shape& c : cases) {
    auto x = randn(size_t(c.n * c.k), rng);
    auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng);
    expect_near_fma_chain(c, x, c.k, w, run(c, x, c.k, w, c.m), c.m);
  }
}

TEST(AmxBf16Matmul, StridedRowsAndPerTokenResultsIndependentOfTheBatch) {
  if (!amx_runs()) GTEST_SKIP() << "no AMX-BF16 on this CPU/OS/build";
  AmxScope on;
  std::mt19937 rng(12);
  const Shape c{70, 301, 77};
  const int64_t ldx = 310, ldy = 80;
  auto x = randn(size_t(c.n * ldx), rng);
  auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng);
  const auto all = run(c, x, ldx, w, ldy);
  expect_near_fma_chain(c, x, ldx, w, all, ldy);
  // A token's row of y is one C tile column, summed over k alone: the same bits in any batch of
  // kAmxMinTokens or more.
  for (int64_t n : {mb::cpu::kAmxMinTokens, int64_t(16), int64_t(33)}) {
    const auto part = run({n, c.k, c.m}, x, ldx, w, ldy);
    for (int64_t i = 0; i < n * ldy; ++i)
      ASSERT_TRUE(same_bits(part[size_t(i)], all[size_t(i)])) << "n=" << n << " at " << i;
  }
}

TEST(AmxBf16Matmul, ExtremeMagnitudesStayFinite) {
  if (!amx_runs()) GTEST_SKIP() << "no AMX-BF16 on this CPU/OS/build";
  AmxScope on;
  std::mt19937 rng(13);
  const Shape c{33, 100, 40};
  // Activations of 1e30 times unit weights; unit activations times weights of 1e30; activations
  // at the largest floats (whose bf16 rounding would overflow) times tiny weights.
  struct Scales {
    float x, w;
  };
  for (Scales s : {Scales{1e30f, 1.f}, Scales{1.f, 1e30f}, Scales{1e-30f, 1.f}}) {
    auto x = randn(size_t(c.n * c.k), rng, s.x);
    auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng, s.w);
    expect_near_fma_chain(c, x, c.k, w, run(c, x, c.k, w, c.m), c.m);
  }
  std::vector<float> x(size_t(c.n * c.k));
  const float big = std::numeric_limits<float>::max();
  for (size_t i = 0; i < x.size(); ++i) x[i] = (i % 3 ? 1.f : -1.f) * (i % 2 ? big : 0.999999f * big);
  auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng, 1e-6f);
  expect_near_fma_chain(c, x, c.k, w, run(c, x, c.k, w, c.m), c.m);
}

// With the switch off, and under the AVX2 table (AMX on), BF16 matmuls are the fma chain again.
TEST(AmxBf16Matmul, OffOrOtherTablesGiveTheFmaChainBitForBit) {
  std::mt19937 rng(14);
  const Shape c{40, 600, 50};
  auto x = randn(size_t(c.n * c.k), rng);
  auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng);
  std::vector<float> ref(size_t(c.n * c.m));
  mb::cpu::matmul_ref(x.data(), c.n, c.k, DType::BF16, w.bytes.data(), c.m, ref.data());
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

// ---------------------------------------------------------------- bf16 products on rounded inputs

// y = x · wᵀ with Bf16Products::Rounded.
std::vector<float> run_rounded(const Shape& c, const std::vector<float>& x, int64_t ldx, const Weights& w, int64_t ldy) {
  std::vector<float> y(size_t(c.n * ldy) + 1, -7.f);
  mb::cpu::matmul(x.data(), ldx, c.n, c.k, DType::BF16, w.bytes.data(), size_t(c.k) * 2, c.m, y.data(), ldy,
                  mb::cpu::Bf16Products::Rounded);
  return y;
}

// The AVX-512 table with AMX on or off and the VDPBF16PS kernel on (wherever the CPU runs it, fast
// or not), for the scope's lifetime.
struct RoundedScope {
  AmxScope amx;
  bool prev_dot;
  explicit RoundedScope(bool amx_on) : amx(Isa::Avx512, amx_on), prev_dot(mb::cpu::set_avx512_bf16_matmul(true)) {}
  ~RoundedScope() { mb::cpu::set_avx512_bf16_matmul(prev_dot); }
};

// The settings under which each rounded kernel runs here: AMX on (its one-part tiles), AMX off
// (VDPBF16PS); named by rounded_bf16_matmul_kernel().
std::vector<std::pair<std::string, bool>> rounded_kernels() {
  std::vector<std::pair<std::string, bool>> out;
  if (!mb::cpu::kernels_for(Isa::Avx512)) return out;
  for (bool amx : {true, false}) {
    RoundedScope scope(amx);
    const char* name = mb::cpu::rounded_bf16_matmul_kernel();
    if (name && (out.empty() || out.back().first != name)) out.push_back({name, amx});
  }
  return out;
}

// |y - Σ bf16(x)·w| <= 1e-6 Σ|bf16(x)·w| + 1e-6 (the sum in double of the rounded products), all
// finite, nothing written past m.
void expect_near_rounded_products(const Shape& c, const std::vector<float>& x, int64_t ldx, const Weights& w,
                                  const std::vector<float>& y, int64_t ldy, const std::string& what) {
  for (int64_t t = 0; t < c.n; ++t) {
    for (int64_t r = 0; r < c.m; ++r) {
      double sum = 0, mag = 0;
      for (int64_t i = 0; i < c.k; ++i) {
        const double p = double(mb::round_to_bf16(x[size_t(t * ldx + i)])) * w.f32[size_t(r * c.k + i)];
        sum += p;
        mag += std::fabs(p);
      }
      const float got = y[size_t(t * ldy + r)];
      ASSERT_TRUE(std::isfinite(got)) << what << " n=" << c.n << " k=" << c.k << " m=" << c.m << " t=" << t;
      ASSERT_NEAR(got, sum, 1e-6 * mag + 1e-6)
          << what << " n=" << c.n << " k=" << c.k << " m=" << c.m << " t=" << t << " r=" << r;
    }
    for (int64_t r = c.m; r < ldy; ++r) ASSERT_EQ(y[size_t(t * ldy + r)], -7.f) << what << " wrote past m";
  }
  ASSERT_EQ(y.back(), -7.f) << what << " wrote past y";
}

TEST(RoundedBf16Matmul, TheRoundedProductsWithTokenRowAndKTails) {
  const auto kernels = rounded_kernels();
  if (kernels.empty()) GTEST_SKIP() << "no AVX512-BF16 or AMX-BF16 here";
  std::vector<Shape> cases;
  for (int64_t n : {9, 12, 13, 25, 100})
    for (int64_t m : {16, 17, 33, 40})
      for (int64_t k : {1, 2, 17, 31, 32, 33, 100, 257}) cases.push_back({n, k, m});
  for (Shape c : std::vector<Shape>{{300, 768, 300}, {17, 3072, 1000}, {64, 2049, 520}}) cases.push_back(c);
  std::mt19937 rng(21);
  for (const auto& [name, amx] : kernels) {
    RoundedScope scope(amx);
    ASSERT_EQ(std::string(mb::cpu::rounded_bf16_matmul_kernel()), name);
    for (const Shape& c : cases) {
      auto x = randn(size_t(c.n * c.k), rng);
      auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng);
      expect_near_rounded_products(c, x, c.k, w, run_rounded(c, x, c.k, w, c.m), c.m, name);
    }
    // Row strides, and a token's row the same bits in any batch of kAmxMinTokens or more.
    const Shape c{70, 301, 77};
    const int64_t ldx = 310, ldy = 80;
    auto x = randn(size_t(c.n * ldx), rng);
    auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng);
    const auto all = run_rounded(c, x, ldx, w, ldy);
    expect_near_rounded_products(c, x, ldx, w, all, ldy, name);
    for (int64_t n : {mb::cpu::kAmxMinTokens, int64_t(13), int64_t(33)}) {
      const auto part = run_rounded({n, c.k, c.m}, x, ldx, w, ldy);
      for (int64_t i = 0; i < n * ldy; ++i)
        ASSERT_TRUE(same_bits(part[size_t(i)], all[size_t(i)])) << name << " n=" << n << " at " << i;
    }
  }
}

// The same bits on any number of threads (the split moves whole rows and tokens between tasks, never k).
TEST(RoundedBf16Matmul, SameBitsOnAnyThreadCount) {
  const auto kernels = rounded_kernels();
  if (kernels.empty()) GTEST_SKIP() << "no AVX512-BF16 or AMX-BF16 here";
  struct DefaultThreadsAfter {
    ~DefaultThreadsAfter() { mb::ThreadPool::set_global_threads(0); }
  } restore;
  std::mt19937 rng(23);
  for (const Shape& c : {Shape{750, 1024, 1024}, Shape{300, 768, 2048}, Shape{200, 4096, 256}}) {
    auto x = randn(size_t(c.n * c.k), rng);
    auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng);
    for (const auto& [name, amx] : kernels) {
      RoundedScope scope(amx);
      mb::ThreadPool::set_global_threads(1);
      const auto one = run_rounded(c, x, c.k, w, c.m);
      for (int threads : {2, 5, 16}) {
        mb::ThreadPool::set_global_threads(threads);
        const auto many = run_rounded(c, x, c.k, w, c.m);
        for (size_t i = 0; i < one.size(); ++i)
          ASSERT_TRUE(same_bits(one[i], many[i])) << name << " " << c.n << "x" << c.k << "x" << c.m << " on " << threads
                                                  << " threads at " << i;
      }
    }
  }
}

TEST(RoundedBf16Matmul, ExtremeMagnitudesStayFinite) {
  const auto kernels = rounded_kernels();
  if (kernels.empty()) GTEST_SKIP() << "no AVX512-BF16 or AMX-BF16 here";
  std::mt19937 rng(22);
  const Shape c{33, 100, 40};
  for (const auto& [name, amx] : kernels) {
    RoundedScope scope(amx);
    for (float sx : {1e30f, 1e-30f}) {
      auto x = randn(size_t(c.n * c.k), rng, sx);
      auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng);
      expect_near_rounded_products(c, x, c.k, w, run_rounded(c, x, c.k, w, c.m), c.m, name);
    }
    // Activations at the largest floats, whose rounding would carry past the largest bf16, stay
    // finite (truncated there instead).
    std::vector<float> x(size_t(c.n * c.k));
    const float big = std::numeric_limits<float>::max();
    for (size_t i = 0; i < x.size(); ++i) x[i] = (i % 3 ? 1.f : -1.f) * big;
    auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng, 1e-6f);
    const auto y = run_rounded(c, x, c.k, w, c.m);
    for (int64_t i = 0; i < c.n * c.m; ++i) ASSERT_TRUE(std::isfinite(y[size_t(i)])) << name << " at " << i;
  }
}

// Fewer than kAmxMinTokens tokens, other tables, and F32/F16 weights take the exact products.
TEST(RoundedBf16Matmul, ExactWhereNoRoundedKernelRuns) {
  std::mt19937 rng(23);
  for (Isa isa : paths()) {
    AmxScope scope(isa, false);
    for (Shape c : {Shape{mb::cpu::kAmxMinTokens - 1, 300, 50}, Shape{40, 300, 50}}) {
      auto x = randn(size_t(c.n * c.k), rng);
      for (DType dt : {DType::BF16, DType::F16, DType::F32}) {
        if (dt == DType::BF16 && c.n >= mb::cpu::kAmxMinTokens && mb::cpu::rounded_bf16_matmul_kernel()) continue;
        auto w = make_weights(dt, size_t(c.m * c.k), rng);
        std::vector<float> exact(size_t(c.n * c.m)), rounded(size_t(c.n * c.m));
        const size_t stride = size_t(c.k) * mb::dtype_size(dt);
        mb::cpu::matmul(x.data(), c.k, c.n, c.k, dt, w.bytes.data(), stride, c.m, exact.data(), c.m);
        mb::cpu::matmul(x.data(), c.k, c.n, c.k, dt, w.bytes.data(), stride, c.m, rounded.data(), c.m,
                        mb::cpu::Bf16Products::Rounded);
        for (size_t i = 0; i < exact.size(); ++i)
          ASSERT_TRUE(same_bits(exact[i], rounded[i])) << mb::cpu::isa_name(isa) << " " << mb::dtype_name(dt);
      }
    }
  }
}

// A bf16 weight prepared for MatmulRoundedInputs takes the rounded products in Backend::matmul,
// the composite ops built on it work, and a plain Matmul weight stays exact.
TEST(RoundedBf16Matmul, WeightsPreparedForRoundedInputsTakeThem) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(24);
  const Shape c{40, 96, 64};
  auto x = randn(size_t(c.n * c.k), rng);
  auto w = make_weights(DType::BF16, size_t(c.m * c.k), rng);
  mb::Tensor src;
  src.dtype = DType::BF16;
  src.shape = {c.m, c.k};
  src.data = w.bytes.data();
  mb::Tensor xt = mb::host_tensor(DType::F32, {c.n, c.k});
  std::memcpy(xt.data, x.data(), x.size() * 4);
  using Use = mb::Backend::WeightUse;
  for (Use use : {Use::Matmul, Use::MatmulRoundedInputs}) {
    const mb::Tensor wt = be->prepare_weight(src, DType::BF16, use);
    mb::Tensor y = mb::host_tensor(DType::F32, {c.n, c.m});
    be->matmul(xt, wt, y);
    std::vector<float> want(size_t(c.n * c.m));
    mb::cpu::matmul(x.data(), c.k, c.n, c.k, DType::BF16, w.bytes.data(), size_t(c.k) * 2, c.m, want.data(), c.m,
                    use == Use::Matmul ? mb::cpu::Bf16Products::Exact : mb::cpu::Bf16Products::Rounded);
    for (int64_t i = 0; i < c.n * c.m; ++i)
      ASSERT_TRUE(same_bits(y.f32()[i], want[size_t(i)])) << int(use) << " at " << i;
    // Composite ops fall back to their matmuls for such weights.
    mb::Tensor g = mb::host_tensor(DType::F32, {c.n, c.m});
    be->matmul_gelu_mul(xt, wt, wt, g);
    for (int64_t i = 0; i < c.n * c.m; ++i) ASSERT_TRUE(std::isfinite(g.f32()[i]));
    mb::Tensor y2 = mb::host_tensor(DType::F32, {c.n, c.m});
    be->matmuls(xt, {&wt, &wt}, {&y, &y2});
    for (int64_t i = 0; i < c.n * c.m; ++i) ASSERT_TRUE(same_bits(y2.f32()[i], want[size_t(i)]));
  }
}

// matmul_clipped is the clamps (and the activation) around a matmul, bit for bit, whichever kernel
// runs it: the AMX ones clamp as they pack x and store y and activate each finished run of
// outputs, the others in passes of their own. NaNs stay NaN, ±inf bounds leave values alone, x is
// kept.
TEST(RoundedBf16Matmul, ClippedMatmulIsTheClampsAroundIt) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(26);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  using Use = mb::Backend::WeightUse;
  using Act = mb::Backend::Activation;
  std::vector<std::pair<std::string, bool>> settings{{"default", true}};
  for (const auto& k : rounded_kernels()) settings.push_back(k);
  for (const auto& [name, amx] : settings) {
    std::optional<RoundedScope> scope;
    if (name != "default") scope.emplace(amx);
    for (const mb::Backend::Clip clip : {mb::Backend::Clip{-0.5f, 0.75f, -1.f, 1.25f}, mb::Backend::Clip{-kInf, 0.5f, 0.f, kInf},
                                         mb::Backend::Clip{-kInf, kInf, -0.25f, 0.25f}})
      for (int64_t n : {3, 40})
        for (DType dt : {DType::BF16, DType::F32})
          for (Use use : {Use::Matmul, Use::MatmulRoundedInputs})
          for (Act act : {Act::None, Act::Silu, Act::GeluTanhTimes}) {
            if (dt == DType::F32 && use == Use::MatmulRoundedInputs) continue;
            const int64_t k = 70, m = 37;
            auto x = randn(size_t(n * k), rng);
            x[5] = std::numeric_limits<float>::quiet_NaN();
            auto w = make_weights(dt, size_t(m * k), rng);
            mb::Tensor src;
            src.dtype = dt;
            src.shape = {m, k};
            src.data = w.bytes.data();
            const mb::Tensor wt = be->prepare_weight(src, dt, use);
            mb::Tensor xt = mb::host_tensor(DType::F32, {n, k});
            std::memcpy(xt.data, x.data(), x.size() * 4);
            mb::Tensor got = mb::host_tensor(DType::F32, {n, m}), want = mb::host_tensor(DType::F32, {n, m});
            mb::Tensor times = mb::host_tensor(DType::F32, {n, m});
            auto tv = randn(size_t(n * m), rng);
            std::memcpy(times.data, tv.data(), tv.size() * 4);
            be->matmul_clipped(xt, wt, clip, got, act, &times);
            be->Backend::matmul_clipped(xt, wt, clip, want, act, &times);
            for (int64_t i = 0; i < n * k; ++i) ASSERT_TRUE(same_bits(xt.f32()[i], x[size_t(i)])) << "x changed";
            int64_t nans = 0;
            for (int64_t i = 0; i < n * m; ++i) {
              ASSERT_TRUE(same_bits(got.f32()[i], want.f32()[i]))
                  << name << " n=" << n << " " << mb::dtype_name(dt) << " use " << int(use) << " at " << i << ": "
                  << got.f32()[i] << " vs " << want.f32()[i];
              nans += std::isnan(got.f32()[i]);
              if (!std::isnan(got.f32()[i]) && act == Act::None) {
                ASSERT_TRUE(got.f32()[i] >= clip.out_lo && got.f32()[i] <= clip.out_hi);
              }
            }
            EXPECT_EQ(nans, m) << "x's NaN reaches its token's outputs";
            if (act == Act::GeluTanhTimes) {
              EXPECT_THROW(be->matmul_clipped(xt, wt, clip, got, act, nullptr), mb::Error) << "no times";
              mb::Tensor short_times = mb::host_tensor(DType::F32, {n, m - 1});
              EXPECT_THROW(be->matmul_clipped(xt, wt, clip, got, act, &short_times), mb::Error);
            }
          }
  }
}

// An image's attention on the rounded products against torch's CPU SDPA numbers on bf16 tensors,
// in double: s = Σ bf16(q)·bf16(k), e = exp(scale (s - max)), out = Σ bf16(e)·bf16(v) / Σ e. The
// kernel's scores are f32 sums, so an e near a bf16 rounding boundary may land a bf16 step (2^-8)
// away, the dominant one too when the softmax is peaked: bound two such steps of Σ p·|v|, 8e-3.
// Queries past whole blocks, grouped heads, head dims off the tiles.
TEST(RoundedBf16Matmul, WholeImageAttentionIsSdpaOnBf16) {
  const auto kernels = rounded_kernels();
  if (kernels.empty()) GTEST_SKIP() << "no AVX512-BF16 or AMX-BF16 here";
  struct Case {
    int64_t n, keys, nh, nkv, hd;
    float scale;
  };
  std::mt19937 rng(25);
  for (const auto& [name, amx] : kernels) {
    RoundedScope scope(amx);
    for (Case c : {Case{100, 300, 4, 2, 64, 1.f}, Case{64, 256, 2, 2, 40, 0.125f}, Case{150, 520, 3, 1, 72, 0.5f}}) {
      auto q = randn(size_t(c.n * c.nh * c.hd), rng), k = randn(size_t(c.keys * c.nkv * c.hd), rng),
           v = randn(size_t(c.keys * c.nkv * c.hd), rng);
      std::vector<int32_t> pos(size_t(c.n), int32_t(c.keys - 1));
      std::vector<float> out(size_t(c.n * c.nh * c.hd), -7.f);
      mb::cpu::AttnArgs a{q.data(), out.data(), k.data(), v.data(), pos.data(), c.n, c.nh, c.nkv, c.hd, c.keys,
                          false, nullptr, 0, 0, c.scale, 0.f};
      ASSERT_TRUE(mb::cpu::attention_whole_rounded(a)) << name;
      auto r = [](float x) { return double(mb::round_to_bf16(x)); };
      for (int64_t t = 0; t < c.n; ++t)
        for (int64_t h = 0; h < c.nh; ++h) {
          const int64_t g = h / (c.nh / c.nkv);
          std::vector<double> sc(size_t(c.keys));
          double m = -1e300, sum = 0;
          for (int64_t j = 0; j < c.keys; ++j) {
            double d = 0;
            for (int64_t i = 0; i < c.hd; ++i)
              d += r(q[size_t((t * c.nh + h) * c.hd + i)]) * r(k[size_t((j * c.nkv + g) * c.hd + i)]);
            sc[size_t(j)] = c.scale * d;
            m = std::max(m, sc[size_t(j)]);
          }
          for (double& x : sc) sum += x = std::exp(x - m);
          for (int64_t i = 0; i < c.hd; ++i) {
            double want = 0, mag = 0;
            for (int64_t j = 0; j < c.keys; ++j) {
              const double e = sc[size_t(j)], vj = r(v[size_t((j * c.nkv + g) * c.hd + i)]);
              want += r(float(e)) * vj / sum;
              mag += e / sum * std::fabs(vj);
            }
            const float got = out[size_t((t * c.nh + h) * c.hd + i)];
            ASSERT_TRUE(std::isfinite(got));
            ASSERT_NEAR(got, want, 8e-3 * mag + 1e-6) << name << " n=" << c.n << " t=" << t << " h=" << h << " i=" << i;
          }
        }
      // Not its case: a window, a soft-cap, queries that see different keys.
      mb::cpu::AttnArgs w = a;
      w.window = 8;
      EXPECT_FALSE(mb::cpu::attention_whole_rounded(w));
      w = a;
      w.softcap = 30.f;
      EXPECT_FALSE(mb::cpu::attention_whole_rounded(w));
      std::vector<int32_t> causal(size_t(c.n));
      for (int64_t t = 0; t < c.n; ++t) causal[size_t(t)] = int32_t(c.keys - c.n + t);
      w = a;
      w.pos = causal.data();
      EXPECT_FALSE(mb::cpu::attention_whole_rounded(w));
    }
  }
  AmxScope avx2(Isa::Avx2, true);
  std::vector<float> q(64 * 64), kv(256 * 64), out(64 * 64);
  std::vector<int32_t> pos(64, 255);
  mb::cpu::AttnArgs a{q.data(), out.data(), kv.data(), kv.data(), pos.data(), 64, 1, 1, 64, 256, false, nullptr, 0, 0,
                      1.f, 0.f};
  if (mb::cpu::kernels_for(Isa::Avx2)) {
    EXPECT_FALSE(mb::cpu::attention_whole_rounded(a)) << "no rounded kernel on AVX2";
  }
}

// add and mul with b broadcast over a's rows (b's length divides a's), on chunks that split rows.
TEST(KernelElementwise, BroadcastAddAndMulRepeatB) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(27);
  for (auto [n, bn] : {std::pair<int64_t, int64_t>{12, 12}, {12, 1}, {300000, 1000}, {300000, 3}, {196608, 65536}}) {
    mb::Tensor a = mb::host_tensor(DType::F32, {n / bn, bn}), b = mb::host_tensor(DType::F32, {bn}),
               sum = mb::host_tensor(DType::F32, {n / bn, bn}), prod = mb::host_tensor(DType::F32, {n / bn, bn});
    auto va = randn(size_t(n), rng), vb = randn(size_t(bn), rng);
    std::memcpy(a.data, va.data(), size_t(n) * 4);
    std::memcpy(b.data, vb.data(), size_t(bn) * 4);
    be->add(a, b, sum);
    be->mul(a, b, prod);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(sum.f32()[i], va[size_t(i)] + vb[size_t(i % bn)]) << n << " " << bn << " at " << i;
      ASSERT_EQ(prod.f32()[i], va[size_t(i)] * vb[size_t(i % bn)]) << n << " " << bn << " at " << i;
    }
  }
}

// clamp_into is clamp on a copy, and leaves its input as it was.
TEST(KernelElementwise, ClampIntoIsClampOfACopy) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(26);
  for (int64_t n : {1, 17, 100000}) {
    mb::Tensor x = mb::host_tensor(DType::F32, {n}), out = mb::host_tensor(DType::F32, {n}),
               want = mb::host_tensor(DType::F32, {n});
    auto v = randn(size_t(n), rng, 3.f);
    if (n > 3) v[1] = std::numeric_limits<float>::infinity(), v[2] = -v[1], v[3] = std::nanf("");
    std::memcpy(x.data, v.data(), size_t(n) * 4);
    be->clamp_into(x, -1.5f, 2.f, out);
    std::memcpy(want.data, v.data(), size_t(n) * 4);
    be->clamp(want, -1.5f, 2.f);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(same_bits(out.f32()[i], want.f32()[i]) || (std::isnan(out.f32()[i]) && std::isnan(want.f32()[i])));
      ASSERT_TRUE(same_bits(x.f32()[i], v[size_t(i)]) || std::isnan(v[size_t(i)]));
    }
  }
}

TEST(KernelElementwise, EveryPathMatchesTheScalarTwin) {
  std::mt19937 rng(3);
  const mb::cpu::KernelTable& S = *mb::cpu::kernels_for(Isa::Scalar);
  for (Isa isa : paths()) {
    const mb::cpu::KernelTable& K = *mb::cpu::kernels_for(isa);
    for (int64_t n : {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 257, 1000}) {
      auto a = randn(size_t(n) + 1, rng), b = randn(size_t(n) + 1, rng, 3.f);
      double mag = 0;
      for (int64_t i = 0; i < n; ++i) mag += std::fabs(double(a[size_t(i)]) * b[size_t(i)]);
      EXPECT_NEAR(K.dot(a.data(), b.data(), n), mb::cpu::dot_f32_ref(a.data(), b.data(), n), 1e-6 * mag + 1e-30);
      double amag = 0;
      for (int64_t i = 0; i < n; ++i) amag += std::fabs(a[size_t(i)]);
      EXPECT_NEAR(K.sum(a.data(), n), S.sum(a.data(), n), 1e-6 * amag + 1e-30);

      std::vector<float> y1 = b, y2 = b;
      K.axpy(0.37f, a.data(), y1.data(), n);
      S.axpy(0.37f, a.data(), y2.data(), n);
      for (size_t i = 0; i < y1.size(); ++i) ASSERT_NEAR(y1[i], y2[i], 1e-6f * (std::fabs(y2[i]) + 1)) << i;
      EXPECT_EQ(y1.back(), b.back()) << "axpy wrote past n";

      std::vector<float> g1(size_t(n) + 1, 9.f), g2(size_t(n) + 1, 9.f);
      K.gelu_tanh_mul(b.data(), a.data(), g1.data(), n);
      S.gelu_tanh_mul(b.data(), a.data(), g2.data(), n);
      for (size_t i = 0; i < g1.size(); ++i)
        ASSERT_NEAR(g1[i], g2[i], 2e-6f * std::fabs(g2[i]) + 1e-6f * std::fabs(a[i]) + 1e-30f)
            << mb::cpu::isa_name(isa) << " gelu(" << b[i] << ")";
      std::vector<float> s1 = b, s2 = b;
      K.silu(s1.data(), n);
      S.silu(s2.data(), n);
      for (size_t i = 0; i < s1.size(); ++i)
        ASSERT_NEAR(s1[i], s2[i], 2e-6f * std::fabs(s2[i]) + 1e-30f) << mb::cpu::isa_name(isa) << " silu(" << b[i] << ")";
      std::vector<float> u1(size_t(n) + 1, 9.f), u2(size_t(n) + 1, 9.f);
      K.glu(a.data(), b.data(), u1.data(), n);
      S.glu(a.data(), b.data(), u2.data(), n);
      for (size_t i = 0; i < u1.size(); ++i)
        ASSERT_NEAR(u1[i], u2[i], 2e-6f * std::fabs(u2[i]) + 1e-30f) << mb::cpu::isa_name(isa) << " glu(" << b[i] << ")";
      if (n > 0) {
        std::vector<float> m1 = b, m2 = b;
        const float sum1 = K.exp_sum_row(m1.data(), n, 0.7f), sum2 = S.exp_sum_row(m2.data(), n, 0.7f);
        EXPECT_NEAR(sum1, sum2, 2e-6f * sum2) << mb::cpu::isa_name(isa);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_NEAR(m1[size_t(i)], m2[size_t(i)], 2e-6f * m2[size_t(i)] + 1e-30f) << mb::cpu::isa_name(isa) << " exp";
        EXPECT_EQ(m1.back(), b.back()) << "exp_sum_row wrote past n";
      }
      EXPECT_EQ(s1.back(), b.back()) << "silu wrote past n";
      // In place, as the model calls it.
      std::vector<float> g3 = b;
      K.gelu_tanh_mul(g3.data(), a.data(), g3.data(), n);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(g3[size_t(i)], g1[size_t(i)]);

      for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
        auto w = make_weights(dt, size_t(n), rng);
        std::vector<float> o(size_t(n) + 1, 5.f);
        K.to_f32(mb::cpu::wtype(dt), w.bytes.data(), o.data(), n);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(o[size_t(i)], w.f32[size_t(i)]) << mb::dtype_name(dt);
        EXPECT_EQ(o.back(), 5.f);
      }
    }
  }
  // Extremes of the gelu and the half conversion.
  for (Isa isa : paths()) {
    const mb::cpu::KernelTable& K = *mb::cpu::kernels_for(isa);
    std::vector<float> g = {-1e30f, -100.f, -10.f, -1e-20f, 0.f, 1e-20f, 3.f, 50.f, 1e30f}, one(g.size(), 1.f);
    std::vector<float> o1(g.size()), o2(g.size());
    K.gelu_tanh_mul(g.data(), one.data(), o1.data(), int64_t(g.size()));
    S.gelu_tanh_mul(g.data(), one.data(), o2.data(), int64_t(g.size()));
    for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(o1[i], o2[i], 1e-6f * std::fabs(o2[i]) + 1e-30f) << g[i];
    std::vector<float> s1 = g, s2 = g;
    K.silu(s1.data(), int64_t(s1.size()));
    S.silu(s2.data(), int64_t(s2.size()));
    for (size_t i = 0; i < g.size(); ++i) {
      EXPECT_TRUE(std::isfinite(s1[i])) << g[i];
      EXPECT_NEAR(s1[i], s2[i], 1e-6f * std::fabs(s2[i]) + 1e-30f) << g[i];
    }
    std::vector<float> u1(g.size()), u2(g.size()), x(g.size(), -3.f);
    K.glu(x.data(), g.data(), u1.data(), int64_t(g.size()));
    S.glu(x.data(), g.data(), u2.data(), int64_t(g.size()));
    for (size_t i = 0; i < g.size(); ++i) {
      EXPECT_TRUE(std::isfinite(u1[i])) << g[i];
      EXPECT_NEAR(u1[i], u2[i], 1e-6f * std::fabs(u2[i]) + 1e-30f) << g[i];
    }
    const std::vector<uint16_t> halves = {0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0x7c00, 0xfc00, 0xc000};
    std::vector<float> hv(halves.size());
    K.to_f32(mb::cpu::WType::F16, halves.data(), hv.data(), int64_t(halves.size()));
    for (size_t i = 0; i < halves.size(); ++i) EXPECT_EQ(hv[i], mb::f16_to_f32(halves[i])) << std::hex << halves[i];
  }
}

// The logit softcap: within 2e-6 of cap * std::tanh(x / cap) (relative, or absolute in units of
// cap) across the range a model produces, including the switch between the two tanh forms, exact
// zeros and saturation; tails of every length stay untouched past n.
TEST(KernelElementwise, SoftcapMatchesStdTanh) {
  std::mt19937 rng(8);
  for (Isa isa : paths()) {
    const mb::cpu::KernelTable& K = *mb::cpu::kernels_for(isa);
    for (float cap : {30.f, 50.f}) {
      std::vector<float> x = randn(4000, rng, 40.f);
      for (float v : {0.f, -0.f, 1e-30f, -1e-20f, 7.4999f, 7.5f, 7.5001f, -7.5f, 1e4f, -1e4f, 1e30f, -1e30f})
        x.push_back(v * cap / 30.f);
      for (int i = 0; i < 200; ++i) x.push_back(cap * (0.2f + 0.0005f * float(i)));  // around |x / cap| = 1/4
      const int64_t n = int64_t(x.size()) - 3;
      std::vector<float> y = x;
      K.softcap(y.data(), n, cap);
      for (int64_t i = 0; i < n; ++i) {
        const double want = double(cap) * std::tanh(double(x[size_t(i)]) / double(cap));
        ASSERT_TRUE(std::isfinite(y[size_t(i)]));
        ASSERT_NEAR(y[size_t(i)], want, 2e-6 * std::max(std::fabs(want), 1e-3 * cap) + 1e-37)
            << mb::cpu::isa_name(isa) << " x " << x[size_t(i)];
      }
      for (size_t i = size_t(n); i < x.size(); ++i) EXPECT_EQ(y[i], x[i]);
    }
  }
}

// Fills a KV store as the runtime does (positions 0..len-1 in order, ring slots overwritten) and
// runs attention for the last n positions.
struct AttnCase {
  int64_t n, nh, nkv, hd, len;
  int window;
  bool ring;
  float softcap, scale;
};

void run_attention_case(const AttnCase& c, std::mt19937& rng) {
  const int64_t cap = c.ring ? c.window - 1 + c.n : c.len;
  const int64_t row = c.nkv * c.hd;
  auto kst = randn(size_t(cap * row), rng), vst = randn(size_t(cap * row), rng);
  // Positions written so far overwrite ring slots in order; keep the last writer's values.
  for (int64_t p = 0; p < c.len; ++p) {
    const int64_t s = c.ring ? p % cap : p;
    auto kr = randn(size_t(row), rng, 0.5f), vr = randn(size_t(row), rng);
    std::copy(kr.begin(), kr.end(), kst.begin() + s * row);
    std::copy(vr.begin(), vr.end(), vst.begin() + s * row);
  }
  auto q = randn(size_t(c.n * c.nh * c.hd), rng, 0.5f);
  std::vector<int32_t> pos(static_cast<size_t>(c.n));
  for (int64_t t = 0; t < c.n; ++t) pos[size_t(t)] = int32_t(c.len - c.n + t);
  // Reference in double. f32 scores carry a rounding error that grows with their size, so the
  // tolerance is relative to the largest score.
  std::vector<double> ref(q.size());
  double smax = 0;
  for (int64_t t = 0; t < c.n; ++t)
    for (int64_t h = 0; h < c.nh; ++h) {
      const int64_t g = h / (c.nh / c.nkv), hi = pos[size_t(t)];
      const int64_t lo = c.window > 0 ? std::max<int64_t>(0, hi - c.window + 1) : 0;
      std::vector<double> sc;
      double mx = -1e300;
      for (int64_t j = lo; j <= hi; ++j) {
        const int64_t slot = c.ring ? j % cap : j;
        double d = 0;
        for (int64_t i = 0; i < c.hd; ++i) d += double(q[size_t((t * c.nh + h) * c.hd + i)]) * kst[size_t(slot * row + g * c.hd + i)];
        d *= c.scale;
        if (c.softcap > 0) d = c.softcap * std::tanh(d / c.softcap);
        smax = std::max(smax, std::fabs(d));
        sc.push_back(d);
        mx = std::max(mx, d);
      }
      double sum = 0;
      for (auto& x : sc) sum += (x = std::exp(x - mx));
      for (int64_t j = lo; j <= hi; ++j) {
        const int64_t slot = c.ring ? j % cap : j;
        for (int64_t i = 0; i < c.hd; ++i)
          ref[size_t((t * c.nh + h) * c.hd + i)] += sc[size_t(j - lo)] / sum * vst[size_t(slot * row + g * c.hd + i)];
      }
    }
  const double tol = 2e-6 * (1 + smax);
  std::vector<float> out;
  mb::cpu::AttnArgs a{q.data(), nullptr, kst.data(), vst.data(), pos.data(), c.n, c.nh, c.nkv, c.hd, cap,
                      c.ring, nullptr, 0, c.window, c.scale, c.softcap};
  for (Isa isa : paths()) {
    UseIsa u(isa);
    out.assign(ref.size() + 1, -1.f);
    a.out = out.data();
    mb::cpu::attention(a);
    ASSERT_EQ(out.back(), -1.f);
    for (size_t i = 0; i < ref.size(); ++i)
      ASSERT_NEAR(out[i], ref[i], tol * (1 + std::fabs(ref[i])))
          << mb::cpu::isa_name(isa) << " n=" << c.n << " nh=" << c.nh << " nkv=" << c.nkv << " hd=" << c.hd
          << " len=" << c.len << " window=" << c.window << " ring=" << c.ring << " i=" << i;
    if (isa == Isa::Scalar || c.ring) continue;
    // Batch invariance: each token alone gives the bits it got in the block.
    std::vector<float> one(static_cast<size_t>(c.nh * c.hd));
    for (int64_t t = 0; t < c.n; t += std::max<int64_t>(1, c.n / 3)) {
      mb::cpu::AttnArgs b = a;
      b.q = q.data() + t * c.nh * c.hd;
      b.pos = pos.data() + t;
      b.n = 1;
      b.out = one.data();
      mb::cpu::attention(b);
      for (int64_t i = 0; i < c.nh * c.hd; ++i)
        ASSERT_TRUE(same_bits(one[size_t(i)], out[size_t(t * c.nh * c.hd + i)])) << mb::cpu::isa_name(isa) << " t=" << t;
    }
  }
}

TEST(KernelAttention, EveryPathMatchesDoublePrecision) {
  std::mt19937 rng(4);
  const std::vector<AttnCase> cases = {
      {1, 1, 1, 1, 1, 0, false, 0.f, 1.f},       {1, 8, 1, 256, 72, 0, false, 0.f, 1.f},
      {1, 8, 1, 256, 600, 512, true, 0.f, 1.f},  {64, 8, 1, 256, 64, 512, true, 0.f, 1.f},
      {37, 8, 2, 512, 50, 0, false, 0.f, 1.f},   {5, 6, 3, 33, 40, 7, true, 0.f, 0.125f},
      {17, 4, 4, 16, 17, 3, true, 30.f, 1.f},    {3, 2, 1, 5, 9, 0, false, 50.f, 0.7f},
      {40, 3, 1, 64, 100, 31, false, 0.f, 1.f},  {20, 8, 8, 80, 45, 0, false, 0.f, 0.1f},
      {2, 4, 2, 17, 2, 0, false, 0.f, 1.f},      {33, 1, 1, 48, 33, 1, true, 0.f, 1.f},
      // Long contexts: many key splits, folded inside one task for the block and run as parallel
      // splits for each token alone (the batch-invariance check below compares the two).
      {9, 8, 1, 256, 700, 0, false, 0.f, 0.0625f},  {3, 4, 2, 72, 300, 130, false, 30.f, 0.2f},
  };
  for (const AttnCase& c : cases) run_attention_case(c, rng);
  for (int i = 0; i < 12; ++i) {
    AttnCase c;
    c.nkv = 1 + rng() % 3;
    c.nh = c.nkv * (1 + rng() % 4);
    c.hd = 1 + rng() % 70;
    c.n = 1 + rng() % 40;
    c.len = c.n + rng() % 80;
    c.window = rng() % 2 ? 1 + int(rng() % 50) : 0;
    c.ring = c.window > 0 && rng() % 2;
    c.softcap = rng() % 3 == 0 ? 20.f : 0.f;
    c.scale = 0.05f + float(rng() % 100) / 100.f;
    run_attention_case(c, rng);
  }
}

TEST(KernelAttention, SequencesInOneCallEqualEachAlone) {
  // A decode batch: sequences of different lengths (one of them a ring past its window, one a
  // short prompt block) in one call give the bits each gets alone, on every path.
  std::mt19937 rng(9);
  struct Seq {
    int64_t n, len;
    bool ring;
  };
  const int64_t nh = 8, nkv = 1, hd = 64;
  const int window = 24;
  const std::vector<Seq> seqs = {{1, 5, false}, {1, 90, true}, {3, 40, false}, {1, 1, false}, {1, 33, true}};
  std::vector<std::vector<float>> ks, vs, qs;
  std::vector<std::vector<int32_t>> ps;
  std::vector<mb::cpu::AttnArgs> args;
  for (const Seq& q : seqs) {
    const int64_t cap = q.ring ? window - 1 + q.n : q.len;
    ks.push_back(randn(size_t(cap * nkv * hd), rng, 0.5f));
    vs.push_back(randn(size_t(cap * nkv * hd), rng));
    qs.push_back(randn(size_t(q.n * nh * hd), rng, 0.5f));
    std::vector<int32_t> pos;
    for (int64_t t = 0; t < q.n; ++t) pos.push_back(int32_t(q.len - q.n + t));
    ps.push_back(pos);
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t cap = seqs[i].ring ? window - 1 + seqs[i].n : seqs[i].len;
    args.push_back({qs[i].data(), nullptr, ks[i].data(), vs[i].data(), ps[i].data(), seqs[i].n, nh, nkv, hd, cap,
                    seqs[i].ring, nullptr, 0, seqs[i].ring ? window : 0, 0.125f, 0.f});
  }
  for (Isa isa : paths()) {
    UseIsa u(isa);
    std::vector<std::vector<float>> together(seqs.size()), alone(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      together[i].assign(size_t(seqs[i].n * nh * hd), -1.f);
      alone[i].assign(size_t(seqs[i].n * nh * hd), -2.f);
      args[i].out = together[i].data();
    }
    mb::cpu::attention(args.data(), int64_t(args.size()));
    for (size_t i = 0; i < seqs.size(); ++i) {
      mb::cpu::AttnArgs one = args[i];
      one.out = alone[i].data();
      mb::cpu::attention(one);
      for (size_t j = 0; j < alone[i].size(); ++j)
        ASSERT_TRUE(same_bits(together[i][j], alone[i][j]) && std::isfinite(alone[i][j]))
            << mb::cpu::isa_name(isa) << " seq " << i << " j " << j;
    }
  }
}

TEST(KernelAttention, BackendOpUsesTheRingAndWindow) {
  // The backend op over a KVStore: a window-3 ring of 4 rows after 10 positions.
  auto be = mb::make_cpu_backend();
  for (Isa isa : paths()) {
    UseIsa u(isa);
    mb::KVStore kv;
    kv.capacity = 4;
    kv.ring = true;
    kv.k = be->alloc(DType::F32, {4, 1, 2});
    kv.v = be->alloc(DType::F32, {4, 1, 2});
    mb::AttentionParams ap;
    ap.window = 3;
    for (int32_t p = 0; p < 10; ++p) {
      mb::Tensor k = be->alloc(DType::F32, {1, 1, 2}), v = be->alloc(DType::F32, {1, 1, 2});
      k.f32()[0] = 0.f;
      v.f32()[0] = float(p);
      v.f32()[1] = 1.f;
      be->kv_write(kv, k, v, &p);
      mb::Tensor q = be->alloc(DType::F32, {1, 1, 2}), o = be->alloc(DType::F32, {1, 1, 2});
      be->attention(q, kv, &p, ap, o);
      const float lo = float(std::max(0, p - 2));
      EXPECT_NEAR(o.f32()[0], (lo + float(p)) / 2.f, 1e-5) << mb::cpu::isa_name(isa) << " p=" << p;
      EXPECT_NEAR(o.f32()[1], 1.f, 1e-6);
    }
  }
}

// ---------------------------------------------------------------- thread pool

TEST(ThreadPoolContract, EveryIndexOnceForAnySplit) {
  mb::ThreadPool pool(3);
  for (int64_t n : {0, 1, 2, 5, 64, 1000, 100003})
    for (int64_t grain : {1, 3, 64, 1 << 20}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
        ASSERT_LE(0, b);
        ASSERT_LE(b, e);
        ASSERT_LE(e, n);
        for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << n << " " << grain << " " << i;
    }
  std::vector<std::atomic<int>> each(static_cast<size_t>(pool.size()));
  pool.run_on_all([&](int i, int nt) {
    EXPECT_EQ(nt, pool.size());
    each[size_t(i)]++;
  });
  for (auto& c : each) EXPECT_EQ(c.load(), 1);
}

TEST(ThreadPoolContract, NestedConcurrentAndThrowingRegions) {
  mb::ThreadPool pool(2);
  std::atomic<int64_t> total{0};
  // A region inside a region runs inline on the thread that reached it.
  pool.parallel_for(8, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      pool.parallel_for(100, 1, [&](int64_t b2, int64_t e2) { total += e2 - b2; });
  });
  EXPECT_EQ(total.load(), 800);
  // Two threads submitting at once: one runs its region inline.
  std::atomic<int64_t> a{0}, b{0};
  std::thread other([&] {
    for (int r = 0; r < 200; ++r) pool.parallel_for(1000, 1, [&](int64_t x, int64_t y) { a += y - x; });
  });
  for (int r = 0; r < 200; ++r) pool.parallel_for(1000, 1, [&](int64_t x, int64_t y) { b += y - x; });
  other.join();
  EXPECT_EQ(a.load(), 200000);
  EXPECT_EQ(b.load(), 200000);
  // An exception from the caller's chunk propagates after the workers are out of the region.
  const auto caller = std::this_thread::get_id();
  EXPECT_THROW(pool.parallel_for(1000, 1,
                                 [&](int64_t, int64_t) {
                                   if (std::this_thread::get_id() == caller) throw std::runtime_error("chunk failed");
                                   std::this_thread::sleep_for(std::chrono::milliseconds(2));
                                 }),
               std::runtime_error);
  std::atomic<int64_t> after{0};
  pool.parallel_for(1000, 1, [&](int64_t x, int64_t y) { after += y - x; });
  EXPECT_EQ(after.load(), 1000);
}

// More workers than cores: workers are descheduled between seeing a region and joining it, so
// the join handshake's every outcome occurs (joined, stayed out after publishing its tag, too late
// to look), as do the caller's sleeps on a slow worker. No chunk may be lost or run twice.
TEST(ThreadPoolContract, OversubscribedRegionsLoseNoChunk) {
  mb::ThreadPool pool(4 * int(std::max(1u, std::thread::hardware_concurrency())));
  std::mt19937 rng(5);
  for (int r = 0; r < 3000; ++r) {
    const int64_t n = 1 + int64_t(rng() % 300);
    const bool slow = r % 500 == 0;  // a chunk past the caller's spin: the caller sleeps
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    pool.parallel_for(n, 1, [&](int64_t b, int64_t e) {
      if (slow && b == n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << "region " << r << " index " << i;
  }
}

// Regions that carry an Ahead (the successor's streams, for the workers to prefetch) run their
// chunks exactly as without one, whatever the plan: one that matches the next region, one whose
// ranges overrun the buffer or are empty, a null base, a budget far beyond what fits between two
// regions (the workers must leave it when the next region opens), and regions without a plan in
// between. The buffer the plans point at is only ever read.
TEST(ThreadPoolContract, RegionsWithAheadPlansLoseNoChunk) {
  std::vector<uint8_t> buf(size_t(32) << 20, 7);
  for (int threads : {2, 5, 4 * int(std::max(1u, std::thread::hardware_concurrency()))}) {
    mb::ThreadPool pool(threads);
    std::mt19937 rng(11);
    for (int r = 0; r < 1500; ++r) {
      const int64_t n = 1 + int64_t(rng() % 400), grain = 1 + int64_t(rng() % 8);
      mb::ThreadPool::Ahead ahead;
      ahead.n = 1 + int64_t(rng() % 400);
      ahead.grain = 1 + int64_t(rng() % 8);
      ahead.budget = r % 7 == 0 ? buf.size() : size_t(rng() % (256 << 10));
      ahead.streams = int(rng() % 4);
      for (int i = 0; i < ahead.streams; ++i) {
        const int32_t lo = int32_t(rng() % 300), hi = lo + int32_t(rng() % 200);
        ahead.s[i] = {r % 11 == 0 ? nullptr : buf.data(), lo, hi, size_t(1) << (rng() % 18), int32_t(rng() % 5)};
      }
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
      }, r % 3 == 2 ? nullptr : &ahead);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << threads << " " << r << " " << i;
    }
  }
  EXPECT_EQ(std::count(buf.begin(), buf.end(), uint8_t(7)), std::ptrdiff_t(buf.size()));
}

// The trace behind ahead_after: each region gets the plan of the region that followed it last
// time; a region without a key of its own is told apart by the region before it.
TEST(ThreadPoolContract, AheadAfterReturnsThePlanOfTheRegionThatFollowedLastTime) {
  auto plan = [](int64_t n) {
    mb::ThreadPool::Ahead a;
    a.n = n;
    a.budget = 4096;
    return a;
  };
  // Keys unique to this test, so earlier regions on this thread do not matter.
  static const char keys[4] = {};
  const void *qkv1 = &keys[0], *out1 = &keys[1], *qkv2 = &keys[2], *out2 = &keys[3];
  const std::vector<std::pair<const void*, int64_t>> step = {{qkv1, 10}, {nullptr, 11}, {out1, 12},
                                                             {qkv2, 20}, {nullptr, 21}, {out2, 22}};
  for (const auto& [key, n] : step) mb::ThreadPool::ahead_after(key, plan(n));  // the first step
  for (size_t i = 0; i < step.size(); ++i) {
    const mb::ThreadPool::Ahead* next = mb::ThreadPool::ahead_after(step[i].first, plan(step[i].second));
    if (i + 1 < step.size()) {
      ASSERT_NE(next, nullptr) << i;
      EXPECT_EQ(next->n, step[i + 1].second) << i;
    }
  }
  mb::ThreadPool::Ahead off = plan(5);
  off.budget = 0;
  EXPECT_EQ(mb::ThreadPool::ahead_after(qkv1, off), nullptr);
}

// A pool destroyed right after a region joins every worker: a worker that passed its stop check and
// then took the destructor's tag change as an ordinary one slept on, and the join waited forever
// (seen once at a test process's exit). Thousands of create-run-destroy cycles under a watchdog.
TEST(ThreadPoolContract, DestroyedRightAfterARegionJoinsEveryWorker) {
  std::atomic<bool> finished{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 1200 && !finished; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!finished) {
      std::fprintf(stderr, "ThreadPool's destructor did not join its workers within 120 s\n");
      std::fflush(stderr);
      std::_Exit(1);
    }
  });
  for (int cycle = 0; cycle < 20000; ++cycle) {
    mb::ThreadPool pool(2 + cycle % 3);
    std::atomic<int64_t> s{0};
    pool.parallel_for(64, 1, [&](int64_t b, int64_t e) { s += e - b; });
    ASSERT_EQ(s.load(), 64);
  }
  finished = true;
  watchdog.join();
}

TEST(ThreadPoolContract, SleepsAndWakesBetweenRegions) {
  mb::ThreadPool pool(2);
  for (int r = 0; r < 3; ++r) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // past the spin: workers sleep
    std::atomic<int64_t> s{0};
    pool.parallel_for(1 << 16, 1, [&](int64_t b, int64_t e) { s += e - b; });
    EXPECT_EQ(s.load(), 1 << 16);
  }
}

}  // namespace

namespace {

// The CPU backend's fused ops give exactly the numbers of the single ops they replace (the
// Backend defaults), for every norm flavour, with zero frequencies (unrotated pairs) and a scale.
TEST(BackendFusedOps, EqualTheSingleOpsTheyReplace) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(9);
  const int64_t n = 5, heads = 3, hd = 64, d = 96;
  auto fill = [&](mb::Tensor& t, float sd) {
    auto v = randn(size_t(t.numel()), rng, sd);
    std::copy(v.begin(), v.end(), t.f32());
  };
  mb::Tensor w_hd = mb::host_tensor(DType::F32, {hd}), w_d = mb::host_tensor(DType::F32, {d});
  fill(w_hd, 0.5f);
  fill(w_d, 0.5f);
  std::vector<int32_t> pos = {0, 1, 7, 300, 4095};
  std::vector<float> inv_freq(size_t(hd / 2), 0.f);
  for (int64_t j = 0; j < hd / 4; ++j) inv_freq[size_t(j)] = std::pow(10000.f, -float(2 * j) / float(hd));
  for (bool add_one : {false, true})
    for (const mb::Tensor* w : std::vector<const mb::Tensor*>{nullptr, &w_hd}) {
      mb::Tensor a = mb::host_tensor(DType::F32, {n, heads, hd}), b = mb::host_tensor(DType::F32, {n, heads, hd});
      fill(a, 2.f);
      std::copy(a.f32(), a.f32() + a.numel(), b.f32());
      be->rms_norm_rope(a, w, 1e-6f, add_one, pos.data(), inv_freq.data());
      be->mb::Backend::rms_norm_rope(b, w, 1e-6f, add_one, pos.data(), inv_freq.data());
      for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.f32()[i], b.f32()[i]) << i;
    }
  for (float scale : {1.f, 0.7f})
    for (const mb::Tensor* w : std::vector<const mb::Tensor*>{nullptr, &w_d}) {
      mb::Tensor x1 = mb::host_tensor(DType::F32, {n, d}), x2 = mb::host_tensor(DType::F32, {n, d});
      mb::Tensor r1 = mb::host_tensor(DType::F32, {n, d}), r2 = mb::host_tensor(DType::F32, {n, d});
      fill(x1, 3.f);
      fill(r1, 1.f);
      std::copy(x1.f32(), x1.f32() + x1.numel(), x2.f32());
      std::copy(r1.f32(), r1.f32() + r1.numel(), r2.f32());
      be->add_rms_norm(x1, r1, w, 1e-6f, true, scale);
      be->mb::Backend::add_rms_norm(x2, r2, w, 1e-6f, true, scale);
      for (int64_t i = 0; i < x1.numel(); ++i) {
        ASSERT_EQ(x1.f32()[i], x2.f32()[i]) << i;
        ASSERT_TRUE(std::isfinite(x1.f32()[i]));
      }
    }
}


// The CPU backend keeps the cos/sin tables of recent rotations: a call whose positions or
// frequencies changed in place (same pointers) must not reuse them. Each result equals that of a
// fresh backend, which has nothing kept.
TEST(BackendRope, KeptAnglesFollowChangedPositionsAndFrequencies) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(10);
  const int64_t n = 3, heads = 2, hd = 32;
  std::vector<int32_t> pos = {0, 5, 9};
  std::vector<float> inv_freq(size_t(hd / 2));
  for (int64_t j = 0; j < hd / 2; ++j) inv_freq[size_t(j)] = j % 5 == 4 ? 0.f : std::pow(10000.f, -float(2 * j) / float(hd));
  auto x0 = randn(size_t(n * heads * hd), rng, 1.f);
  auto rotated = [&](mb::Backend& b) {
    mb::Tensor x = mb::host_tensor(DType::F32, {n, heads, hd});
    std::copy(x0.begin(), x0.end(), x.f32());
    b.rope(x, pos.data(), inv_freq.data());
    return std::vector<float>(x.f32(), x.f32() + x.numel());
  };
  auto expect_fresh = [&](const char* what) {
    auto fresh = mb::make_cpu_backend();
    const auto got = rotated(*be), want = rotated(*fresh);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << what << " at " << i;
    const size_t t1 = size_t(heads * hd);  // token 1, head 0: a position other than 0
    for (int64_t j = 0; j < hd / 2; ++j) {
      const size_t a = t1 + size_t(j), b = a + size_t(hd / 2);
      if (inv_freq[size_t(j)] == 0.f) {
        ASSERT_EQ(got[a], x0[a]) << "unrotated pair " << j;
        ASSERT_EQ(got[b], x0[b]) << "unrotated pair " << j;
      } else {
        ASSERT_NE(got[a], x0[a]) << "rotated pair " << j;
      }
    }
  };
  expect_fresh("first call");
  expect_fresh("same positions again");
  pos[1] = 6;
  expect_fresh("a position changed in place");
  inv_freq[3] *= 0.5f;
  expect_fresh("a frequency changed in place");
  pos = {0, 5, 9};
  expect_fresh("back to the first positions");
}

}  // namespace

// The serving runtime's paged KV: keys and values scattered over a pool's pages in any order give
// the bits the same rows give in one contiguous store, for prefill blocks, windows and decode
// (including the split-key path a single decode token takes on many threads).
TEST(Attention, PagedRowsGiveTheContiguousBits) {
  std::mt19937 rng(11);
  const int64_t nh = 8, nkv = 2, hd = 64, len = 300, page = 32, n_pages = (len + page - 1) / page;
  const int64_t row = nkv * hd;
  const auto k = randn(size_t(len * row), rng, 0.5f), v = randn(size_t(len * row), rng);
  // Pool of 2 x n_pages pages; the sequence's pages in a scrambled order, a page of -1 first
  // (out of every window below it is never read).
  std::vector<int32_t> pages(static_cast<size_t>(n_pages));
  for (int64_t p = 0; p < n_pages; ++p) pages[size_t(p)] = int32_t((p * 7 + 3) % (2 * n_pages));
  std::vector<float> pk(size_t(2 * n_pages * page * row), std::nanf("")), pv = pk;
  for (int64_t j = page; j < len; ++j) {
    const int64_t r = pages[size_t(j / page)] * page + j % page;
    std::copy_n(k.begin() + j * row, row, pk.begin() + r * row);
    std::copy_n(v.begin() + j * row, row, pv.begin() + r * row);
  }
  pages[0] = -1;
  for (const int64_t n : {int64_t(1), int64_t(5), int64_t(40)})
    for (const int window : {0, 64}) {
      const auto q = randn(size_t(n * nh * hd), rng, 0.5f);
      std::vector<int32_t> pos;
      for (int64_t t = 0; t < n; ++t) pos.push_back(int32_t(len - n + t));
      std::vector<int32_t> table = pages;
      if (window == 0) {  // every key from 0 is read: the first page gets its rows back
        table[0] = 0;  // (p * 7 + 3) % 20 is never 0 for p < 10: a page no other entry uses
        for (int64_t j = 0; j < page; ++j) {
          std::copy_n(k.begin() + j * row, row, pk.begin() + (table[0] * page + j) * row);
          std::copy_n(v.begin() + j * row, row, pv.begin() + (table[0] * page + j) * row);
        }
      }
      std::vector<float> flat(size_t(n * nh * hd)), paged(flat.size());
      mb::cpu::AttnArgs a{q.data(), flat.data(), k.data(), v.data(), pos.data(), n, nh, nkv, hd, len,
                          false, nullptr, 0, window, 0.125f, 0.f};
      mb::cpu::AttnArgs b = a;
      b.out = paged.data();
      b.k = pk.data();
      b.v = pv.data();
      b.capacity = 2 * n_pages * page;
      b.pages = table.data();
      b.page_size = page;
      for (Isa isa : paths()) {
        UseIsa u(isa);
        mb::cpu::attention(&a, 1);
        mb::cpu::attention(&b, 1);
        for (size_t i = 0; i < flat.size(); ++i)
          ASSERT_EQ(flat[i], paged[i]) << mb::cpu::isa_name(isa) << " n=" << n << " window=" << window << " i=" << i;
      }
    }
}

// ---------------------------------------------------------------- the media towers' ops
// Each against its definition in backend.h, computed here in double from scratch (not through the
// backend's code), on odd sizes and the edges: masked rows, the first frames of a causal
// convolution, queries with no valid key.

namespace tower {

mb::Tensor filled(std::vector<int64_t> shape, std::mt19937& rng, float sd) {
  mb::Tensor t = mb::host_tensor(DType::F32, std::move(shape));
  auto v = randn(size_t(t.numel()), rng, sd);
  std::copy(v.begin(), v.end(), t.f32());
  return t;
}

// Largest |got - want| over the largest |want|, and whether every value is finite.
double rel_err(const float* got, const std::vector<double>& want) {
  double diff = 0, top = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff = std::max(diff, std::fabs(double(got[i]) - want[i]));
    top = std::max(top, std::fabs(want[i]));
  }
  return diff / top;
}

}  // namespace tower

TEST(BackendTowerOps, Im2colTimesTheWeightIsTheConvolution) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(31);
  struct Case {
    int64_t h, w, c, co;
    mb::Backend::Im2col conv;
  };
  for (const Case& k : {Case{11, 9, 3, 5, {3, 2, 1}}, Case{6, 7, 1, 4, {3, 2, 1}}, Case{5, 8, 4, 3, {2, 1, 0}},
                        Case{4, 5, 2, 2, {3, 1, 2}}}) {
    mb::Tensor x = tower::filled({k.h, k.w, k.c}, rng, 1.f);
    const int64_t kk = k.conv.kernel, patch = k.c * kk * kk;
    mb::Tensor wt = tower::filled({k.co, patch}, rng, 0.5f);  // [C_out, C, k, k] flattened
    std::vector<uint8_t> valid(size_t(k.h), 1);
    valid[1] = valid[size_t(k.h - 1)] = 0;
    const int64_t ho = (k.h + 2 * k.conv.pad - kk) / k.conv.stride + 1, wo = (k.w + 2 * k.conv.pad - kk) / k.conv.stride + 1;
    // The output rows in two calls (row0 > 0 for the second), as the audio tower's passes make them.
    mb::Tensor y = mb::host_tensor(DType::F32, {ho * wo, k.co});
    const int64_t split = ho / 2;
    for (auto [r0, rows] : {std::pair<int64_t, int64_t>{0, split}, {split, ho - split}}) {
      if (rows == 0) continue;
      mb::Tensor cols = mb::host_tensor(DType::F32, {rows, wo, patch});
      be->im2col(x, valid.data(), k.conv, r0, cols);
      mb::Tensor part = y.slice_rows(r0 * wo, rows * wo);
      be->matmul(cols.reshaped({rows * wo, patch}), wt, part);
    }
    std::vector<double> want(size_t(ho * wo * k.co), 0.0);
    for (int64_t oy = 0; oy < ho; ++oy)
      for (int64_t ox = 0; ox < wo; ++ox)
        for (int64_t o = 0; o < k.co; ++o) {
          double acc = 0;
          for (int64_t c = 0; c < k.c; ++c)
            for (int64_t i = 0; i < kk; ++i)
              for (int64_t j = 0; j < kk; ++j) {
                const int64_t iy = oy * k.conv.stride - k.conv.pad + i, ix = ox * k.conv.stride - k.conv.pad + j;
                if (iy < 0 || iy >= k.h || ix < 0 || ix >= k.w || !valid[size_t(iy)]) continue;
                acc += double(x.f32()[(iy * k.w + ix) * k.c + c]) * double(wt.f32()[o * patch + c * kk * kk + i * kk + j]);
              }
          want[size_t((oy * wo + ox) * k.co + o)] = acc;
        }
    EXPECT_LT(tower::rel_err(y.f32(), want), 1e-6) << k.h << "x" << k.w << "x" << k.c << " kernel " << kk;
  }
  // Shapes that do not fit are errors, not reads past the end.
  mb::Tensor x = tower::filled({6, 6, 2}, rng, 1.f);
  mb::Tensor too_many = mb::host_tensor(DType::F32, {4, 3, 18});  // the grid has 3 rows
  EXPECT_THROW(be->im2col(x, nullptr, {3, 2, 1}, 0, too_many), mb::Error);
  mb::Tensor wrong_patch = mb::host_tensor(DType::F32, {3, 3, 9});
  EXPECT_THROW(be->im2col(x, nullptr, {3, 2, 1}, 0, wrong_patch), mb::Error);
}

TEST(BackendTowerOps, GatherSumRowsPoolsInGroupOrder) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(35);
  const int64_t n = 36, c = 21, group = 4, out_rows = 7;
  mb::Tensor src = tower::filled({n, c}, rng, 2.f), dst = mb::host_tensor(DType::F32, {out_rows, c});
  std::vector<int32_t> rows(size_t(out_rows * group));
  for (auto& r : rows) r = int32_t(rng() % n);  // repeats allowed
  be->gather_sum_rows(src, rows.data(), group, 0.25f, dst);
  for (int64_t i = 0; i < out_rows; ++i)
    for (int64_t d = 0; d < c; ++d) {
      float want = 0.f;  // the same f32 operations in the same order: equal bits
      for (int64_t j = 0; j < group; ++j) want += src.f32()[rows[size_t(i * group + j)] * c + d] * 0.25f;
      ASSERT_EQ(dst.f32()[i * c + d], want) << i << "," << d;
    }
  rows[3] = int32_t(n);
  EXPECT_THROW(be->gather_sum_rows(src, rows.data(), group, 1.f, dst), mb::Error);
}

TEST(BackendTowerOps, GluCausalConvIsItsDefinition) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(32);
  for (int64_t n : {1, 3, 40})
    for (int64_t K : {1, 5}) {
      const int64_t D = 13;
      mb::Tensor g = tower::filled({n, 2 * D}, rng, 2.f), w = tower::filled({D, K}, rng, 0.7f);
      mb::Tensor out = mb::host_tensor(DType::F32, {n, D});
      be->glu_causal_conv(g, w, out);
      std::vector<double> want(size_t(n * D), 0.0);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t c = 0; c < D; ++c)
          for (int64_t j = 0; j < K; ++j) {
            const int64_t s = t - (K - 1) + j;
            if (s < 0) continue;
            const double a = double(g.f32()[s * 2 * D + c]) / (1.0 + std::exp(-double(g.f32()[s * 2 * D + D + c])));
            want[size_t(t * D + c)] += double(w.f32()[c * K + j]) * a;
          }
      EXPECT_LT(tower::rel_err(out.f32(), want), 1e-6) << "n " << n << " K " << K;
    }
  mb::Tensor g = tower::filled({4, 10}, rng, 1.f), w = tower::filled({4, 3}, rng, 1.f), out = mb::host_tensor(DType::F32, {4, 5});
  EXPECT_THROW(be->glu_causal_conv(g, w, out), mb::Error);  // w has 4 channels, out 5
}

TEST(BackendTowerOps, LayerNormSiluAndBroadcastAddAreTheirDefinitions) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(33);
  const int64_t rows = 7, width = 37;
  mb::Tensor w = tower::filled({width}, rng, 1.f), b = tower::filled({width}, rng, 1.f);
  for (bool bias : {false, true})
    for (bool relu : {false, true}) {
      mb::Tensor x = tower::filled({rows, width}, rng, 3.f);
      for (int64_t c = 0; c < width; ++c) x.f32()[c] += 100.f;  // a row far from zero mean
      std::vector<double> want(size_t(rows * width));
      for (int64_t r = 0; r < rows; ++r) {
        double mean = 0, var = 0;
        for (int64_t c = 0; c < width; ++c) mean += x.f32()[r * width + c];
        mean /= double(width);
        for (int64_t c = 0; c < width; ++c) var += std::pow(x.f32()[r * width + c] - mean, 2);
        var /= double(width);
        for (int64_t c = 0; c < width; ++c) {
          double v = (x.f32()[r * width + c] - mean) / std::sqrt(var + 1e-5) * w.f32()[c] + (bias ? b.f32()[c] : 0.0);
          want[size_t(r * width + c)] = relu ? std::max(0.0, v) : v;
        }
      }
      be->layer_norm(x, w, bias ? &b : nullptr, 1e-5f, relu, x);  // in place, as the towers call it
      EXPECT_LT(tower::rel_err(x.f32(), want), 1e-6) << "bias " << bias << " relu " << relu;
    }
  {
    mb::Tensor x = tower::filled({5, 300000 / 5}, rng, 4.f);  // past one thread's chunk
    for (float v : {0.f, -0.f, 80.f, -80.f, 1e-30f}) x.f32()[rng() % size_t(x.numel())] = v;
    std::vector<double> want(size_t(x.numel()));
    for (int64_t i = 0; i < x.numel(); ++i) want[size_t(i)] = double(x.f32()[i]) / (1.0 + std::exp(-double(x.f32()[i])));
    be->silu(x);
    EXPECT_LT(tower::rel_err(x.f32(), want), 1e-6);
  }
  {
    mb::Tensor a = tower::filled({rows, width}, rng, 1.f), bias_row = tower::filled({width}, rng, 1.f);
    mb::Tensor full = tower::filled({rows, width}, rng, 1.f), out = mb::host_tensor(DType::F32, {rows, width});
    std::vector<double> want(size_t(rows * width));
    for (int64_t i = 0; i < a.numel(); ++i) want[size_t(i)] = double(a.f32()[i]) + bias_row.f32()[i % width];
    be->add(a, bias_row, out);
    EXPECT_LT(tower::rel_err(out.f32(), want), 1e-7);
    for (int64_t i = 0; i < a.numel(); ++i) want[size_t(i)] = double(a.f32()[i]) + full.f32()[i];
    be->add(a, full, out);
    EXPECT_LT(tower::rel_err(out.f32(), want), 1e-7);
    mb::Tensor odd = tower::filled({width + 1}, rng, 1.f);
    EXPECT_THROW(be->add(a, odd, out), mb::Error);
  }
}

// add_rms_norm_norm in one pass gives the bits of add_rms_norm and then rms_norm, with weights or
// without, and checks y's size.
TEST(BackendTowerOps, AddRmsNormNormIsTheTwoOps) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(35);
  const int64_t rows = 300, d = 48;
  for (bool weighted : {false, true})
    for (bool add_one : {false, true}) {
      mb::Tensor x = tower::filled({rows, d}, rng, 2.f), branch = tower::filled({rows, d}, rng, 1.f);
      mb::Tensor w = tower::filled({d}, rng, 1.f), w_next = tower::filled({d}, rng, 1.f);
      mb::Tensor x2 = mb::host_tensor(DType::F32, {rows, d}), branch2 = mb::host_tensor(DType::F32, {rows, d});
      std::memcpy(x2.data, x.data, size_t(x.nbytes()));
      std::memcpy(branch2.data, branch.data, size_t(branch.nbytes()));
      mb::Tensor y = mb::host_tensor(DType::F32, {rows, d}), y2 = mb::host_tensor(DType::F32, {rows, d});
      const mb::Tensor* wn = weighted ? &w_next : nullptr;
      be->add_rms_norm_norm(x, branch, &w, 1e-6f, add_one, 0.5f, wn, y);
      be->add_rms_norm(x2, branch2, &w, 1e-6f, add_one, 0.5f);
      be->rms_norm(x2, wn, 1e-6f, add_one, y2);
      for (int64_t i = 0; i < rows * d; ++i) {
        ASSERT_EQ(x.f32()[i], x2.f32()[i]) << i;
        ASSERT_EQ(y.f32()[i], y2.f32()[i]) << i;
      }
      mb::Tensor small = mb::host_tensor(DType::F32, {rows - 1, d});
      EXPECT_THROW(be->add_rms_norm_norm(x, branch, &w, 1e-6f, add_one, 1.f, wn, small), mb::Error);
    }
}

TEST(BackendTowerOps, LocalAttentionIsTheMaskedSoftmaxOfItsDefinition) {
  auto be = mb::make_cpu_backend();
  std::mt19937 rng(34);
  struct Case {
    int64_t n, heads, hd, chunk, left;
  };
  for (const Case& k : {Case{29, 2, 16, 6, 5}, Case{12, 3, 8, 4, 4}, Case{3, 1, 32, 12, 12}}) {
    mb::Backend::LocalAttention p;
    p.chunk = k.chunk;
    p.left = k.left;
    p.context = k.chunk + k.left;
    p.rel_offset = p.context / 2 - p.left;
    if (p.rel_offset < 0) p.rel_offset = 0;
    p.q_scale = 0.3f;
    p.k_scale = 1.7f;
    p.logit_cap = 5.f;
    p.invalid_logit = -1e9f;
    const int64_t width = k.heads * k.hd, P = p.left + p.rel_offset + 1;
    std::vector<uint8_t> valid(size_t(k.n), 1);
    for (int64_t t = 0; t < k.n; t += 4) valid[size_t(t)] = 0;  // holes
    if (k.n > 20) std::fill(valid.end() - 9, valid.end(), 0);  // a padded tail: its queries see no valid key
    p.valid = valid.data();
    mb::Tensor q = tower::filled({k.n, k.heads, k.hd}, rng, 1.f), kk = tower::filled({k.n, k.heads, k.hd}, rng, 1.f);
    mb::Tensor v = tower::filled({k.n, k.heads, k.hd}, rng, 1.f), gain = tower::filled({k.hd}, rng, 0.5f);
    mb::Tensor rel = tower::filled({P, width}, rng, 1.f), out = mb::host_tensor(DType::F32, {k.n, k.heads, k.hd});
    be->local_attention(q, kk, v, gain, rel, p, out);
    std::vector<double> want(size_t(k.n * width), 0.0);
    for (int64_t t = 0; t < k.n; ++t)
      for (int64_t h = 0; h < k.heads; ++h) {
        const int64_t first = t / k.chunk * k.chunk - k.left;
        std::vector<double> logit(size_t(p.context));
        for (int64_t j = 0; j < p.context; ++j) {
          const int64_t s = first + j, d = t - s;
          logit[size_t(j)] = p.invalid_logit;
          if (s < 0 || s >= k.n || !valid[size_t(s)] || d < 0 || d >= k.left) continue;
          double dot = 0;
          for (int64_t i = 0; i < k.hd; ++i) {
            const double qt = double(q.f32()[(t * k.heads + h) * k.hd + i]) * p.q_scale * gain.f32()[i];
            dot += qt * (double(kk.f32()[(s * k.heads + h) * k.hd + i]) * p.k_scale +
                         double(rel.f32()[(d + p.rel_offset) * width + h * k.hd + i]));
          }
          logit[size_t(j)] = p.logit_cap * std::tanh(dot / p.logit_cap);
        }
        const double top = *std::max_element(logit.begin(), logit.end());
        double sum = 0;
        for (double l : logit) sum += std::exp(l - top);
        for (int64_t j = 0; j < p.context; ++j) {
          const int64_t s = first + j;
          if (s < 0 || s >= k.n) continue;
          for (int64_t i = 0; i < k.hd; ++i)
            want[size_t((t * k.heads + h) * k.hd + i)] +=
                std::exp(logit[size_t(j)] - top) / sum * v.f32()[(s * k.heads + h) * k.hd + i];
        }
      }
    EXPECT_LT(tower::rel_err(out.f32(), want), 1e-5) << "n " << k.n << " chunk " << k.chunk << " left " << k.left;
  }
  mb::Tensor q = tower::filled({4, 2, 8}, rng, 1.f), rel = tower::filled({2, 16}, rng, 1.f);
  mb::Tensor gain = tower::filled({8}, rng, 1.f), out = mb::host_tensor(DType::F32, {4, 2, 8});
  std::vector<uint8_t> valid(4, 1);
  mb::Backend::LocalAttention p;
  p.chunk = 2;
  p.left = 3;  // needs 3 relative rows, the table has 2
  p.context = 5;
  p.logit_cap = 1.f;
  p.valid = valid.data();
  EXPECT_THROW(be->local_attention(q, q, q, gain, rel, p, out), mb::Error);
}
