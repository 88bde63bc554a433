// The integer matmul of block-quantized weights (backends/cpu/qmatmul.*): packing is lossless, the
// AVX-512 VNNI, AMX and AVX2 kernels equal their scalar twin bit for bit, and both stay within the rounding of
// 8-bit activations of the exact f32 result.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/qmatmul.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/quant.h"
#include "core/thread_pool.h"

namespace {

using mb::DType;

const DType kTypes[] = {DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::Q4_K, DType::Q6_K};

struct QuantMatrix {
  int64_t m, k;
  std::vector<uint8_t> bytes;
  std::vector<float> deq;  // the dequantized rows
};

// Rows of mixed scale (one row of zeros, one with an outlier) quantized to t.
QuantMatrix make_matrix(DType t, int64_t m, int64_t k, std::mt19937& rng) {
  QuantMatrix q{m, k, {}, {}};
  const size_t rb = mb::dtype_row_bytes(t, k);
  q.bytes.resize(rb * size_t(m));
  q.deq.resize(size_t(m * k));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> row(static_cast<size_t>(k));
  for (int64_t r = 0; r < m; ++r) {
    const float scale = r == 1 ? 0.f : std::exp(nd(rng));
    for (auto& v : row) v = scale * nd(rng);
    if (r == 2) row[5] = 40.f;
    mb::quantize_row(t, row.data(), q.bytes.data() + size_t(r) * rb, k);
    // A Q8_0 code of -128: files may hold it though quantize_row never writes it.
    if (t == DType::Q8_0 && r == 3) q.bytes[size_t(r) * rb + 2] = 0x80;
    mb::dequantize_row(t, q.bytes.data() + size_t(r) * rb, q.deq.data() + r * k, k);
  }
  return q;
}

std::vector<float> make_x(int64_t n, int64_t k, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(size_t(n * k));
  for (auto& v : x) v = nd(rng);
  for (int64_t i = 0; i < k; ++i) x[size_t(i)] = 0.f;  // token 0: all zeros (scale 0)
  if (n > 1) x[size_t(k + 3)] = 1e4f;                // token 1: one huge value
  return x;
}

TEST(QMatmul, PackingIsLossless) {
  std::mt19937 rng(1);
  for (DType t : kTypes) {
    const int64_t m = 37, k = 512;  // a partial last group
    QuantMatrix q = make_matrix(t, m, k, rng);
    auto p = mb::cpu::qpack(t, q.bytes.data(), m, k);
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t r = 0; r < m; ++r) {
      mb::cpu::qunpack_row(*p, r, row.data());
      for (int64_t i = 0; i < k; ++i) ASSERT_EQ(row[size_t(i)], q.deq[size_t(r * k + i)]) << mb::dtype_name(t) << " row " << r << " k " << i;
    }
  }
  EXPECT_FALSE(mb::cpu::qpack_supports(DType::Q4_K, 640));  // K types need whole 256-blocks
  EXPECT_TRUE(mb::cpu::qpack_supports(DType::Q5_0, 640));
  EXPECT_FALSE(mb::cpu::qpack_supports(DType::BF16, 640));
}

TEST(QMatmul, ActivationsRoundTo8BitsPerBlock) {
  std::mt19937 rng(2);
  const int64_t n = 3, k = 96;
  auto x = make_x(n, k, rng);
  mb::cpu::QActs a;
  mb::cpu::quantize_acts(x.data(), k, n, k, a);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < k; ++i) {
      const float d = a.dx[size_t(t * (k / 32) + i / 32)];
      EXPECT_LE(std::fabs(d * a.qrow(t)[i] - x[size_t(t * k + i)]), 0.5f * d * 1.0001f + 1e-30f);
    }
  EXPECT_EQ(a.dx[0], 0.f);  // an all-zero block has scale 0, no NaN
}

// fn rounds activations exactly like quantize_acts_ref: ties, tiny and denormal blocks included.
void expect_rounding_equals_scalar_twin(mb::cpu::QuantizeActsFn fn) {
  std::mt19937 rng(6);
  const int64_t n = 7, k = 256;
  auto x = make_x(n, k, rng);
  for (int i = 0; i < 64; ++i) x[size_t(2 * k + i)] = float(i % 5) * 0.5f - 1.f;  // exact .5 ties
  x[size_t(3 * k)] = -1e-30f;                                                  // a tiny block scale
  for (int i = 0; i < 32; ++i) x[size_t(4 * k + i)] = i == 3 ? 1e-41f : 0.f;      // denormal: a zero block
  for (int i = 0; i < 32; ++i) x[size_t(5 * k + 32 + i)] = i == 7 ? -3.f : 1.f;  // amax from a negative
  mb::cpu::QActs a, b;
  for (auto* q : {&a, &b}) {
    q->n = n;
    q->k = k;
    q->q.assign(size_t(n * k), 0);
    q->dx.assign(size_t(n * k / 32), 0.f);
    q->dsum32.assign(size_t(n * k / 32), 0.f);
    q->dsum16.assign(size_t(n * k / 16), 0.f);
    q->qsum.assign(size_t(n * k / 32), -1);
  }
  mb::cpu::quantize_acts_ref(x.data(), k, 0, n, 0, k / 32, a);
  fn(x.data(), k, 0, n, 0, k / 32, b);
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.dsum32, b.dsum32);
  EXPECT_EQ(a.dsum16, b.dsum16);
  EXPECT_EQ(a.qsum, b.qsum);
  EXPECT_EQ(a.dx[size_t(4 * k / 32)], 0.f);
  for (float v : b.dsum32) EXPECT_TRUE(std::isfinite(v));
  for (int64_t i = 0; i < n * k / 32; ++i) {
    int s = 0;
    for (int j = 0; j < 32; ++j) s += a.q[size_t(32 * i + j)];
    ASSERT_EQ(a.qsum[size_t(i)], s) << "block " << i;
  }
}

TEST(QMatmul, Avx512ActivationRoundingEqualsScalarTwin) {
  mb::cpu::QuantizeActsFn fn = mb::cpu::quantize_acts_avx512();
  if (!fn || !mb::cpu::kernels_for(mb::cpu::Isa::Avx512)) GTEST_SKIP() << "no AVX-512 on this CPU/build";
  expect_rounding_equals_scalar_twin(fn);
}

TEST(QMatmul, Avx2ActivationRoundingEqualsScalarTwin) {
  mb::cpu::QuantizeActsFn fn = mb::cpu::quantize_acts_avx2();
  if (!fn || !mb::cpu::kernels_for(mb::cpu::Isa::Avx2)) GTEST_SKIP() << "no AVX2 on this CPU/build";
  expect_rounding_equals_scalar_twin(fn);
}

// Blocks quantized in pieces (ranges of tokens and of blocks, as the gated FFN's tasks do) give
// the bytes of one pass, on every version.
TEST(QMatmul, ActivationsQuantizedInPiecesEqualOnePass) {
  std::mt19937 rng(8);
  const int64_t n = 5, k = 320, nb = k / 32;
  auto x = make_x(n, k, rng);
  std::vector<std::pair<const char*, mb::cpu::QuantizeActsFn>> fns = {{"scalar", mb::cpu::quantize_acts_ref}};
  if (mb::cpu::kernels_for(mb::cpu::Isa::Avx2) && mb::cpu::quantize_acts_avx2()) fns.push_back({"avx2", mb::cpu::quantize_acts_avx2()});
  if (mb::cpu::kernels_for(mb::cpu::Isa::Avx512) && mb::cpu::quantize_acts_avx512())
    fns.push_back({"avx512", mb::cpu::quantize_acts_avx512()});
  auto sized = [&] {
    mb::cpu::QActs q;
    q.n = n;
    q.k = k;
    q.q.assign(size_t(n * k), 0);
    q.dx.assign(size_t(n * nb), -1.f);
    q.dsum32.assign(size_t(n * nb), -1.f);
    q.dsum16.assign(size_t(2 * n * nb), -1.f);
    q.qsum.assign(size_t(n * nb), -1);
    return q;
  };
  for (auto [name, fn] : fns) {
    mb::cpu::QActs whole = sized(), pieces = sized();
    fn(x.data(), k, 0, n, 0, nb, whole);
    for (auto [t0, t1] : {std::pair<int64_t, int64_t>{0, 2}, {2, 5}})
      for (auto [b0, b1] : {std::pair<int64_t, int64_t>{0, 3}, {3, 4}, {4, nb}}) fn(x.data(), k, t0, t1, b0, b1, pieces);
    EXPECT_EQ(whole.q, pieces.q) << name;
    EXPECT_EQ(whole.dx, pieces.dx) << name;
    EXPECT_EQ(whole.dsum32, pieces.dsum32) << name;
    EXPECT_EQ(whole.dsum16, pieces.dsum16) << name;
    EXPECT_EQ(whole.qsum, pieces.qsum) << name;
    for (float d : whole.dx) EXPECT_GE(d, 0.f) << name;  // every block written
  }
}

TEST(QMatmul, ScalarTwinIsCloseToExactMath) {
  std::mt19937 rng(3);
  for (DType t : kTypes) {
    const int64_t m = 40, k = 768, n = 3;
    QuantMatrix q = make_matrix(t, m, k, rng);
    auto p = mb::cpu::qpack(t, q.bytes.data(), m, k);
    auto x = make_x(n, k, rng);
    x[size_t(k + 3)] = 3.f;  // no outlier here: bound the error by the 8-bit rounding of x
    mb::cpu::QActs a;
    mb::cpu::quantize_acts(x.data(), k, n, k, a);
    std::vector<float> y(size_t(n * m));
    mb::cpu::qmatmul_ref(*p, a, y.data(), m, 0, p->groups, 0, n);
    for (int64_t tt = 0; tt < n; ++tt)
      for (int64_t r = 0; r < m; ++r) {
        double exact = 0, bound = 0;
        for (int64_t i = 0; i < k; ++i) {
          const double w = q.deq[size_t(r * k + i)];
          exact += w * x[size_t(tt * k + i)];
          bound += std::fabs(w) * 0.5 * a.dx[size_t(tt * (k / 32) + i / 32)];
        }
        const float got = y[size_t(tt * m + r)];
        ASSERT_TRUE(std::isfinite(got));
        EXPECT_LE(std::fabs(got - exact), bound * 1.01 + 1e-4) << mb::dtype_name(t) << " row " << r << " token " << tt;
      }
  }
}

// Q8_0's twin scales the signed dot Σ(c - 128)·q, exact in int32, once per block. Against
// double-precision math on the same 8-bit activations its error is that of one product and one
// add per block. The two-term form (Σc·q scaled, then -128·d times dx·Σq added) cancels two
// terms ~128·Σq/Σw·q times larger than the result when the activations have a mean, and fails
// the same bound: checked below as the control that the bound can tell the two apart.
TEST(QMatmul, Q8_0ScalesTheSignedDotWithoutCancellation) {
  std::mt19937 rng(11);
  const int64_t m = 32, k = 1024, n = 4, nb = k / 32;
  QuantMatrix q = make_matrix(DType::Q8_0, m, k, rng);
  auto p = mb::cpu::qpack(DType::Q8_0, q.bytes.data(), m, k);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(size_t(n * k));
  for (auto& v : x) v = 4.f + 0.3f * nd(rng);  // a large mean: Σq ~ 32·120 per block
  mb::cpu::QActs a;
  mb::cpu::quantize_acts(x.data(), k, n, k, a);
  std::vector<float> y(size_t(n * m));
  mb::cpu::qmatmul_ref(*p, a, y.data(), m, 0, p->groups, 0, n);
  const double u = std::ldexp(1.0, -24);  // unit roundoff of f32
  const size_t rb = mb::dtype_row_bytes(DType::Q8_0, k);
  double worst_new = 0, worst_old = 0;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < m; ++r) {
      double exact = 0, bound = 0;
      float old = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const mb::blocks::Q8_0& blk = reinterpret_cast<const mb::blocks::Q8_0*>(q.bytes.data() + size_t(r) * rb)[b];
        const float d = mb::f16_to_f32(blk.d);
        const float dx = a.dx[size_t(t * nb + b)];
        int32_t dot = 0, dotc = 0;
        for (int i = 0; i < 32; ++i) {
          const int32_t qi = a.q[size_t(t * k + 32 * b + i)];
          dot += int32_t(blk.qs[i]) * qi;
          dotc += (int32_t(blk.qs[i]) + 128) * qi;
        }
        const double term = double(d) * double(dx) * double(dot);
        exact += term;
        // first order: the rounding of d·dx (relative u) and of the FMA (u of the new sum)
        bound += 1.001 * u * (std::fabs(term) + std::fabs(exact));
        old = std::fma(float(dotc), d * dx, old);
        old = std::fma(d * -128.f, a.dsum32[size_t(t * nb + b)], old);
      }
      const double got = y[size_t(t * m + r)];
      ASSERT_TRUE(std::isfinite(got));
      EXPECT_LE(std::fabs(got - exact), bound + 1e-30) << "row " << r << " token " << t;
      if (bound > 0) {
        worst_new = std::max(worst_new, std::fabs(got - exact) / bound);
        worst_old = std::max(worst_old, std::fabs(double(old) - exact) / bound);
      }
    }
  EXPECT_GT(worst_old, 1.0) << "the bound no longer tells the two forms apart";
  std::printf("[ figure ] Q8_0 twin: worst error / bound %.3f (the two-term form: %.3f)\n", worst_new, worst_old);
}

// fn equals qmatmul_ref bit for bit for every type at each batch size n, called directly and
// through the threaded driver (which quantizes the tokens again inside).
void expect_equals_scalar_twin(mb::cpu::QMatmulFn fn, std::initializer_list<int64_t> ns, uint32_t seed) {
  std::mt19937 rng(seed);
  for (DType t : kTypes)
    for (int64_t n : ns) {
      const int64_t m = 53, k = 512;
      QuantMatrix q = make_matrix(t, m, k, rng);
      auto p = mb::cpu::qpack(t, q.bytes.data(), m, k);
      auto x = make_x(n, k, rng);
      mb::cpu::QActs a;
      mb::cpu::quantize_acts(x.data(), k, n, k, a);
      std::vector<float> want(size_t(n * m), -1.f), got(size_t(n * m), -1.f);
      mb::cpu::qmatmul_ref(*p, a, want.data(), m, 0, p->groups, 0, n);
      fn(*p, a, got.data(), m, 0, p->groups, 0, n);
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i]));
        ASSERT_EQ(got[i], want[i]) << mb::dtype_name(t) << " n " << n << " at " << i;
      }
      std::vector<float> drv(size_t(n * m), -1.f);
      mb::cpu::qmatmul(fn, *p, x.data(), k, n, drv.data(), m);
      ASSERT_EQ(drv, want) << mb::dtype_name(t) << " n " << n;
    }
}

TEST(QMatmul, Avx512VnniEqualsScalarTwinBitForBit) {
  mb::cpu::QMatmulFn fn = mb::cpu::qmatmul_avx512();
  if (!fn || !mb::cpu::cpu_has_avx512_vnni()) GTEST_SKIP() << "no AVX-512 VNNI on this CPU/build";
  expect_equals_scalar_twin(fn, {1, 2, 3, 4, 5, 9}, 4);
}

// Tiles of 4 tokens and the 1-3 left, partial row groups (m = 53: the last group's second half
// holds 5 rows), every type.
TEST(QMatmul, Avx2EqualsScalarTwinBitForBit) {
  mb::cpu::QMatmulFn fn = mb::cpu::qmatmul_avx2();
  if (!fn || !mb::cpu::kernels_for(mb::cpu::Isa::Avx2)) GTEST_SKIP() << "no AVX2 on this CPU/build";
  expect_equals_scalar_twin(fn, {1, 2, 3, 4, 5, 7, 9, 16}, 9);
}

// Every code at its largest against activations at +-127: the AVX2 kernel sums a 4-bit block's
// 8 quads (a 5-bit block's 4) in i16 before widening, which holds exactly up to these bounds
// (2·15·127·8 = 30480, 2·31·127·4 = 31496 <= 32767). Any kernel that sums more would overflow here.
TEST(QMatmul, LargestCodesAndActivationsStayExact) {
  const int64_t m = 32, k = 256, n = 8;
  std::vector<float> x(size_t(n * k));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < k; ++i) x[size_t(t * k + i)] = (t % 2 ? -1.f : 1.f) * (t == 5 && i % 3 ? 0.5f : 1.f);
  mb::cpu::QActs a;
  mb::cpu::quantize_acts(x.data(), k, n, k, a);
  for (DType t : {DType::Q4_0, DType::Q5_0}) {
    const size_t rb = mb::dtype_row_bytes(t, k);
    std::vector<uint8_t> bytes(rb * size_t(m), 0xFF);  // every code bit set
    for (size_t off = 0; off < bytes.size(); off += mb::dtype_block_bytes(t)) {
      bytes[off] = 0x00;
      bytes[off + 1] = 0x3C;  // d = 1.0 (f16)
    }
    auto p = mb::cpu::qpack(t, bytes.data(), m, k);
    std::vector<float> want(size_t(n * m));
    mb::cpu::qmatmul_ref(*p, a, want.data(), m, 0, p->groups, 0, n);
    // Token 0: q = 127 everywhere, codes at the top (Q4_0 value 7, Q5_0 value 15).
    EXPECT_EQ(want[0], float(k) * (t == DType::Q4_0 ? 7.f : 15.f) * (127.f * a.dx[0]));
    for (mb::cpu::QMatmulFn fn : {mb::cpu::qmatmul_avx2(), mb::cpu::qmatmul_avx512()}) {
      if (!fn || (fn == mb::cpu::qmatmul_avx2() && !mb::cpu::kernels_for(mb::cpu::Isa::Avx2)) ||
          (fn == mb::cpu::qmatmul_avx512() && !mb::cpu::cpu_has_avx512_vnni()))
        continue;
      std::vector<float> got(size_t(n * m), -1.f);
      fn(*p, a, got.data(), m, 0, p->groups, 0, n);
      ASSERT_EQ(got, want) << mb::dtype_name(t);
    }
  }
}

// Whole tiles of 16 tokens run on AMX, the rest on VNNI: sizes on both sides of the tile.
TEST(QMatmul, AmxEqualsScalarTwinBitForBit) {
  mb::cpu::QMatmulFn fn = mb::cpu::qmatmul_amx();
  if (!fn || !mb::cpu::cpu_amx_int8_ready()) GTEST_SKIP() << "no AMX-INT8 on this CPU/OS/build";
  expect_equals_scalar_twin(fn, {15, 16, 17, 32, 45, 70}, 7);
}

// Through the backend: a packed weight takes the integer path by default and the f32-activation
// path when asked, and its rows stay readable for lookups.
TEST(QMatmul, BackendSwitchesBetweenIntegerAndExactPaths) {
  std::mt19937 rng(5);
  auto be = mb::make_cpu_backend();
  const int64_t m = 48, k = 256, n = 2;
  QuantMatrix q = make_matrix(DType::Q4_0, m, k, rng);
  mb::Tensor src;
  src.dtype = DType::Q4_0;
  src.shape = {m, k};
  src.data = q.bytes.data();
  {
    // Loaded while the f32-activation path is chosen: no packed copy (it would only cost memory).
    const bool prev = mb::cpu::set_quant_matmul_exact(true);
    EXPECT_EQ(be->prepare_weight(src, DType::Q4_0, mb::Backend::WeightUse::MatmulAndLookup).packed, nullptr);
    mb::cpu::set_quant_matmul_exact(prev);
  }
  mb::Tensor w = be->prepare_weight(src, DType::Q4_0, mb::Backend::WeightUse::MatmulAndLookup);
  // Packed exactly when an integer kernel runs here (a CPU without one keeps only the rows).
  ASSERT_EQ(w.packed != nullptr, mb::cpu::qmatmul_kernel() != nullptr);
  EXPECT_EQ(be->prepare_weight(src, DType::Q4_0, mb::Backend::WeightUse::Lookup).packed, nullptr);
  auto xv = make_x(n, k, rng);
  mb::Tensor x = mb::host_tensor(DType::F32, {n, k});
  std::copy(xv.begin(), xv.end(), x.f32());
  mb::Tensor y = mb::host_tensor(DType::F32, {n, m});
  const bool prev = mb::cpu::set_quant_matmul_exact(true);
  be->matmul(x, w, y);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < m; ++r) {
      double exact = 0;
      for (int64_t i = 0; i < k; ++i) exact += double(q.deq[size_t(r * k + i)]) * xv[size_t(t * k + i)];
      EXPECT_NEAR(y.f32()[t * m + r], exact, 1e-3 * (1 + std::fabs(exact)));
    }
  mb::cpu::set_quant_matmul_exact(false);
  be->matmul(x, w, y);
  if (mb::cpu::qmatmul_kernel()) {
    mb::cpu::QActs a;
    mb::cpu::quantize_acts(xv.data(), k, n, k, a);
    std::vector<float> want(size_t(n * m));
    mb::cpu::qmatmul_ref(*std::static_pointer_cast<const mb::cpu::QPacked>(w.packed), a, want.data(), m, 0,
                         (m + 15) / 16, 0, n);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(y.f32()[i], want[i]);
  }
  mb::cpu::set_quant_matmul_exact(prev);
  std::vector<int32_t> ids = {7, 0};
  mb::Tensor e = mb::host_tensor(DType::F32, {2, k});
  be->embed(w, ids.data(), 2, 1.f, e);
  for (int64_t i = 0; i < k; ++i) EXPECT_EQ(e.f32()[i], q.deq[size_t(7 * k + i)]);
}

}  // namespace

namespace {

// Several weights on one input in one pass give the numbers of one matmul each.
TEST(QMatmul, FusedMatmulsEqualSeparateOnes) {
  std::mt19937 rng(8);
  auto be = mb::make_cpu_backend();
  const int64_t k = 512, n = 3;
  std::vector<QuantMatrix> mats;
  std::vector<mb::Tensor> ws;
  for (auto [t, m] : {std::pair{DType::Q4_0, int64_t(40)}, {DType::Q6_K, int64_t(16)}, {DType::Q8_0, int64_t(7)}}) {
    mats.push_back(make_matrix(t, m, k, rng));
    mb::Tensor src;
    src.dtype = t;
    src.shape = {m, k};
    src.data = mats.back().bytes.data();
    ws.push_back(be->prepare_weight(src, t));
  }
  auto xv = make_x(n, k, rng);
  mb::Tensor x = mb::host_tensor(DType::F32, {n, k});
  std::copy(xv.begin(), xv.end(), x.f32());
  std::vector<mb::Tensor> fused, alone;
  for (auto& w : ws) {
    fused.push_back(mb::host_tensor(DType::F32, {n, w.rows()}));
    alone.push_back(mb::host_tensor(DType::F32, {n, w.rows()}));
    be->matmul(x, w, alone.back());
  }
  be->matmuls(x, {&ws[0], &ws[1], &ws[2]}, {&fused[0], &fused[1], &fused[2]});
  for (size_t i = 0; i < ws.size(); ++i)
    for (int64_t j = 0; j < fused[i].numel(); ++j) ASSERT_EQ(fused[i].f32()[j], alone[i].f32()[j]) << i << " " << j;
}

// q's bytes as a CPU-backend weight: packed when an integer kernel runs on the current path, as
// at load.
mb::Tensor weight_of(mb::Backend& be, DType t, QuantMatrix& q) {
  mb::Tensor src;
  src.dtype = t;
  src.shape = {q.m, q.k};
  src.data = q.bytes.data();
  return be.prepare_weight(src, t);
}

// On every kernel path this CPU runs and for 1, 3 and 20 tokens of k columns, run(x, fused,
// apart) fills a fused op's and its Backend default's [n, out_cols] outputs: they must agree bit
// for bit, be finite and not be trivially zero. set_up() prepares the weights for each path.
template <class SetUp, class Run>
void expect_fused_equals_ops(int64_t k, int64_t out_cols, std::mt19937& rng, SetUp&& set_up, Run&& run) {
  for (mb::cpu::Isa isa : {mb::cpu::Isa::Scalar, mb::cpu::Isa::Avx2, mb::cpu::Isa::Avx512}) {
    mb::cpu::Isa prev;
    try {
      prev = mb::cpu::set_isa(isa);
    } catch (const mb::Error&) {
      continue;  // not on this CPU
    }
    set_up();
    for (int64_t n : {1, 3, 20}) {
      auto xv = make_x(n + 1, k, rng);  // without its all-zero token 0 (whose outputs are 0)
      mb::Tensor x = mb::host_tensor(DType::F32, {n, k});
      std::copy(xv.begin() + k, xv.end(), x.f32());
      mb::Tensor fused = mb::host_tensor(DType::F32, {n, out_cols}), apart = mb::host_tensor(DType::F32, {n, out_cols});
      run(x, fused, apart);
      int nonzero = 0;
      for (int64_t j = 0; j < fused.numel(); ++j) {
        ASSERT_EQ(fused.f32()[j], apart.f32()[j]) << mb::cpu::isa_name(isa) << " n=" << n << " at " << j;
        ASSERT_TRUE(std::isfinite(fused.f32()[j]));
        nonzero += fused.f32()[j] != 0.f;
      }
      EXPECT_GT(nonzero, fused.numel() / 4);
    }
    mb::cpu::set_isa(prev);
  }
}


// The gated FFN in one region (the activation applied per task) gives the numbers of the two
// matmuls followed by one activation pass, on every kernel path this CPU runs.
TEST(QMatmul, FusedGatedFfnEqualsMatmulsThenActivation) {
  std::mt19937 rng(12);
  auto be = mb::make_cpu_backend();
  const int64_t k = 512, m = 40;  // 3 row groups, the last one partial
  for (auto [tg, tu] : {std::pair{DType::Q4_0, DType::Q4_0}, {DType::Q8_0, DType::Q8_0}, {DType::Q4_K, DType::Q6_K}}) {
    SCOPED_TRACE(std::string(mb::dtype_name(tg)));
    QuantMatrix qg = make_matrix(tg, m, k, rng), qu = make_matrix(tu, m, k, rng);
    mb::Tensor wg, wu;
    expect_fused_equals_ops(
        k, m, rng, [&] {
          wg = weight_of(*be, tg, qg);
          wu = weight_of(*be, tu, qu);
        },
        [&](const mb::Tensor& x, mb::Tensor& fused, mb::Tensor& apart) {
          be->matmul_gelu_mul(x, wg, wu, fused);
          be->mb::Backend::matmul_gelu_mul(x, wg, wu, apart);
        });
  }
}

// The whole gated FFN in one op (its activation quantized by the first region's tasks) gives the
// bits of its ops one after the other (the Backend default), on every kernel path, with a down
// projection of a partial row group.
TEST(QMatmul, WholeGatedFfnEqualsItsOps) {
  std::mt19937 rng(13);
  auto be = mb::make_cpu_backend();
  const int64_t k = 512, F = 256, H = 40;
  for (DType t : {DType::Q4_0, DType::Q8_0, DType::Q4_K}) {
    SCOPED_TRACE(std::string(mb::dtype_name(t)));
    QuantMatrix qg = make_matrix(t, F, k, rng), qu = make_matrix(t, F, k, rng), qd = make_matrix(t, H, F, rng);
    mb::Tensor wg, wu, wd;
    expect_fused_equals_ops(
        k, H, rng, [&] {
          wg = weight_of(*be, t, qg);
          wu = weight_of(*be, t, qu);
          wd = weight_of(*be, t, qd);
        },
        [&](const mb::Tensor& x, mb::Tensor& fused, mb::Tensor& apart) {
          be->gated_ffn(x, wg, wu, wd, fused);
          be->mb::Backend::gated_ffn(x, wg, wu, wd, apart);
        });
  }
}

}  // namespace
