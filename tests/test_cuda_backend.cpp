// The CUDA backend against the CPU backend, op by op (as llama.cpp's test-backend-ops does): the
// same host inputs go through both (`prepare_weight` from the same source tensor, as the model
// loads weights), and the outputs are compared relative to the largest |value| of the CPU's
// output, with every CUDA output checked for NaN/inf. Outputs are poisoned with NaN before each
// op, so an op that leaves part of its output unwritten fails the NaN check.
//
// Tolerances: 1e-5 for f32 elementwise ops and lookups, 1e-2 for matrix products and attention
// (bf16 weights, bf16 KV, int8 activations for the block types: the CUDA backend quantizes
// activations for Q8_0/Q4_0/Q4_K like the CPU's integer path). Every comparison prints its error
// ("[ cuda-op  ]" lines) so a figure that creeps up is visible before it fails.
//
// Only backend.h's API: the file builds without CUDA, and every test skips when
// mb::cuda_device_available() is false (no GPU, or a build without CUDA). Built with
// -DMB_CUDA_TEST_SELF_CHECK, a CPU backend stands in for the CUDA one (see below).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "core/dtype.h"
#include "core/quant.h"
#include "core/tensor.h"
#include "test_util.h"

namespace {

using mb::Backend;
using mb::DType;
using mb::Tensor;

constexpr double kTolF32 = 1e-5;   // f32 elementwise ops, lookups, norms, rope
// Matrix products, attention, MoE: the GPU rounds activations to bf16 for cuBLAS (many rows) or
// to int8 blocks of 32 for the block-type GEMV (few rows), its KV is bf16, and block types
// without GPU kernels (Q4_1, Q5_x, Q5_K, Q6_K) are requantized to Q8_0 at load: measured up to
// 2.2% of the output range on these shapes (docs/cuda.md).
constexpr double kTolMat = 3e-2;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------- the two backends

// Built with -DMB_CUDA_TEST_SELF_CHECK, the tests run with a second CPU backend in the CUDA
// backend's place, on any machine: a check of the harness itself (every error is then ~0).
#ifdef MB_CUDA_TEST_SELF_CHECK
bool gpu_available() { return true; }
std::unique_ptr<Backend> make_gpu() { return mb::make_cpu_backend(); }
constexpr mb::Device kGpuDevice = mb::Device::CPU;
#else
bool gpu_available() { return mb::cuda_device_available(); }
std::unique_ptr<Backend> make_gpu() { return mb::make_backend("cuda"); }
constexpr mb::Device kGpuDevice = mb::Device::CUDA;
#endif

class CudaOps : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    if (!gpu_available()) return;
    cpu_ = mb::make_cpu_backend().release();
    gpu_ = make_gpu().release();
  }
  static void TearDownTestSuite() {
    delete gpu_;
    delete cpu_;
    gpu_ = cpu_ = nullptr;
  }

 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no CUDA device visible (or a build without CUDA)";
    ASSERT_NE(gpu_, nullptr);
    ASSERT_EQ(gpu_->device(), kGpuDevice) << gpu_->name();
  }
  void TearDown() override {
    if (gpu_) gpu_->stage({});  // nothing staged outlives a test
  }
  static Backend& cpu() { return *cpu_; }
  static Backend& gpu() { return *gpu_; }

 private:
  static Backend* cpu_;
  static Backend* gpu_;
};
Backend* CudaOps::cpu_ = nullptr;
Backend* CudaOps::gpu_ = nullptr;

// Clears the staged arrays when a staged section ends (a later vector at a freed staged address
// must not read the stale copy).
struct Unstage {
  Backend* be;
  explicit Unstage(Backend* b) : be(b) {}
  Unstage(const Unstage&) = delete;
  Unstage& operator=(const Unstage&) = delete;
  ~Unstage() { be->stage({}); }
};

// ---------------------------------------------------------------- host data

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.f) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

std::vector<float> bf16_rounded(std::vector<float> v) {
  for (auto& x : v) x = mb::round_to_bf16(x);
  return v;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Tensor host_f32(const std::vector<int64_t>& shape, const std::vector<float>& v) {
  Tensor t = mb::host_tensor(DType::F32, shape);
  EXPECT_EQ(size_t(t.numel()), v.size());
  std::memcpy(t.data, v.data(), std::min(v.size(), size_t(t.numel())) * 4);
  return t;
}

// A host tensor of `dt` holding f (rounded to dt; block types quantized row by row).
Tensor host_weight(DType dt, const std::vector<int64_t>& shape, const std::vector<float>& f) {
  if (dt == DType::F32) return host_f32(shape, f);
  Tensor t = mb::host_tensor(dt, shape);
  if (dt == DType::BF16 || dt == DType::F16) {
    auto* h = t.ptr<uint16_t>();
    for (size_t i = 0; i < f.size(); ++i) h[i] = dt == DType::BF16 ? mb::f32_to_bf16(f[i]) : mb::f32_to_f16(f[i]);
    return t;
  }
  const int64_t cols = shape.back(), rows = numel(shape) / cols;
  const size_t rb = mb::dtype_row_bytes(dt, cols);
  for (int64_t r = 0; r < rows; ++r) mb::quantize_row(dt, f.data() + r * cols, t.ptr<uint8_t>() + size_t(r) * rb, cols);
  return t;
}

// A copy of host f32 data in `be`'s memory: there is no upload op, but a lookup table in f32
// is exactly that (the CPU backend aliases the host tensor; the CUDA backend copies it).
Tensor upload(Backend& be, const std::vector<int64_t>& shape, const std::vector<float>& v) {
  return be.prepare_weight(host_f32(shape, v), DType::F32, Backend::WeightUse::Lookup);
}

// Op output memory filled with NaN first: whatever an op does not write stays NaN.
Tensor poisoned(Backend& be, const std::vector<int64_t>& shape) {
  Tensor t = be.scratch(DType::F32, shape);
  Tensor nan = upload(be, shape, std::vector<float>(size_t(numel(shape)), kNaN));
  be.copy(nan, t);
  return t;
}

std::vector<float> download(Backend& be, const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  be.to_host(t, v.data());
  return v;
}

std::vector<int32_t> download_i32(Backend& be, const Tensor& t) {
  std::vector<int32_t> v(size_t(t.numel()));
  be.to_host(t, v.data());
  return v;
}

// ---------------------------------------------------------------- comparing

struct Err {
  double max_abs = 0, ref_max = 0, rel = 0;
  size_t nonfinite = 0, ref_nonfinite = 0;
};

Err measure(const std::vector<float>& ref, const std::vector<float>& got) {
  Err e;
  EXPECT_EQ(ref.size(), got.size());
  for (size_t i = 0; i < std::min(ref.size(), got.size()); ++i) {
    if (!std::isfinite(got[i])) {
      ++e.nonfinite;
      continue;
    }
    if (!std::isfinite(ref[i])) {
      ++e.ref_nonfinite;
      continue;
    }
    e.ref_max = std::max(e.ref_max, std::fabs(double(ref[i])));
    e.max_abs = std::max(e.max_abs, std::fabs(double(ref[i]) - double(got[i])));
  }
  e.rel = e.max_abs / std::max(e.ref_max, 1e-30);
  return e;
}

// Compares, prints the figure, and records a failure past `tol` or on any non-finite value.
// Returns the relative error.
double check(const std::string& what, const std::vector<float>& ref, const std::vector<float>& got, double tol,
             bool print = true) {
  const Err e = measure(ref, got);
  if (print || e.rel > tol || e.nonfinite)
    std::printf("[ cuda-op  ] %-64s rel %.2e (max|d| %.2e, max|ref| %.2e, tol %.0e)%s\n", what.c_str(), e.rel,
                e.max_abs, e.ref_max, tol, e.nonfinite ? "  NON-FINITE" : "");
  EXPECT_EQ(e.nonfinite, 0u) << what << ": " << e.nonfinite << " non-finite values in the CUDA output";
  EXPECT_EQ(e.ref_nonfinite, 0u) << what << ": the CPU reference itself is not finite";
  EXPECT_LE(e.rel, tol) << what;
  return e.rel;
}

std::string dname(DType dt) { return std::string(mb::dtype_name(dt)); }

// Runs f; an exception (an op the CUDA backend refuses) fails the test with `what` and lets the
// other cases run.
template <class F> void guarded(const std::string& what, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": " << e.what();
  }
}

// ---------------------------------------------------------------- embed

TEST_F(CudaOps, EmbedEveryTableDtype) {
  std::mt19937 rng(1);
  struct Case {
    DType dt;
    int64_t vocab, d;
  };
  std::vector<Case> cases;
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K})
    cases.push_back({dt, 1000, 512});
  for (DType dt : {DType::F32, DType::BF16, DType::Q8_0, DType::Q4_0}) cases.push_back({dt, 700, 640});
  cases.push_back({DType::BF16, 300, 42 * 256});  // a per-layer-embedding table's rows
  for (const Case& c : cases) {
    const auto f = randn(size_t(c.vocab * c.d), rng, 0.05f);
    const Tensor src = host_weight(c.dt, {c.vocab, c.d}, f);
    std::vector<int32_t> ids = {0, int32_t(c.vocab - 1), 5, 5, 17};
    while (ids.size() < 300) ids.push_back(int32_t(rng() % uint32_t(c.vocab)));
    for (auto use : {Backend::WeightUse::Lookup, Backend::WeightUse::MatmulAndLookup}) {
      if (use == Backend::WeightUse::MatmulAndLookup && c.d > 4096) continue;
      const std::string what = "embed " + dname(c.dt) + " [" + std::to_string(c.vocab) + "x" + std::to_string(c.d) +
                               "]" + (use == Backend::WeightUse::Lookup ? " lookup" : " matmul+lookup");
      guarded(what, [&] {
        const Tensor tc = cpu().prepare_weight(src, c.dt, use), tg = gpu().prepare_weight(src, c.dt, use);
        // A table the GPU keeps in another type (block types without kernels there become Q8_0)
        // is re-rounded: held to the matrix tolerance, and said so.
        const bool kept = tg.dtype == c.dt || (c.dt == DType::F16 && tg.dtype == DType::F32);
        const std::string stored = kept ? "" : " (GPU keeps " + dname(tg.dtype) + ")";
        for (int64_t n : {1, 7, 300}) {
          const float scale = 22.627417f;
          Tensor oc = poisoned(cpu(), {n, c.d}), og = poisoned(gpu(), {n, c.d});
          cpu().embed(tc, ids.data(), n, scale, oc);
          gpu().embed(tg, ids.data(), n, scale, og);
          check(what + stored + " n=" + std::to_string(n), download(cpu(), oc), download(gpu(), og),
                kept ? kTolF32 : kTolMat);
        }
      });
    }
  }
}

// ---------------------------------------------------------------- norms, rope

std::vector<float> inv_freq_of(int64_t hd, int64_t rotated_pairs, float theta) {
  std::vector<float> f(size_t(hd / 2), 0.f);  // pairs past rotated_pairs stay unrotated (partial RoPE)
  for (int64_t j = 0; j < rotated_pairs; ++j) f[size_t(j)] = std::pow(theta, -float(2 * j) / float(hd));
  return f;
}

// Widths on each side of the register-resident kernels' limits: not a multiple of 4 (66), of 4 but
// not of 32 (100), 1 to 4 float4s a thread (2,560: E4B; 5,376: 31B; 8,192), and past them (8,200).
TEST_F(CudaOps, RmsNormWithAndWithoutWeightBothFlavours) {
  std::mt19937 rng(2);
  for (int64_t d : {64, 66, 100, 256, 640, 2560, 5376, 8192, 8200}) {
    const int64_t n = 37;
    const auto x = randn(size_t(n * d), rng, 3.f), w = randn(size_t(d), rng, 0.5f);
    const Tensor wc = upload(cpu(), {d}, w), wg = upload(gpu(), {d}, w);
    for (bool add_one : {false, true})
      for (bool weighted : {false, true})
        for (bool in_place : {false, true}) {
          Tensor xc = upload(cpu(), {n, d}, x), xg = upload(gpu(), {n, d}, x);
          Tensor yc = in_place ? xc : poisoned(cpu(), {n, d}), yg = in_place ? xg : poisoned(gpu(), {n, d});
          cpu().rms_norm(xc, weighted ? &wc : nullptr, 1e-6f, add_one, yc);
          gpu().rms_norm(xg, weighted ? &wg : nullptr, 1e-6f, add_one, yg);
          check("rms_norm d=" + std::to_string(d) + (weighted ? " w" : " no-w") + (add_one ? " 1+w" : "") +
                    (in_place ? " in place" : ""),
                download(cpu(), yc), download(gpu(), yg), kTolF32);
        }
  }
}

TEST_F(CudaOps, RopeAndRmsNormRope) {
  std::mt19937 rng(3);
  const std::vector<int32_t> base_pos = {0, 1, 7, 300, 4095, 32767, 131071, 2, 3};
  struct Case {
    int64_t heads, hd, rotated;
  };
  for (Case c : {Case{8, 256, 128}, Case{4, 512, 32}, Case{2, 64, 32}, Case{3, 32, 12}}) {
    const auto inv = inv_freq_of(c.hd, c.rotated, c.hd == 512 ? 1e6f : 1e4f);
    const auto w = randn(size_t(c.hd), rng, 0.5f);
    const Tensor wc = upload(cpu(), {c.hd}, w), wg = upload(gpu(), {c.hd}, w);
    for (int64_t n : {1, 5, 9}) {
      std::vector<int32_t> pos(base_pos.begin(), base_pos.begin() + n);
      const auto x = randn(size_t(n * c.heads * c.hd), rng, 2.f);
      const std::string shape =
          " [" + std::to_string(n) + "," + std::to_string(c.heads) + "," + std::to_string(c.hd) + "]";
      {
        Tensor xc = upload(cpu(), {n, c.heads, c.hd}, x), xg = upload(gpu(), {n, c.heads, c.hd}, x);
        cpu().rope(xc, pos.data(), inv.data());
        gpu().rope(xg, pos.data(), inv.data());
        check("rope" + shape, download(cpu(), xc), download(gpu(), xg), kTolF32);
      }
      for (bool add_one : {false, true})
        for (bool weighted : {false, true}) {
          Tensor xc = upload(cpu(), {n, c.heads, c.hd}, x), xg = upload(gpu(), {n, c.heads, c.hd}, x);
          cpu().rms_norm_rope(xc, weighted ? &wc : nullptr, 1e-6f, add_one, pos.data(), inv.data());
          gpu().rms_norm_rope(xg, weighted ? &wg : nullptr, 1e-6f, add_one, pos.data(), inv.data());
          check("rms_norm_rope" + shape + (weighted ? " w" : " no-w") + (add_one ? " 1+w" : ""),
                download(cpu(), xc), download(gpu(), xg), kTolF32);
        }
    }
  }
}

// Positions and frequencies are host arrays: a call whose arrays changed in place (same
// pointers) must use the new values, never a copy kept from an earlier call.
TEST_F(CudaOps, RopeFollowsArraysChangedInPlace) {
  std::mt19937 rng(4);
  const int64_t n = 3, heads = 2, hd = 64;
  std::vector<int32_t> pos = {0, 5, 9};
  auto inv = inv_freq_of(hd, 24, 1e4f);
  const auto x = randn(size_t(n * heads * hd), rng);
  auto once = [&](const char* what) {
    Tensor xc = upload(cpu(), {n, heads, hd}, x), xg = upload(gpu(), {n, heads, hd}, x);
    cpu().rope(xc, pos.data(), inv.data());
    gpu().rope(xg, pos.data(), inv.data());
    check(std::string("rope, ") + what, download(cpu(), xc), download(gpu(), xg), kTolF32);
  };
  once("first call");
  pos[1] = 6;
  once("a position changed in place");
  inv[3] *= 0.5f;
  once("a frequency changed in place");
  pos = {0, 5, 9};
  once("back to the first positions");
}

TEST_F(CudaOps, AddRmsNormWithScale) {
  std::mt19937 rng(5);
  for (int64_t d : {64, 66, 640, 2560, 5376, 8200}) {
    const int64_t n = 19;
    const auto x = randn(size_t(n * d), rng, 3.f), br = randn(size_t(n * d), rng), w = randn(size_t(d), rng, 0.5f);
    const Tensor wc = upload(cpu(), {d}, w), wg = upload(gpu(), {d}, w);
    for (float scale : {1.f, 0.7f})
      for (bool add_one : {false, true})
        for (bool weighted : {false, true}) {
          Tensor xc = upload(cpu(), {n, d}, x), xg = upload(gpu(), {n, d}, x);
          Tensor bc = upload(cpu(), {n, d}, br), bg = upload(gpu(), {n, d}, br);
          cpu().add_rms_norm(xc, bc, weighted ? &wc : nullptr, 1e-6f, add_one, scale);
          gpu().add_rms_norm(xg, bg, weighted ? &wg : nullptr, 1e-6f, add_one, scale);
          check("add_rms_norm d=" + std::to_string(d) + " scale=" + std::to_string(scale).substr(0, 4) +
                    (weighted ? " w" : " no-w") + (add_one ? " 1+w" : ""),
                download(cpu(), xc), download(gpu(), xg), kTolF32);
          // add_rms_norm_norm: the same x, and y = the next norm of it (its own weight, or none).
          Tensor xc2 = upload(cpu(), {n, d}, x), xg2 = upload(gpu(), {n, d}, x);
          Tensor bc2 = upload(cpu(), {n, d}, br), bg2 = upload(gpu(), {n, d}, br);
          Tensor yc = poisoned(cpu(), {n, d}), yg = poisoned(gpu(), {n, d});
          cpu().add_rms_norm_norm(xc2, bc2, weighted ? &wc : nullptr, 1e-6f, add_one, scale, weighted ? nullptr : &wc,
                                  yc);
          gpu().add_rms_norm_norm(xg2, bg2, weighted ? &wg : nullptr, 1e-6f, add_one, scale, weighted ? nullptr : &wg,
                                  yg);
          check("add_rms_norm_norm x d=" + std::to_string(d), download(cpu(), xc2), download(gpu(), xg2), kTolF32);
          check("add_rms_norm_norm y d=" + std::to_string(d), download(cpu(), yc), download(gpu(), yg), kTolF32);
        }
  }
}

// ---------------------------------------------------------------- elementwise

TEST_F(CudaOps, ElementwiseOps) {
  std::mt19937 rng(6);
  const int64_t n = 37, d = 1000;
  const auto a = randn(size_t(n * d), rng, 3.f), b = randn(size_t(n * d), rng, 2.f), row = randn(size_t(d), rng);
  auto pair = [&](const std::vector<float>& v, std::vector<int64_t> shape) {
    return std::make_pair(upload(cpu(), shape, v), upload(gpu(), shape, v));
  };
  // gelu_tanh_mul: separate output, and in place over either input (the model writes over gate).
  for (int where : {0, 1, 2}) {
    auto [gc, gg] = pair(a, {n, d});
    auto [uc, ug] = pair(b, {n, d});
    Tensor oc = where == 0 ? poisoned(cpu(), {n, d}) : where == 1 ? gc : uc;
    Tensor og = where == 0 ? poisoned(gpu(), {n, d}) : where == 1 ? gg : ug;
    cpu().gelu_tanh_mul(gc, uc, oc);
    gpu().gelu_tanh_mul(gg, ug, og);
    check(std::string("gelu_tanh_mul") + (where == 0 ? "" : where == 1 ? " out=gate" : " out=up"),
          download(cpu(), oc), download(gpu(), og), kTolF32);
  }
  {
    auto [ac, ag] = pair(a, {n, d});
    auto [bc, bg] = pair(b, {n, d});
    Tensor oc = poisoned(cpu(), {n, d}), og = poisoned(gpu(), {n, d});
    cpu().add(ac, bc, oc);
    gpu().add(ag, bg, og);
    check("add", download(cpu(), oc), download(gpu(), og), kTolF32);
    cpu().add(ac, bc, ac);
    gpu().add(ag, bg, ag);
    check("add in place", download(cpu(), ac), download(gpu(), ag), kTolF32);
  }
  for (bool broadcast : {false, true}) {
    auto [ac, ag] = pair(a, {n, d});
    auto [bc, bg] = broadcast ? pair(row, {1, d}) : pair(b, {n, d});
    Tensor oc = poisoned(cpu(), {n, d}), og = poisoned(gpu(), {n, d});
    cpu().mul(ac, bc, oc);
    gpu().mul(ag, bg, og);
    check(std::string("mul") + (broadcast ? " (b: one row, broadcast)" : ""), download(cpu(), oc),
          download(gpu(), og), kTolF32);
  }
  {
    auto [ac, ag] = pair(a, {n, d});
    cpu().scale(ac, 0.37f);
    gpu().scale(ag, 0.37f);
    check("scale", download(cpu(), ac), download(gpu(), ag), kTolF32);
  }
  for (float cap : {30.f, 50.f}) {
    auto big = randn(size_t(n * d), rng, 40.f);
    for (float v : {0.f, 1e-30f, 1e4f, -1e4f, 1e30f, -1e30f}) big[size_t(rng() % big.size())] = v;
    auto [xc, xg] = pair(big, {n, d});
    cpu().softcap(xc, cap);
    gpu().softcap(xg, cap);
    check("softcap " + std::to_string(int(cap)), download(cpu(), xc), download(gpu(), xg), kTolF32);
  }
}

// The media towers' ops (the audio conformer's and its subsampling's), against the CPU's on the
// shapes the towers use and on odd ones.
TEST_F(CudaOps, TowerOps) {
  std::mt19937 rng(61);
  auto pair = [&](const std::vector<float>& v, std::vector<int64_t> shape) {
    return std::make_pair(upload(cpu(), shape, v), upload(gpu(), shape, v));
  };
  for (int64_t d : {int64_t(37), int64_t(4096)}) {
    const int64_t n = 9;
    auto [xc, xg] = pair(randn(size_t(n * d), rng, 4.f), {n, d});
    cpu().silu(xc);
    gpu().silu(xg);
    check("silu " + std::to_string(d), download(cpu(), xc), download(gpu(), xg), kTolF32);
    auto [bc, bg] = pair(randn(size_t(d), rng), {d});
    Tensor oc = poisoned(cpu(), {n, d}), og = poisoned(gpu(), {n, d});
    cpu().add(xc, bc, oc);
    gpu().add(xg, bg, og);
    check("add (b: one row, broadcast) " + std::to_string(d), download(cpu(), oc), download(gpu(), og), kTolF32);
  }
  for (int64_t width : {int64_t(32), int64_t(128), int64_t(1152)})
    for (bool bias : {false, true})
      for (bool relu : {false, true}) {
        const int64_t rows = 23;
        auto x = randn(size_t(rows * width), rng, 3.f);
        for (int64_t c = 0; c < width; ++c) x[size_t(c)] += 50.f;
        auto [xc, xg] = pair(x, {rows, width});
        auto [wc, wg] = pair(randn(size_t(width), rng), {width});
        auto [bc, bg] = pair(randn(size_t(width), rng), {width});
        Tensor oc = poisoned(cpu(), {rows, width}), og = poisoned(gpu(), {rows, width});
        cpu().layer_norm(xc, wc, bias ? &bc : nullptr, 1e-6f, relu, oc);
        gpu().layer_norm(xg, wg, bias ? &bg : nullptr, 1e-6f, relu, og);
        check("layer_norm " + std::to_string(width) + (bias ? " bias" : "") + (relu ? " relu" : ""),
              download(cpu(), oc), download(gpu(), og), kTolF32);
      }
  {  // The conformer's subsampling: 3x3 stride 2 over (time, mel), a masked frame, two passes.
    for (auto [h, w, c] : {std::tuple<int64_t, int64_t, int64_t>{51, 128, 1}, {26, 64, 128}, {7, 5, 3}}) {
      const Backend::Im2col conv{3, 2, 1};
      auto [xc, xg] = pair(randn(size_t(h * w * c), rng), {h, w, c});
      std::vector<uint8_t> valid(size_t(h), 1);
      valid[2] = valid[size_t(h - 1)] = 0;
      const int64_t ho = (h + 1) / 2, wo = (w + 1) / 2, half = ho / 2;
      for (auto [r0, rows] : {std::pair<int64_t, int64_t>{0, half}, {half, ho - half}}) {
        if (rows == 0) continue;
        Tensor oc = poisoned(cpu(), {rows, wo, c * 9}), og = poisoned(gpu(), {rows, wo, c * 9});
        cpu().im2col(xc, valid.data(), conv, r0, oc);
        gpu().im2col(xg, valid.data(), conv, r0, og);
        check("im2col " + std::to_string(h) + "x" + std::to_string(w) + "x" + std::to_string(c) + " from row " +
                  std::to_string(r0),
              download(cpu(), oc), download(gpu(), og), kTolF32);
      }
    }
  }
  {  // The ViT's 3x3 pooling of 2,520 patches of 768 into 280 rows.
    const int64_t n = 2520, c = 768, group = 9, m = 280;
    auto [sc, sg] = pair(randn(size_t(n * c), rng), {n, c});
    std::vector<int32_t> rows(size_t(m * group));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = int32_t((i * 7919) % size_t(n));
    Tensor oc = poisoned(cpu(), {m, c}), og = poisoned(gpu(), {m, c});
    cpu().gather_sum_rows(sc, rows.data(), group, 1.f / 9, oc);
    gpu().gather_sum_rows(sg, rows.data(), group, 1.f / 9, og);
    check("gather_sum_rows 9 of 2520 -> 280", download(cpu(), oc), download(gpu(), og), kTolF32);
  }
  for (int64_t n : {int64_t(2), int64_t(375)}) {
    const int64_t D = 1024, K = 5;
    auto [gc, gg] = pair(randn(size_t(n * 2 * D), rng, 2.f), {n, 2 * D});
    auto [wc, wg] = pair(randn(size_t(D * K), rng, 0.5f), {D, K});
    Tensor oc = poisoned(cpu(), {n, D}), og = poisoned(gpu(), {n, D});
    cpu().glu_causal_conv(gc, wc, oc);
    gpu().glu_causal_conv(gg, wg, og);
    check("glu_causal_conv n=" + std::to_string(n), download(cpu(), oc), download(gpu(), og), kTolF32);
  }
  // Chunked local attention: E4B's audio shape (8 heads of 128, chunks of 12, 12 frames back), with
  // holes in the frame mask and a padded tail whose queries see no valid key; and a small odd one.
  struct Case {
    int64_t n, heads, hd, chunk, left;
  };
  for (const Case& k : {Case{375, 8, 128, 12, 12}, Case{29, 3, 40, 5, 4}}) {
    Backend::LocalAttention p;
    p.chunk = k.chunk;
    p.left = k.left;
    p.context = k.chunk + k.left;
    p.rel_offset = p.context / 2 - p.left;
    p.q_scale = float(std::pow(double(k.hd), -0.5) / std::log(2.0));
    p.k_scale = float(std::log(1.0 + std::exp(1.0)) / std::log(2.0));
    p.logit_cap = 50.f;
    p.invalid_logit = -1e9f;
    std::vector<uint8_t> valid(size_t(k.n), 1);
    for (int64_t t = 3; t < k.n; t += 7) valid[size_t(t)] = 0;
    std::fill(valid.end() - 6, valid.end(), 0);
    p.valid = valid.data();
    const int64_t width = k.heads * k.hd, P = p.context / 2 + 1;
    const std::vector<int64_t> shape{k.n, k.heads, k.hd};
    auto [qc, qg] = pair(randn(size_t(k.n * width), rng, 2.f), shape);
    auto [kc, kg] = pair(randn(size_t(k.n * width), rng, 2.f), shape);
    auto [vc, vg] = pair(randn(size_t(k.n * width), rng), shape);
    auto [gc, gg] = pair(randn(size_t(k.hd), rng, 0.5f), {k.hd});
    auto [rc, rg] = pair(randn(size_t(P * width), rng), {P, width});
    Tensor oc = poisoned(cpu(), shape), og = poisoned(gpu(), shape);
    cpu().local_attention(qc, kc, vc, gc, rc, p, oc);
    gpu().local_attention(qg, kg, vg, gg, rg, p, og);
    check("local_attention n=" + std::to_string(k.n) + " hd=" + std::to_string(k.hd), download(cpu(), oc),
          download(gpu(), og), kTolF32);
  }
}

TEST_F(CudaOps, SliceGatherCopy) {
  std::mt19937 rng(7);
  const int64_t n = 23, c = 100;
  const auto src = randn(size_t(n * c), rng);
  const Tensor sc = upload(cpu(), {n, c}, src), sg = upload(gpu(), {n, c}, src);
  for (auto [begin, w] : {std::pair<int64_t, int64_t>{0, 100}, {17, 40}, {99, 1}, {50, 50}}) {
    Tensor oc = poisoned(cpu(), {n, w}), og = poisoned(gpu(), {n, w});
    cpu().slice_cols(sc, begin, oc);
    gpu().slice_cols(sg, begin, og);
    check("slice_cols [" + std::to_string(begin) + ", +" + std::to_string(w) + ")", download(cpu(), oc),
          download(gpu(), og), 0);
  }
  const std::vector<int32_t> rows = {22, 0, 5, 5, 13, 22, 1};
  for (int64_t k : {1, 7}) {
    Tensor oc = poisoned(cpu(), {k, c}), og = poisoned(gpu(), {k, c});
    cpu().gather_rows(sc, rows.data(), k, oc);
    gpu().gather_rows(sg, rows.data(), k, og);
    check("gather_rows " + std::to_string(k), download(cpu(), oc), download(gpu(), og), 0);
  }
  {
    Tensor oc = poisoned(cpu(), {n, c}), og = poisoned(gpu(), {n, c});
    cpu().copy(sc, oc);
    gpu().copy(sg, og);
    check("copy", download(cpu(), oc), download(gpu(), og), 0);
  }
}

// ---------------------------------------------------------------- matmuls

const std::vector<DType>& weight_dtypes() {
  static const std::vector<DType> v = {DType::F32, DType::BF16, DType::F16, DType::Q8_0,
                                       DType::Q4_0, DType::Q4_K, DType::Q6_K};
  return v;
}

struct Weight {
  Tensor c, g;  // prepared on the CPU and on the GPU from one host source
};
Weight prepare_both(Backend& cpu, Backend& gpu, const Tensor& src, DType dt) {
  return {cpu.prepare_weight(src, dt), gpu.prepare_weight(src, dt)};
}
Weight random_weight(Backend& cpu, Backend& gpu, DType dt, std::vector<int64_t> shape, std::mt19937& rng) {
  const auto f = randn(size_t(numel(shape)), rng, 1.f / std::sqrt(float(shape.back())));
  return prepare_both(cpu, gpu, host_weight(dt, shape, f), dt);
}

// " (GPU keeps X)" when the GPU holds a weight in another type than asked for.
std::string stored_as(const Tensor& g, DType asked) {
  return g.dtype == asked ? "" : " (GPU keeps " + dname(g.dtype) + ")";
}

std::string mm_label(const char* op, DType dt, int64_t n, int64_t k, int64_t m) {
  return std::string(op) + " " + dname(dt) + " n=" + std::to_string(n) + " k=" + std::to_string(k) + " m=" +
         std::to_string(m);
}

// One line per weight: the error at each n, the worst last.
struct RowReport {
  explicit RowReport(std::string h) : head(std::move(h)) {}
  std::string head, body;
  double worst = 0;
  void add(int64_t n, double rel) {
    char b[48];
    std::snprintf(b, sizeof b, " %lld:%.1e", static_cast<long long>(n), rel);
    body += b;
    worst = std::max(worst, rel);
  }
  void print(double tol) const {
    std::printf("[ cuda-op  ] %s  rel by n:%s  worst %.2e (tol %.0e)\n", head.c_str(), body.c_str(), worst, tol);
  }
};

TEST_F(CudaOps, MatmulEveryWeightDtypeAndRowCount) {
  std::mt19937 rng(8);
  struct Shape {
    int64_t k, m;
  };
  const std::vector<Shape> shapes = {{256, 13}, {512, 1000}, {1536, 771}, {2560, 2048}, {2560, 262}};
  const std::vector<int64_t> ns = {1, 2, 5, 8, 9, 16, 64, 300};
  for (DType dt : weight_dtypes()) {
    if (!gpu().supports_weight_dtype(dt)) {
      ADD_FAILURE() << "the CUDA backend does not take " << dname(dt) << " weights";
      continue;
    }
    for (const Shape& s : shapes) guarded("matmul " + dname(dt), [&] {
      const Weight w = random_weight(cpu(), gpu(), dt, {s.m, s.k}, rng);
      RowReport rep{"matmul " + dname(dt) + stored_as(w.g, dt) + " k=" + std::to_string(s.k) + " m=" +
                    std::to_string(s.m)};
      for (int64_t n : ns) {
        const auto x = randn(size_t(n * s.k), rng);
        const Tensor xc = upload(cpu(), {n, s.k}, x), xg = upload(gpu(), {n, s.k}, x);
        Tensor yc = poisoned(cpu(), {n, s.m}), yg = poisoned(gpu(), {n, s.m});
        cpu().matmul(xc, w.c, yc);
        gpu().matmul(xg, w.g, yg);
        rep.add(n, check(mm_label("matmul", dt, n, s.k, s.m), download(cpu(), yc), download(gpu(), yg), kTolMat,
                         /*print=*/false));
      }
      rep.print(kTolMat);
    });
  }
}

// A second GPU backend made while `name` is set to `value` (a backend reads its switches when it
// is made).
std::unique_ptr<Backend> gpu_with(const char* name, const char* value) {
  mbtest::ScopedEnv env(name, value);
  return make_gpu();
}
// The producers' copies for the products after them (the default, here whatever the environment
// says): 8-16 rows in the block products' tiled layout, more rows as bf16 for cuBLAS.
std::unique_ptr<Backend> gpu_with_tiled_and_bf16_outputs() {
  mbtest::ScopedEnv tiled("MARKBASE_CUDA_TILED_QUANT", "1"), bf16("MARKBASE_CUDA_BF16_OUT", "1");
  return make_gpu();
}

// Block-type weights without their bf16 copy, as large models get them when the GPU would be too
// full for one (docs/cuda.md; MARKBASE_CUDA_BF16_COPIES=0 forces it on a backend made after it is
// set): products of many rows take the block kernels (Q8_0, Q4_0; below 128 rows) or dequantize slabs of
// rows for cuBLAS, which MARKBASE_CUDA_MMQ_ROWS=0 makes every type do.
std::unique_ptr<Backend> gpu_with_slabs_alone() {
  mbtest::ScopedEnv copies("MARKBASE_CUDA_BF16_COPIES", "0"), mmq("MARKBASE_CUDA_MMQ_ROWS", "0");
  return make_gpu();
}
TEST_F(CudaOps, MatmulBlockWeightsWithoutBf16Copies) {
  const std::unique_ptr<Backend> nocopy = gpu_with("MARKBASE_CUDA_BF16_COPIES", "0"), slabs = gpu_with_slabs_alone();
  std::mt19937 rng(17);
  for (DType dt : {DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K})
    for (auto [k, m] : {std::pair<int64_t, int64_t>{2560, 2048}, {768, 333}})
      for (Backend* g : {nocopy.get(), slabs.get()})
        guarded("matmul without bf16 copies " + dname(dt), [&] {
          const std::string how = g == slabs.get() ? " slabs" : "";
          const Weight w = random_weight(cpu(), *g, dt, {m, k}, rng);
          RowReport rep{"matmul " + dname(dt) + stored_as(w.g, dt) + " no bf16 copy" + how + " k=" + std::to_string(k) +
                        " m=" + std::to_string(m)};
          for (int64_t n : {1, 9, 64, 300, 520}) {
            const auto x = randn(size_t(n * k), rng);
            const Tensor xc = upload(cpu(), {n, k}, x), xg = upload(*g, {n, k}, x);
            Tensor yc = poisoned(cpu(), {n, m}), yg = poisoned(*g, {n, m});
            cpu().matmul(xc, w.c, yc);
            g->matmul(xg, w.g, yg);
            const std::string op = "matmul no-bf16-copy" + how;
            rep.add(n, check(mm_label(op.c_str(), dt, n, k, m), download(cpu(), yc), download(*g, yg), kTolMat, false));
          }
          rep.print(kTolMat);
        });
  // 520 rows: slabs by default (kSlabRows).
  for (int64_t n : {64, 520}) guarded("gated_ffn without bf16 copies", [&] {
    const int64_t H = 768, F = 2048;
    const Weight gate = random_weight(cpu(), *nocopy, DType::Q4_0, {F, H}, rng);
    const Weight up = random_weight(cpu(), *nocopy, DType::Q4_0, {F, H}, rng);
    const Weight down = random_weight(cpu(), *nocopy, DType::Q4_K, {H, F}, rng);
    const auto x = randn(size_t(n * H), rng);
    const Tensor xc = upload(cpu(), {n, H}, x), xg = upload(*nocopy, {n, H}, x);
    Tensor oc = poisoned(cpu(), {n, H}), og = poisoned(*nocopy, {n, H});
    cpu().gated_ffn(xc, gate.c, up.c, down.c, oc);
    nocopy->gated_ffn(xg, gate.g, up.g, down.g, og);
    check("gated_ffn Q4_0/Q4_K no bf16 copy n=" + std::to_string(n), download(cpu(), oc), download(*nocopy, og),
          kTolMat);
  });
}

// Block types the GGUF files use beyond the seven above (Gemma 3 270M Q4_K_M has Q5_0 and
// Q8_0 fallbacks for its 640-wide rows): tested where the CUDA backend says it takes them.
TEST_F(CudaOps, MatmulOtherBlockTypesWhereSupported) {
  std::mt19937 rng(9);
  for (DType dt : {DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q5_K}) {
    if (!gpu().supports_weight_dtype(dt)) {
      std::printf("[ cuda-op  ] matmul %s: not supported by the CUDA backend (models with it fail to load)\n",
                  dname(dt).c_str());
      continue;
    }
    const int64_t k = 768, m = 333;
    const Weight w = random_weight(cpu(), gpu(), dt, {m, k}, rng);
    RowReport rep{"matmul " + dname(dt) + stored_as(w.g, dt) + " k=768 m=333"};
    for (int64_t n : {1, 8, 64}) {
      const auto x = randn(size_t(n * k), rng);
      const Tensor xc = upload(cpu(), {n, k}, x), xg = upload(gpu(), {n, k}, x);
      Tensor yc = poisoned(cpu(), {n, m}), yg = poisoned(gpu(), {n, m});
      cpu().matmul(xc, w.c, yc);
      gpu().matmul(xg, w.g, yg);
      rep.add(n, check(mm_label("matmul", dt, n, k, m), download(cpu(), yc), download(gpu(), yg), kTolMat, false));
    }
    rep.print(kTolMat);
  }
}

// prepare_weight converting at load (`--dtype q4_0` on a bf16 checkpoint, the synthetic models):
// a bf16 or f32 source quantized by each backend itself. Rows that are not whole blocks keep the
// source's type on both.
TEST_F(CudaOps, MatmulWeightsConvertedAtLoad) {
  std::mt19937 rng(10);
  for (DType src_dt : {DType::F32, DType::BF16})
    for (DType dt : {DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K})
      for (int64_t k : {int64_t(512), int64_t(640)}) guarded("converted " + dname(src_dt) + "->" + dname(dt), [&] {
        if (src_dt == dt) return;
        const int64_t m = 200;
        const auto f = randn(size_t(m * k), rng, 1.f / std::sqrt(float(k)));
        const Weight w = prepare_both(cpu(), gpu(), host_weight(src_dt, {m, k}, f), dt);
        RowReport rep{"matmul " + dname(src_dt) + "->" + dname(dt) + stored_as(w.g, dt) + " k=" + std::to_string(k) +
                      " m=200"};
        for (int64_t n : {1, 64}) {
          const auto x = randn(size_t(n * k), rng);
          const Tensor xc = upload(cpu(), {n, k}, x), xg = upload(gpu(), {n, k}, x);
          Tensor yc = poisoned(cpu(), {n, m}), yg = poisoned(gpu(), {n, m});
          cpu().matmul(xc, w.c, yc);
          gpu().matmul(xg, w.g, yg);
          rep.add(n, check(mm_label("matmul converted", dt, n, k, m), download(cpu(), yc), download(gpu(), yg),
                           kTolMat, false));
        }
        rep.print(kTolMat);
      });
}

// A norm of a few rows also quantizes what it writes for the block-type product after it (3 rows:
// the GEMV's layout; 8, with MARKBASE_CUDA_TILED_QUANT=1: the block products' tiled one), and of
// more rows writes a bf16 copy for cuBLAS (40 rows, BF16 weights); the product takes that copy
// only while nothing has run since. Here a norm's output goes to the product directly, after an op
// that rescales it in place, and after an op on other memory; against the CPU, and against the GPU
// converting in the product's own kernels (MARKBASE_CUDA_NORM_QUANT=0: the same numbers).
TEST_F(CudaOps, NormThenBlockMatmulUsesTheNormsOwnQuantization) {
  const int64_t d = 2560, m = 512;
  const std::unique_ptr<Backend> unfused = gpu_with("MARKBASE_CUDA_NORM_QUANT", "0"),
                                 tiled = gpu_with_tiled_and_bf16_outputs();
  auto weight_on = [&](Backend& be, DType dt) {
    std::mt19937 wr(23);
    return random_weight(cpu(), be, dt, {m, d}, wr);
  };
  const Weight wq = weight_on(*tiled, DType::Q4_0), wqu = weight_on(*unfused, DType::Q4_0);
  const Weight wb = weight_on(*tiled, DType::BF16), wbu = weight_on(*unfused, DType::BF16);
  for (int64_t n : {3, 8, 40}) {
    const Weight& w = n > 16 ? wb : wq;
    const Weight& wu = n > 16 ? wbu : wqu;
    std::mt19937 rng(21);
    const auto x = randn(size_t(n * d), rng, 3.f), br = randn(size_t(n * d), rng), nw = randn(size_t(d), rng, 0.5f);
    for (int between : {0, 1, 2}) {  // nothing; a scale of the norm's output; a scale of something else
      for (int which : {0, 1, 2}) {  // rms_norm; add_rms_norm (in place); add_rms_norm_norm
        auto side = [&](Backend& be, const Tensor& wt) {
          const Tensor normw = upload(be, {d}, nw);
          Tensor xs = upload(be, {n, d}, x), bs = upload(be, {n, d}, br), other = upload(be, {n, d}, br);
          Tensor y = be.scratch(DType::F32, {n, d});
          Tensor* in = &y;
          if (which == 0) be.rms_norm(xs, &normw, 1e-6f, false, y);
          if (which == 1) be.add_rms_norm(xs, bs, &normw, 1e-6f, false, 1.f), in = &xs;
          if (which == 2) be.add_rms_norm_norm(xs, bs, &normw, 1e-6f, false, 1.f, &normw, y);
          if (between == 1) be.scale(*in, -2.f);
          if (between == 2) be.scale(other, -2.f);
          Tensor out = be.scratch(DType::F32, {n, m});
          be.matmul(*in, wt, out);
          return download(be, out);
        };
        const std::string label = "norm " + std::to_string(which) + " then matmul of " + std::to_string(n) +
                                  " rows, between: " + std::to_string(between);
        const auto fused = side(*tiled, w.g);
        check(label, side(cpu(), w.c), fused, kTolMat);
        check(label + ", against NORM_QUANT=0", side(*unfused, wu.g), fused, 1e-6);
      }
    }
  }
}

TEST_F(CudaOps, MatmulsSeveralWeightsOneInput) {
  std::mt19937 rng(11);
  const int64_t k = 2560;
  const std::vector<int64_t> ms = {2048, 512, 512};
  for (DType dt : weight_dtypes()) guarded("matmuls " + dname(dt), [&] {
    std::vector<Weight> ws;
    for (int64_t m : ms) ws.push_back(random_weight(cpu(), gpu(), dt, {m, k}, rng));
    RowReport rep{"matmuls (q/k/v) " + dname(dt) + " k=2560 m=2048,512,512"};
    for (int64_t n : {1, 5, 8, 64, 300}) {
      const auto x = randn(size_t(n * k), rng);
      const Tensor xc = upload(cpu(), {n, k}, x), xg = upload(gpu(), {n, k}, x);
      std::vector<Tensor> yc, yg;
      for (int64_t m : ms) yc.push_back(poisoned(cpu(), {n, m})), yg.push_back(poisoned(gpu(), {n, m}));
      std::vector<const Tensor*> wc, wg;
      std::vector<Tensor*> pc, pg;
      for (size_t i = 0; i < ms.size(); ++i) {
        wc.push_back(&ws[i].c), wg.push_back(&ws[i].g);
        pc.push_back(&yc[i]), pg.push_back(&yg[i]);
      }
      cpu().matmuls(xc, wc, pc);
      gpu().matmuls(xg, wg, pg);
      double worst = 0;
      for (size_t i = 0; i < ms.size(); ++i)
        worst = std::max(worst, check(mm_label("matmuls", dt, n, k, ms[i]) + " #" + std::to_string(i),
                                      download(cpu(), yc[i]), download(gpu(), yg[i]), kTolMat, false));
      rep.add(n, worst);
    }
    rep.print(kTolMat);
  });
}

TEST_F(CudaOps, MatmulGeluMulAndGatedFfn) {
  std::mt19937 rng(12);
  const int64_t H = 768, F = 2048;
  for (DType dt : weight_dtypes()) guarded("matmul_gelu_mul/gated_ffn " + dname(dt), [&] {
    const Weight gate = random_weight(cpu(), gpu(), dt, {F, H}, rng), up = random_weight(cpu(), gpu(), dt, {F, H}, rng);
    const Weight down = random_weight(cpu(), gpu(), dt, {H, F}, rng);
    RowReport r1{"matmul_gelu_mul " + dname(dt) + " H=768 F=2048"}, r2{"gated_ffn " + dname(dt) + " H=768 F=2048"},
        r3{"matmul_gelu_times " + dname(dt) + " H=768 F=2048"};
    for (int64_t n : {1, 2, 8, 16, 64, 300}) {
      const auto x = randn(size_t(n * H), rng);
      const Tensor xc = upload(cpu(), {n, H}, x), xg = upload(gpu(), {n, H}, x);
      Tensor gc = poisoned(cpu(), {n, F}), gg = poisoned(gpu(), {n, F});
      cpu().matmul_gelu_mul(xc, gate.c, up.c, gc);
      gpu().matmul_gelu_mul(xg, gate.g, up.g, gg);
      r1.add(n, check(mm_label("matmul_gelu_mul", dt, n, H, F), download(cpu(), gc), download(gpu(), gg), kTolMat,
                      false));
      Tensor oc = poisoned(cpu(), {n, H}), og = poisoned(gpu(), {n, H});
      cpu().gated_ffn(xc, gate.c, up.c, down.c, oc);
      gpu().gated_ffn(xg, gate.g, up.g, down.g, og);
      r2.add(n, check(mm_label("gated_ffn", dt, n, H, F), download(cpu(), oc), download(gpu(), og), kTolMat, false));
      const auto m = randn(size_t(n * F), rng);
      const Tensor mc = upload(cpu(), {n, F}, m), mg = upload(gpu(), {n, F}, m);
      Tensor tc = poisoned(cpu(), {n, F}), tg = poisoned(gpu(), {n, F});
      cpu().matmul_gelu_times(xc, gate.c, mc, tc);
      gpu().matmul_gelu_times(xg, gate.g, mg, tg);
      r3.add(n, check(mm_label("matmul_gelu_times", dt, n, H, F), download(cpu(), tc), download(gpu(), tg), kTolMat,
                      false));
    }
    r1.print(kTolMat);
    r2.print(kTolMat);
    r3.print(kTolMat);
  });
}

// Gate and up as one cuBLASLt product of batch 2 (the default on cuBLAS's path) give what two
// products give, whichever of the two weights lies first in memory (the pair's first matrix is the
// lower address: swapping the arguments covers both orders).
TEST_F(CudaOps, GluPairIsTwoProducts) {
  const int64_t H = 768, F = 2048;
  const std::unique_ptr<Backend> two = gpu_with("MARKBASE_CUDA_PAIR_GLU", "0"),
                                 pair = gpu_with("MARKBASE_CUDA_PAIR_GLU", "1");
  std::mt19937 rng(23);
  const auto fa = randn(size_t(F * H), rng, 1.f / std::sqrt(float(H))),
             fb = randn(size_t(F * H), rng, 1.f / std::sqrt(float(H))),
             fd = randn(size_t(H * F), rng, 1.f / std::sqrt(float(F)));
  for (DType dt : {DType::BF16, DType::Q4_0})
    for (bool swap : {false, true})
      for (int64_t n : {64, 300}) guarded("GLU pair " + dname(dt), [&] {
          const auto x = randn(size_t(n * H), rng);
          auto side = [&](Backend& be) {
            const Tensor a = be.prepare_weight(host_weight(dt, {F, H}, fa), dt),
                         b = be.prepare_weight(host_weight(dt, {F, H}, fb), dt),
                         d = be.prepare_weight(host_weight(dt, {H, F}, fd), dt);
            const Tensor& gate = swap ? b : a;
            const Tensor& up = swap ? a : b;
            const Tensor xs = upload(be, {n, H}, x);
            Tensor g = poisoned(be, {n, F}), o = poisoned(be, {n, H});
            be.matmul_gelu_mul(xs, gate, up, g);
            be.gated_ffn(xs, gate, up, d, o);
            return std::make_pair(download(be, g), download(be, o));
          };
          const auto [g2, o2] = side(*two);
          const auto [g1, o1] = side(*pair);
          const std::string what = mm_label("GLU", dt, n, H, F) + (swap ? " (arguments swapped)" : "");
          check(what + ": pair vs two products", g2, g1, 1e-5);
          // The GLU's output is rounded to bf16 for the down product, where one ulp apart may round apart.
          check(what + ": gated_ffn, pair vs two products", o2, o1, 1e-3);
        });
}

// The GLU's and the gelu-times op's bf16 copies of their outputs (MARKBASE_CUDA_BF16_OUT=1) go to
// the product after them in place of its own conversion: the same numbers as without them.
TEST_F(CudaOps, GatedFfnOnTheGluBf16CopyIsTheSame) {
  const int64_t H = 768, F = 2048, n = 64;
  const std::unique_ptr<Backend> plain = gpu_with("MARKBASE_CUDA_BF16_OUT", "0"),
                                 copies = gpu_with("MARKBASE_CUDA_BF16_OUT", "1");
  std::mt19937 data(19);
  const auto x = randn(size_t(n * H), data), m = randn(size_t(n * F), data);
  auto side = [&](Backend& be) {
    std::mt19937 wr(29);
    const Weight gate = random_weight(cpu(), be, DType::BF16, {F, H}, wr), up = random_weight(cpu(), be, DType::BF16, {F, H}, wr);
    const Weight down = random_weight(cpu(), be, DType::BF16, {H, F}, wr);
    const Tensor xs = upload(be, {n, H}, x), ms = upload(be, {n, F}, m);
    Tensor o = poisoned(be, {n, H}), t = poisoned(be, {n, F}), o2 = poisoned(be, {n, H});
    be.gated_ffn(xs, gate.g, up.g, down.g, o);
    be.matmul_gelu_times(xs, gate.g, ms, t);
    be.matmul(t, down.g, o2);
    std::vector<float> out = download(be, o), second = download(be, o2);
    out.insert(out.end(), second.begin(), second.end());
    return out;
  };
  check("gated_ffn and gelu-times then matmul, BF16, 64 rows: bf16 copies vs none", side(*plain), side(*copies), 1e-6);
}

// The media towers' clipped linears: the backend's own matmul_clipped (one pass before and after cuBLAS's
// product) against the default's separate ops on the same backend, bit for bit, and against the CPU.
TEST_F(CudaOps, ClippedMatmulIsTheClampsAroundIt) {
  std::mt19937 rng(13);
  const int64_t k = 256, m = 384;
  const float inf = std::numeric_limits<float>::infinity();
  using Act = Backend::Activation;
  const std::vector<Backend::Clip> clips = {
      {-inf, inf, -inf, inf}, {-0.8f, 0.9f, -1.5f, 1.25f}, {-inf, 0.5f, -0.75f, inf}, {-1.f, inf, -inf, inf}};
  for (DType dt : {DType::BF16, DType::Q8_0, DType::F32}) guarded("matmul_clipped " + dname(dt), [&] {
    const Weight w = random_weight(cpu(), gpu(), dt, {m, k}, rng);
    for (int64_t n : {1, 6, 64, 300}) {
      auto x = randn(size_t(n * k), rng);
      x[3] = kNaN;  // a NaN goes through every clamp as the separate ops pass it
      const auto t = randn(size_t(n * m), rng);
      const Tensor xc = upload(cpu(), {n, k}, x), xg = upload(gpu(), {n, k}, x);
      const Tensor tc = upload(cpu(), {n, m}, t), tg = upload(gpu(), {n, m}, t);
      for (const Backend::Clip& clip : clips)
        for (Act act : {Act::None, Act::Silu, Act::GeluTanhTimes}) {
          const Tensor* times_g = act == Act::GeluTanhTimes ? &tg : nullptr;
          const Tensor* times_c = act == Act::GeluTanhTimes ? &tc : nullptr;
          Tensor fused = poisoned(gpu(), {n, m}), ops = poisoned(gpu(), {n, m}), host = poisoned(cpu(), {n, m});
          gpu().matmul_clipped(xg, w.g, clip, fused, act, times_g);
          gpu().Backend::matmul_clipped(xg, w.g, clip, ops, act, times_g);
          cpu().matmul_clipped(xc, w.c, clip, host, act, times_c);
          const std::string what = mm_label("matmul_clipped", dt, n, k, m) + " clip " + std::to_string(clip.in_lo) +
                                   ".." + std::to_string(clip.in_hi) + " act " + std::to_string(int(act));
          const auto f = download(gpu(), fused), o = download(gpu(), ops), h = download(cpu(), host);
          size_t differ = 0;
          for (size_t i = 0; i < f.size(); ++i)
            differ += std::memcmp(&f[i], &o[i], 4) != 0 && !(std::isnan(f[i]) && std::isnan(o[i]));
          EXPECT_EQ(differ, 0u) << what << ": the fused passes differ from the separate ops";
          // Row 0 holds the NaN (unless the input clamp's finite bound replaced it): compare the others.
          const size_t skip = size_t(m);
          check(what, std::vector<float>(h.begin() + skip, h.end()), std::vector<float>(f.begin() + skip, f.end()),
                kTolMat, false);
        }
    }
  });
}

// ---------------------------------------------------------------- MoE

TEST_F(CudaOps, RouteTopk) {
  std::mt19937 rng(13);
  struct Case {
    int64_t n, E;
    int k;
  };
  for (Case c : {Case{1, 8, 2}, Case{37, 8, 2}, Case{5, 128, 8}, Case{300, 128, 8}})
    for (bool scaled : {false, true}) {
      const auto logits = randn(size_t(c.n * c.E), rng, 2.f);
      std::vector<float> pes(size_t(c.E));
      for (auto& v : pes) v = 0.5f + float(rng() % 1000) / 1000.f;
      const Tensor lc = upload(cpu(), {c.n, c.E}, logits), lg = upload(gpu(), {c.n, c.E}, logits);
      const Tensor sc = upload(cpu(), {c.E}, pes), sg = upload(gpu(), {c.E}, pes);
      Tensor wc = poisoned(cpu(), {c.n, c.k}), wg = poisoned(gpu(), {c.n, c.k});
      Tensor ec = cpu().scratch(DType::I32, {c.n, c.k}), eg = gpu().scratch(DType::I32, {c.n, c.k});
      cpu().route_topk(lc, c.k, scaled ? &sc : nullptr, wc, ec);
      gpu().route_topk(lg, c.k, scaled ? &sg : nullptr, wg, eg);
      const std::string what = "route_topk n=" + std::to_string(c.n) + " E=" + std::to_string(c.E) +
                               " k=" + std::to_string(c.k) + (scaled ? " per-expert scale" : "");
      EXPECT_EQ(download_i32(cpu(), ec), download_i32(gpu(), eg)) << what << ": experts differ";
      check(what, download(cpu(), wc), download(gpu(), wg), kTolF32);
    }
}

// Experts E, hidden size H, intermediate size I, k experts a token, and the weight types tried.
struct MoeCase {
  int64_t E, H, I;
  int k;
  std::vector<DType> dts;
};

TEST_F(CudaOps, MoeGatedExperts) {
  std::mt19937 rng(14);
  const std::vector<MoeCase> cases = {
      {8, 512, 256, 2, {DType::F32, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q6_K}},
      {8, 2816, 704, 2, {DType::BF16, DType::Q8_0, DType::Q4_0}},  // 26B-A4B's widths (704: no K-quant rows)
      {128, 512, 256, 8, {DType::Q8_0, DType::Q4_0}},              // 26B-A4B's routing: many experts empty
  };
  for (const MoeCase& c : cases)
    for (DType dt : c.dts) guarded("moe " + dname(dt), [&] {
      const Weight gu = random_weight(cpu(), gpu(), dt, {c.E, 2 * c.I, c.H}, rng);
      const Weight dn = random_weight(cpu(), gpu(), dt, {c.E, c.H, c.I}, rng);
      RowReport rep{"moe_gated_experts " + dname(dt) + " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) +
                    " H=" + std::to_string(c.H) + " I=" + std::to_string(c.I)};
      for (int64_t n : {1, 5, 64, 300}) {
        const auto x = randn(size_t(n * c.H), rng), logits = randn(size_t(n * c.E), rng, 2.f);
        const Tensor xc = upload(cpu(), {n, c.H}, x), xg = upload(gpu(), {n, c.H}, x);
        const Tensor lc = upload(cpu(), {n, c.E}, logits), lg = upload(gpu(), {n, c.E}, logits);
        Tensor wc = cpu().scratch(DType::F32, {n, c.k}), wg = gpu().scratch(DType::F32, {n, c.k});
        Tensor ec = cpu().scratch(DType::I32, {n, c.k}), eg = gpu().scratch(DType::I32, {n, c.k});
        cpu().route_topk(lc, c.k, nullptr, wc, ec);
        gpu().route_topk(lg, c.k, nullptr, wg, eg);
        ASSERT_EQ(download_i32(cpu(), ec), download_i32(gpu(), eg)) << "routing differs; see RouteTopk";
        Tensor oc = poisoned(cpu(), {n, c.H}), og = poisoned(gpu(), {n, c.H});
        cpu().moe_gated_experts(xc, gu.c, dn.c, wc, ec, oc);
        gpu().moe_gated_experts(xg, gu.g, dn.g, wg, eg, og);
        rep.add(n, check(rep.head + " n=" + std::to_string(n), download(cpu(), oc), download(gpu(), og), kTolMat,
                         false));
      }
      rep.print(kTolMat);
    });
}

// The same random experts, tokens and routing on two GPU backends (two settings of the MoE path), their outputs
// compared for each token count of `ns`: `ref`'s against `got`'s within tol.
void compare_moe_settings(Backend& ref, Backend& got, DType dt, int64_t E, int64_t H, int64_t I, int k,
                          std::initializer_list<int64_t> ns, std::mt19937& rng, double tol, const std::string& what) {
  const auto guf = randn(size_t(E * 2 * I * H), rng, 1.f / std::sqrt(float(H)));
  const auto dnf = randn(size_t(E * H * I), rng, 1.f / std::sqrt(float(I)));
  const Tensor gus = host_weight(dt, {E, 2 * I, H}, guf), dns = host_weight(dt, {E, H, I}, dnf);
  const Tensor gu_ref = ref.prepare_weight(gus, dt), dn_ref = ref.prepare_weight(dns, dt);
  const Tensor gu_got = got.prepare_weight(gus, dt), dn_got = got.prepare_weight(dns, dt);
  RowReport rep{what + " " + dname(dt) + " E=" + std::to_string(E) + " k=" + std::to_string(k) +
                " H=" + std::to_string(H) + " I=" + std::to_string(I)};
  for (int64_t n : ns) {
    const auto x = randn(size_t(n * H), rng), logits = randn(size_t(n * E), rng, 2.f);
    auto run = [&](Backend& be, const Tensor& gu, const Tensor& dn) {
      const Tensor xb = upload(be, {n, H}, x), lb = upload(be, {n, E}, logits);
      Tensor wb = be.scratch(DType::F32, {n, k}), eb = be.scratch(DType::I32, {n, k});
      be.route_topk(lb, k, nullptr, wb, eb);
      Tensor o = poisoned(be, {n, H});
      be.moe_gated_experts(xb, gu, dn, wb, eb, o);
      return download(be, o);
    };
    rep.add(n, check(rep.head + " n=" + std::to_string(n), run(ref, gu_ref, dn_ref), run(got, gu_got, dn_got), tol,
                     false));
  }
  rep.print(tol);
}

// Block-type products of more rows than the GEMV takes run on the tensor cores (kernels_mmq.cu;
// by default for weights without a bf16 copy and up to 16 rows beside one, MARKBASE_CUDA_MMQ_ROWS=N
// for all; Q4_0 past 16 rows takes bf16 activations, off here: MARKBASE_CUDA_MMQ_BF16_ROWS=0 and
// MARKBASE_CUDA_MMQ_WGMMA_ROWS=0): same int8
// activations, same exact block sums, so each row must give the numbers the GEMV gives that row
// alone, up to the order of float additions - far tighter than the CPU comparison.
// Both weight layouts (no bf16 copies, where the kernels are the path): the planes as stored, and
// the fragment-ordered copies (MARKBASE_CUDA_FRAG_COPIES; 17 blocks of 32 pair the last with zeros).
// k=256 is one K split: the GLU and gelu-times epilogues in the product kernel, not the reduce's.
TEST_F(CudaOps, BlockProductsOfManyRowsMatchTheGemvRowByRow) {
  constexpr double kTolSame = 1e-4;
  std::mt19937 rng(21);
  struct Shape {
    int64_t k, m;
  };
  for (const char* frag : {"1", "0"})
  for (DType dt : {DType::Q8_0, DType::Q4_0})
    for (Shape sh : {Shape{2560, 2048}, Shape{512, 192}, Shape{544, 128}, Shape{256, 192}}) guarded("mmq " + dname(dt), [&] {
      mbtest::ScopedEnv frag_copies("MARKBASE_CUDA_FRAG_COPIES", frag), bf16_copies("MARKBASE_CUDA_BF16_COPIES", "0"),
          int8_only("MARKBASE_CUDA_MMQ_BF16_ROWS", "0"), no_wgmma("MARKBASE_CUDA_MMQ_WGMMA_ROWS", "0");
      const std::unique_ptr<Backend> mmq = gpu_with("MARKBASE_CUDA_MMQ_ROWS", "1024");
      Backend& be = *mmq;
      const Weight w = random_weight(cpu(), be, dt, {sh.m, sh.k}, rng), u = random_weight(cpu(), be, dt, {sh.m, sh.k}, rng);
      RowReport rep{"mmq against row-by-row GEMV " + dname(dt) + " k=" + std::to_string(sh.k) + " m=" +
                    std::to_string(sh.m) + (frag[0] == '1' ? " fragment-ordered" : " planes")};
      for (int64_t n : {5, 8, 9, 37, 64, 65, 200}) {
        const auto x = randn(size_t(n * sh.k), rng), m = randn(size_t(n * sh.m), rng);
        const Tensor xg = upload(be, {n, sh.k}, x), mg = upload(be, {n, sh.m}, m);
        Tensor y = poisoned(be, {n, sh.m}), y2 = poisoned(be, {n, sh.m}), glu = poisoned(be, {n, sh.m}),
               gt = poisoned(be, {n, sh.m});
        be.matmuls(xg, {&w.g, &u.g}, {&y, &y2});
        be.matmul_gelu_mul(xg, w.g, u.g, glu);
        be.matmul_gelu_times(xg, w.g, mg, gt);
        std::vector<float> r1, r2, rg, rt;
        for (int64_t i = 0; i < n; ++i) {
          const std::vector<float> xi(x.begin() + i * sh.k, x.begin() + (i + 1) * sh.k);
          const std::vector<float> mi(m.begin() + i * sh.m, m.begin() + (i + 1) * sh.m);
          const Tensor x1 = upload(be, {1, sh.k}, xi), m1 = upload(be, {1, sh.m}, mi);
          Tensor a = poisoned(be, {1, sh.m}), b = poisoned(be, {1, sh.m}), g = poisoned(be, {1, sh.m}),
                 t = poisoned(be, {1, sh.m});
          be.matmul(x1, w.g, a);
          be.matmul(x1, u.g, b);
          be.matmul_gelu_mul(x1, w.g, u.g, g);
          be.matmul_gelu_times(x1, w.g, m1, t);
          for (auto [dst, src] : {std::pair{&r1, &a}, {&r2, &b}, {&rg, &g}, {&rt, &t}}) {
            const auto v = download(be, *src);
            dst->insert(dst->end(), v.begin(), v.end());
          }
        }
        const std::string at = " " + dname(dt) + " n=" + std::to_string(n) + " m=" + std::to_string(sh.m);
        double worst = check("mmq matmuls #0" + at, r1, download(be, y), kTolSame, false);
        worst = std::max(worst, check("mmq matmuls #1" + at, r2, download(be, y2), kTolSame, false));
        worst = std::max(worst, check("mmq gelu_mul" + at, rg, download(be, glu), kTolSame, false));
        worst = std::max(worst, check("mmq gelu_times" + at, rt, download(be, gt), kTolSame, false));
        rep.add(n, worst);
      }
      rep.print(kTolSame);
    });
}

// The products of Q4_0 weights on bf16 activation rows (k_mmq_bf16, k_mmq_wgmma) against the sum in
// double of x rounded to bf16 times the weights' values - exact (k_mmq_bf16), or rounded to bf16 as the
// weights' bf16 copies are (round_weights: k_mmq_wgmma) - so to ~1e-6 of the range, where the int8
// kernel's quantized activations would be ~1e-3 off and a wrong K order or scale far more. The backend
// is made under `env` (which sends every row count there, without bf16 copies); one and several K
// splits (k = 256 is one: the GLU and gelu-times epilogues in the product kernel), 17 blocks of 32 (the
// last pairs with zeros), chunks cut short, groups of 8 rows cut short, and matmuls over two weights of
// different rows.
void check_bf16_row_products(const std::vector<std::pair<const char*, const char*>>& env, bool round_weights,
                             const std::string& what) {
  constexpr double kTol = 2e-5;
  std::mt19937 rng(24);
  struct Shape {
    int64_t k, m;
  };
  auto gelu = [](double v) { return 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))); };
  std::vector<std::unique_ptr<mbtest::ScopedEnv>> scoped;
  for (const auto& [name, value] : env) scoped.push_back(std::make_unique<mbtest::ScopedEnv>(name, value));
  mbtest::ScopedEnv frag("MARKBASE_CUDA_FRAG_COPIES", "1"), copies("MARKBASE_CUDA_BF16_COPIES", "0");
  const std::unique_ptr<Backend> gpu_bf16 = make_gpu();
  Backend& be = *gpu_bf16;
  for (Shape sh : {Shape{1536, 512}, Shape{512, 192}, Shape{544, 128}, Shape{256, 192}}) guarded(what, [&] {
    const int64_t k = sh.k, m = sh.m, m2 = 64;
    // Weights and the values the kernel multiplies: the Q4_0 rows dequantized on the host.
    auto make = [&](int64_t rows, std::vector<double>& values) {
      const auto f = randn(size_t(rows * k), rng, 1.f / std::sqrt(float(k)));
      const Tensor src = host_weight(DType::Q4_0, {rows, k}, f);
      const size_t rb = mb::dtype_row_bytes(DType::Q4_0, k);
      std::vector<float> row(static_cast<size_t>(k));
      for (int64_t r = 0; r < rows; ++r) {
        mb::dequantize_row(DType::Q4_0, src.ptr<uint8_t>() + size_t(r) * rb, row.data(), k);
        for (float v : row) values.push_back(round_weights ? mb::round_to_bf16(v) : v);
      }
      return be.prepare_weight(src, DType::Q4_0);
    };
    std::vector<double> wg, wu, wv;
    const Tensor gate = make(m, wg), up = make(m, wu), v = make(m2, wv);
    RowReport rep{what + " on bf16 x, k=" + std::to_string(k) + " m=" + std::to_string(m)};
    for (int64_t n : {5, 17, 37, 64, 65, 128, 200}) {
      const auto x = randn(size_t(n * k), rng), mt = randn(size_t(n * m), rng);
      const Tensor xg = upload(be, {n, k}, x), mg = upload(be, {n, m}, mt);
      Tensor y = poisoned(be, {n, m}), yv = poisoned(be, {n, m2});
      Tensor glu = poisoned(be, {n, m}), gt = poisoned(be, {n, m});
      be.matmuls(xg, {&gate, &v}, {&y, &yv});
      be.matmul_gelu_mul(xg, gate, up, glu);
      be.matmul_gelu_times(xg, gate, mg, gt);
      std::vector<double> xb(x.size());
      for (size_t j = 0; j < x.size(); ++j) xb[j] = mb::round_to_bf16(x[j]);
      std::vector<float> ry, rv, rg, rt;
      for (int64_t i = 0; i < n; ++i) {
        auto dot = [&](const std::vector<double>& w, int64_t r) {
          double acc = 0;
          for (int64_t j = 0; j < k; ++j) acc += w[size_t(r * k + j)] * xb[size_t(i * k + j)];
          return acc;
        };
        for (int64_t r = 0; r < m; ++r) {
          const double g = dot(wg, r);
          ry.push_back(float(g));
          rg.push_back(float(gelu(g) * dot(wu, r)));
          rt.push_back(float(gelu(g) * mt[size_t(i * m + r)]));
        }
        for (int64_t r = 0; r < m2; ++r) rv.push_back(float(dot(wv, r)));
      }
      const std::string at = " n=" + std::to_string(n) + " k=" + std::to_string(k) + " m=" + std::to_string(m);
      double worst = check(what + " matmuls #0" + at, ry, download(be, y), kTol, false);
      worst = std::max(worst, check(what + " matmuls #1" + at, rv, download(be, yv), kTol, false));
      worst = std::max(worst, check(what + " gelu_mul" + at, rg, download(be, glu), kTol, false));
      worst = std::max(worst, check(what + " gelu_times" + at, rt, download(be, gt), kTol, false));
      rep.add(n, worst);
    }
    rep.print(kTol);
  });
}

// k_mmq_bf16 from 5 rows on (MARKBASE_CUDA_MMQ_BF16_FROM=4), at every row count.
TEST_F(CudaOps, Bf16ActivationBlockProductsAreExactWeightsOnBf16Rows) {
  check_bf16_row_products({{"MARKBASE_CUDA_MMQ_BF16_FROM", "4"}, {"MARKBASE_CUDA_MMQ_BF16_ROWS", "1024"},
                           {"MARKBASE_CUDA_MMQ_WGMMA_ROWS", "0"}},
                          false, "mmq bf16");
}

// k_mmq_wgmma from 5 rows on: its tiles of 64 rows (up to 64) and 128, 64 of them zeros at 5 rows and 56 at 200.
TEST_F(CudaOps, WarpgroupBlockProductsAreBf16WeightsOnBf16Rows) {
  if (mb::cuda_compute_capability() != 90) GTEST_SKIP() << "not an sm_90 GPU: no wgmma kernel";
  check_bf16_row_products({{"MARKBASE_CUDA_MMQ_BF16_FROM", "4"}, {"MARKBASE_CUDA_MMQ_BF16_ROWS", "4"},
                           {"MARKBASE_CUDA_MMQ_WGMMA_ROWS", "1024"}},
                          true, "mmq wgmma");
}

// Many token-expert pairs go through per-expert tiles sorted on the device; each pair must get
// what the pair-by-pair GEMV gives it (MARKBASE_CUDA_MMQ_PAIRS=0 turns the tiles off). Not to
// 1e-4 as above: the gate/up products differ in the order of their float additions (~1e-7),
// and the down product's input is quantized again, where such a difference now and then moves
// an element to the next int8 step (measured up to 1.5e-3 of the output range). A pair sent to
// the wrong expert or row would be off by the output's whole size.
TEST_F(CudaOps, GroupedExpertsMatchThePairByPairGemv) {
  constexpr double kTolSame = 5e-3;
  const std::unique_ptr<Backend> pairwise = gpu_with("MARKBASE_CUDA_MMQ_PAIRS", "0");
  std::mt19937 rng(22);
  struct Case {
    int64_t E, H, I;
    int k;
  };
  for (const char* frag : {"1", "0"})
  for (DType dt : {DType::Q8_0, DType::Q4_0})
    for (Case c : {Case{128, 512, 256, 8}, Case{4, 2816, 704, 2}}) guarded("grouped experts " + dname(dt), [&] {
      mbtest::ScopedEnv frag_copies("MARKBASE_CUDA_FRAG_COPIES", frag);
      const std::unique_ptr<Backend> grouped = make_gpu();
      compare_moe_settings(*pairwise, *grouped, dt, c.E, c.H, c.I, c.k, {5, 64, 300}, rng, kTolSame,
                           std::string("grouped experts against pair GEMV") +
                               (frag[0] == '1' ? " (fragment-ordered)" : " (planes)"));
    });
}

// The pair-by-pair experts' GEMV writing gelu_tanh(gate) * up itself (MARKBASE_CUDA_MOE_GEMV_GLU=1) against the
// GEMV's [pairs, 2I] products activated by the separate kernel: each lane adds the same units in the same order
// and the activation is the same expression, so the outputs agree to float rounding (1e-6 leaves room for a
// contraction into FMA that one build makes and the other does not). A gate row paired with the wrong up row,
// or a pair written to the wrong place, is off by the output's whole size.
TEST_F(CudaOps, MoeGemvGluMatchesTheSplitActivation) {
  constexpr double kTolSame = 1e-6;
  mbtest::ScopedEnv pairwise("MARKBASE_CUDA_MMQ_PAIRS", "0");
  const std::unique_ptr<Backend> fused = gpu_with("MARKBASE_CUDA_MOE_GEMV_GLU", "1");
  const std::unique_ptr<Backend> split = gpu_with("MARKBASE_CUDA_MOE_GEMV_GLU", "0");
  std::mt19937 rng(23);
  const std::vector<MoeCase> cases = {
      {8, 512, 256, 2, {DType::F32, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_K}},
      {16, 2816, 704, 8, {DType::BF16, DType::Q8_0, DType::Q4_0}},  // 26B-A4B's widths
  };
  for (const MoeCase& c : cases)
    for (DType dt : c.dts) guarded("moe gemv glu " + dname(dt), [&] {
      compare_moe_settings(*split, *fused, dt, c.E, c.H, c.I, c.k, {1, 3, 7}, rng, kTolSame,
                           "moe gemv glu against split activation");
    });
}

// ---------------------------------------------------------------- KV and attention

enum class Layout { Flat, Ring, Paged };
const char* layout_name(Layout l) { return l == Layout::Flat ? "flat" : l == Layout::Ring ? "ring" : "paged"; }

struct AttnConfig {
  int64_t nh, nkv, hd;
  int window;
  float softcap;
  float scale;  // 0: 1/sqrt(hd)
  Layout layout;
  bool bf16_inputs = true;  // q/k/v values bf16 already, so a bf16 KV store holds them exactly
  // Q/K/V through attention_inputs (head norms, rotary, V norm, KV write in one op) instead of
  // kv_write/kv_write_batch.
  bool fused_inputs = false;
  // The sequences listed last row first (the kernels find a row's sequence by bisection only where
  // rows ascend with the list: order_rows).
  bool reversed = false;
  std::string label() const {
    char b[200];
    std::snprintf(b, sizeof b, "hd=%lld heads=%lld/%lld window=%d softcap=%g scale=%s %s%s%s%s",
                  static_cast<long long>(hd), static_cast<long long>(nh), static_cast<long long>(nkv), window,
                  softcap, scale == 0 ? "1/sqrt(hd)" : "1", layout_name(layout), bf16_inputs ? "" : " f32-inputs",
                  fused_inputs ? " attention_inputs" : "", reversed ? " reversed" : "");
    return b;
  }
};

// One sequence's rows in a step: positions [start, start + count). An image's tokens at positions
// [span_first, span_end) see every key up to its last (AttentionSeq::last); the others up to their own.
struct Part {
  int seq;
  int64_t start, count;
  int64_t span_first = 0, span_end = 0;
};
using Step = std::vector<Part>;

// The steps that write each sequence's history [0, history) in chunks of at most `chunk` tokens
// (sequences side by side, as the scheduler mixes them), then one step with `last[s]` new rows of
// every sequence.
std::vector<Step> plan_steps(const std::vector<int64_t>& history, const std::vector<int64_t>& last, int64_t chunk) {
  std::vector<Step> steps;
  std::vector<int64_t> done(history.size(), 0);
  for (;;) {
    Step st;
    for (size_t s = 0; s < history.size(); ++s)
      if (done[s] < history[s]) {
        const int64_t c = std::min(chunk, history[s] - done[s]);
        st.push_back({int(s), done[s], c});
        done[s] += c;
      }
    if (st.empty()) break;
    steps.push_back(st);
  }
  Step final_step;
  for (size_t s = 0; s < last.size(); ++s)
    if (last[s] > 0) final_step.push_back({int(s), history[s], last[s]});
  steps.push_back(final_step);
  return steps;
}

struct StepData {
  std::vector<float> q, k, v;  // [rows, heads, hd]
};

constexpr int64_t kPage = 16;

// Runs the steps on one backend: each step writes its rows' K/V (kv_write for a single
// sequence, kv_write_batch otherwise) and attends its rows' queries over their sequence's store.
// Stores hold stale data first (positions the sequences never name), written through a flat view
// of the same memory: `poison` NaN, else finite values. Page tables are shuffled pages of one
// pool, entries below every query's window set to -1 before a step. `staged`: the step's host
// arrays go through Backend::stage first.
std::vector<std::vector<float>> run_attention(Backend& be, const AttnConfig& c, const std::vector<Step>& steps,
                                              const std::vector<StepData>& data, bool staged, bool poison) {
  const size_t n_seqs = [&] {
    int m = 0;
    for (const Step& st : steps)
      for (const Part& p : st) m = std::max(m, p.seq + 1);
    return size_t(m);
  }();
  std::vector<int64_t> total(n_seqs, 0);
  int64_t max_step = 1;
  for (const Step& st : steps)
    for (const Part& p : st) {
      total[size_t(p.seq)] = std::max(total[size_t(p.seq)], p.start + p.count);
      max_step = std::max(max_step, p.count);
    }
  const int64_t row = c.nkv * c.hd;
  const DType kvdt = be.kv_dtype();

  // Fills rows [0, rows) of a store's memory with stale values through a flat view.
  std::mt19937 stale_rng(99);
  auto fill_stale = [&](const Tensor& k, const Tensor& v, int64_t rows) {
    mb::KVStore flat;
    flat.k = k;
    flat.v = v;
    flat.capacity = rows;
    for (int64_t b = 0; b < rows; b += 512) {
      const int64_t cnt = std::min<int64_t>(512, rows - b);
      std::vector<float> kk =
          poison ? std::vector<float>(size_t(cnt * row), kNaN) : randn(size_t(cnt * row), stale_rng, 3.f);
      std::vector<float> vv = poison ? kk : randn(size_t(cnt * row), stale_rng, 3.f);
      std::vector<int32_t> pos(static_cast<size_t>(cnt));
      std::iota(pos.begin(), pos.end(), int32_t(b));
      const Tensor kt = upload(be, {cnt, c.nkv, c.hd}, kk), vt = upload(be, {cnt, c.nkv, c.hd}, vv);
      be.kv_write(flat, kt, vt, pos.data());
    }
  };

  std::vector<mb::KVStore> stores(n_seqs);
  std::vector<std::vector<int32_t>> tables(n_seqs);
  Tensor pool_k, pool_v;
  if (c.layout == Layout::Paged) {
    int64_t pages = 0;
    for (int64_t t : total) pages += (t + kPage - 1) / kPage;
    const int64_t pool_pages = pages + 5;  // spare pages of stale data no table names
    std::vector<int32_t> perm(static_cast<size_t>(pool_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937 prng(1234);
    std::shuffle(perm.begin(), perm.end(), prng);
    pool_k = be.alloc(kvdt, {pool_pages * kPage, c.nkv, c.hd});
    pool_v = be.alloc(kvdt, {pool_pages * kPage, c.nkv, c.hd});
    fill_stale(pool_k, pool_v, pool_pages * kPage);
    size_t next = 0;
    for (size_t s = 0; s < n_seqs; ++s) {
      const int64_t np = (total[s] + kPage - 1) / kPage;
      for (int64_t i = 0; i < np; ++i) tables[s].push_back(perm[next++]);
      mb::KVStore& st = stores[s];
      st.k = pool_k;
      st.v = pool_v;
      st.capacity = pool_pages * kPage;
      st.pages = tables[s].data();
      st.page_size = kPage;
      st.n_pages = np;
    }
  } else {
    for (size_t s = 0; s < n_seqs; ++s) {
      const bool ring = c.layout == Layout::Ring;
      const int64_t cap = ring ? c.window - 1 + max_step : total[s];
      mb::KVStore& st = stores[s];
      st.k = be.alloc(kvdt, {cap, c.nkv, c.hd});
      st.v = be.alloc(kvdt, {cap, c.nkv, c.hd});
      st.capacity = cap;
      st.ring = ring;
      fill_stale(st.k, st.v, cap);
    }
  }

  // attention_inputs' norm weights and rotary (a partial rotation, as Gemma 4's full layers).
  std::vector<float> qn(size_t(c.hd)), kn(size_t(c.hd));
  for (int64_t i = 0; i < c.hd; ++i) {
    qn[size_t(i)] = 0.5f + 0.01f * float(i % 17);
    kn[size_t(i)] = 1.5f - 0.02f * float(i % 13);
  }
  const Tensor q_norm = upload(be, {c.hd}, qn), k_norm = upload(be, {c.hd}, kn);
  const std::vector<float> inv_freq = inv_freq_of(c.hd, c.hd / 4, 1e4f);
  Backend::AttentionInputs in;
  in.q_norm = &q_norm;
  in.k_norm = &k_norm;
  in.v_norm = true;
  in.inv_freq = inv_freq.data();

  mb::AttentionParams ap;
  ap.scale = c.scale == 0 ? 1.f / std::sqrt(float(c.hd)) : c.scale;
  ap.window = c.window;
  ap.softcap = c.softcap;
  std::vector<std::vector<float>> outs;
  for (size_t si = 0; si < steps.size(); ++si) {
    const Step& st = steps[si];
    int64_t rows = 0;
    for (const Part& p : st) rows += p.count;
    std::vector<int32_t> positions, lasts;
    std::vector<Backend::AttentionSeq> seqs;
    bool spans = false;
    for (const Part& p : st) {
      spans |= p.span_end > p.span_first;
      seqs.push_back({&stores[size_t(p.seq)], int64_t(positions.size()), p.count, nullptr});
      for (int64_t i = 0; i < p.count; ++i) {
        const int64_t at = p.start + i;
        positions.push_back(int32_t(at));
        lasts.push_back(int32_t(at >= p.span_first && at < p.span_end ? p.span_end - 1 : at));
      }
    }
    for (auto& s : seqs) {
      s.pos = positions.data() + s.begin;
      if (spans) s.last = lasts.data() + s.begin;
    }
    if (c.reversed) std::reverse(seqs.begin(), seqs.end());
    // Pages every query of the sequence has left behind (sliding window) are gone.
    if (c.layout == Layout::Paged && c.window > 0)
      for (const Part& p : st) {
        const int64_t lowest_key = p.start - c.window + 1;
        auto& tab = tables[size_t(p.seq)];
        for (int64_t pg = 0; pg < int64_t(tab.size()); ++pg)
          if ((pg + 1) * kPage - 1 < lowest_key) tab[size_t(pg)] = -1;
      }
    std::optional<Unstage> unstage;
    if (staged) {
      std::vector<mb::HostArray> arrays = {{positions.data(), positions.size() * 4, positions.size() * 4 + 64}};
      if (spans) arrays.push_back({lasts.data(), lasts.size() * 4, lasts.size() * 4});
      for (const Part& p : st) {
        const auto& tab = tables[size_t(p.seq)];
        if (!tab.empty()) arrays.push_back({tab.data(), tab.size() * 4, tab.size() * 4});
      }
      be.stage(arrays);
      unstage.emplace(&be);
    }
    const StepData& d = data[si];
    Tensor q = upload(be, {rows, c.nh, c.hd}, d.q);
    Tensor k = upload(be, {rows, c.nkv, c.hd}, d.k), v = upload(be, {rows, c.nkv, c.hd}, d.v);
    Tensor out = poisoned(be, {rows, c.nh, c.hd});
    if (c.fused_inputs) {
      in.pos = positions.data();
      be.attention_inputs(q, &k, &v, in, seqs);
      be.attention_batch(q, seqs, ap, out);
    } else if (st.size() == 1 && !spans) {
      be.kv_write(stores[size_t(st[0].seq)], k, v, positions.data());
      be.attention(q, stores[size_t(st[0].seq)], positions.data(), ap, out);
    } else {
      be.kv_write_batch(k, v, seqs);
      be.attention_batch(q, seqs, ap, out);
    }
    outs.push_back(download(be, out));
  }
  return outs;
}

std::vector<StepData> step_data(const AttnConfig& c, const std::vector<Step>& steps, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<StepData> data;
  for (const Step& st : steps) {
    int64_t rows = 0;
    for (const Part& p : st) rows += p.count;
    StepData d{randn(size_t(rows * c.nh * c.hd), rng), randn(size_t(rows * c.nkv * c.hd), rng),
               randn(size_t(rows * c.nkv * c.hd), rng)};
    if (c.bf16_inputs) d.q = bf16_rounded(d.q), d.k = bf16_rounded(d.k), d.v = bf16_rounded(d.v);
    data.push_back(std::move(d));
  }
  return data;
}

// Every step's output on the GPU (unstaged and staged) against the CPU's.
void compare_attention(Backend& cpu, Backend& gpu, const AttnConfig& c, const std::vector<Step>& steps,
                       const std::string& scenario, double tol) {
  const auto data = step_data(c, steps, 7);
  const auto ref = run_attention(cpu, c, steps, data, false, false);
  for (bool staged : {false, true}) {
    const auto got = run_attention(gpu, c, steps, data, staged, false);
    ASSERT_EQ(got.size(), ref.size());
    double worst = 0;
    size_t worst_step = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      std::string step = " step " + std::to_string(i) + " (";
      for (const Part& p : steps[i]) {
        char b[64];
        std::snprintf(b, sizeof b, "s%d@%lld+%lld ", p.seq, static_cast<long long>(p.start),
                      static_cast<long long>(p.count));
        step += b;
      }
      step.back() = ')';
      const double rel = check("attention " + scenario + " " + c.label() + (staged ? " staged" : "") + step, ref[i],
                               got[i], tol, false);
      if (rel > worst) worst = rel, worst_step = i;
    }
    std::printf("[ cuda-op  ] attention %-12s %s%s: %zu steps, worst rel %.2e at step %zu (tol %.0e)\n",
                scenario.c_str(), c.label().c_str(), staged ? " staged" : "", ref.size(), worst, worst_step, tol);
  }
}

std::vector<AttnConfig> attention_configs() {
  const float one = 1.f, inv = 0.f;
  return {
      {8, 8, 256, 0, 0.f, inv, Layout::Flat},       // GQA 1
      {8, 4, 256, 0, 0.f, inv, Layout::Paged},      // GQA 2
      {8, 2, 256, 48, 50.f, one, Layout::Paged},    // GQA 4, sliding, softcap, scale 1 (peaked)
      {8, 1, 256, 48, 0.f, inv, Layout::Ring},      // GQA 8, a sliding layer's ring
      {16, 2, 512, 0, 0.f, one, Layout::Paged},     // Gemma 4 full layers: head dim 512, GQA 8
      {4, 4, 512, 0, 50.f, inv, Layout::Flat},      // head dim 512, GQA 1, softcap
      {16, 8, 256, 1024, 0.f, inv, Layout::Paged},  // a window longer than every sequence
      {8, 2, 512, 64, 0.f, inv, Layout::Ring},      // head dim 512 in a ring
      {4, 2, 64, 8, 0.f, inv, Layout::Ring},        // the fixtures' small head dims
      {2, 1, 32, 0, 0.f, inv, Layout::Paged},
      {4, 2, 16, 8, 0.f, inv, Layout::Ring},        // gemma3_like's head dim
      {8, 2, 256, 48, 0.f, inv, Layout::Paged, false},  // f32 inputs: the KV store rounds them
  };
}

// One sequence, prefilled in chunks then decoded token by token, each step attended at once.
TEST_F(CudaOps, AttentionOneSequencePrefillThenDecode) {
  for (const AttnConfig& c : attention_configs()) {
    std::vector<Step> steps = {{{0, 0, 100}}, {{0, 100, 137}}};
    for (int64_t p = 237; p < 241; ++p) steps.push_back({{0, p, 1}});
    guarded("attention one-seq " + c.label(),
            [&] { compare_attention(cpu(), gpu(), c, steps, "one-seq", c.bf16_inputs ? kTolMat : 2 * kTolMat); });
  }
}

// Prefill chunks of 64 rows and more on the dense path (MARKBASE_CUDA_DENSE_PREFILL=1: batched GEMMs
// a KV head over the chunk's keys, the causal mask and window in the softmax): one sequence and two
// in one call, every layout, window, soft-cap and head size of the configs; then decode rows (the
// kernel) over what the chunks wrote. Against the CPU at the ops' bound, and against the attention
// kernel (f32 arithmetic on the same bf16 store) at kDenseVsKernelTol: the dense path takes Q and P
// as two bf16 terms each, ~16 bits (one term, ~8 bits, is ~5e-3 off here and flipped a routed
// expert in the moe_like fixture's logits).
constexpr double kDenseVsKernelTol = 1e-3;
TEST_F(CudaOps, AttentionPrefillChunksOnTheDensePath) {
  const std::unique_ptr<Backend> dense = gpu_with("MARKBASE_CUDA_DENSE_PREFILL", "1"),
                                 kernel = gpu_with("MARKBASE_CUDA_DENSE_PREFILL", "0");
  for (const AttnConfig& c : attention_configs()) {
    const std::vector<Step> one = {{{0, 0, 100}}, {{0, 100, 137}}, {{0, 237, 1}}, {{0, 238, 1}}};
    const std::vector<Step> two = {{{0, 0, 100}, {1, 0, 64}}, {{0, 100, 70}, {1, 64, 130}}, {{0, 170, 1}, {1, 194, 1}}};
    const double tol = c.bf16_inputs ? kTolMat : 2 * kTolMat;
    guarded("attention dense prefill " + c.label(), [&] {
      compare_attention(cpu(), *dense, c, one, "dense-one", tol);
      compare_attention(cpu(), *dense, c, two, "dense-two", tol);
      // Over NaN-poisoned stores: the chunks read no row outside their keys.
      const auto data = step_data(c, two, 8);
      const auto ref = run_attention(cpu(), c, two, data, false, true), got = run_attention(*dense, c, two, data, true, true);
      for (size_t i = 0; i < ref.size(); ++i)
        check("dense prefill over NaN-poisoned stores " + c.label() + " step " + std::to_string(i), ref[i], got[i], tol);
      for (const auto* steps : {&one, &two}) {
        const auto d = step_data(c, *steps, 9);
        const auto kern = run_attention(*kernel, c, *steps, d, false, false);
        const auto dn = run_attention(*dense, c, *steps, d, false, false);
        double worst = 0;
        for (size_t i = 0; i < kern.size(); ++i)
          worst = std::max(worst, check("dense prefill vs the kernel " + c.label() + " step " + std::to_string(i),
                                        kern[i], dn[i], kDenseVsKernelTol, false));
        std::printf("[ cuda-op  ] attention dense vs kernel %s, %s: worst rel %.2e (tol %.0e)\n",
                    steps == &one ? "one seq" : "two seqs", c.label().c_str(), worst, kDenseVsKernelTol);
      }
    });
  }
}

// Prefill chunks with image spans (an image's tokens see up to its last key, AttentionSeq::last, as
// the model runner asks; text rows up to their own) on the dense path and on the kernel, against the
// CPU: spans inside a chunk, at its end and over a window's edge, and a call of a decode row beside a
// span's chunk (the dense path takes the chunk, the kernel the row). Not in rings: a ring holds no key
// past a query's position (the CPU refuses it).
TEST_F(CudaOps, AttentionPrefillWithImageSpans) {
  const std::unique_ptr<Backend> dense = gpu_with("MARKBASE_CUDA_DENSE_PREFILL", "1"),
                                 kernel = gpu_with("MARKBASE_CUDA_DENSE_PREFILL", "0");
  const std::vector<Step> one = {{{0, 0, 100, 20, 60}}, {{0, 100, 137, 150, 230}}, {{0, 237, 70, 250, 307}},
                                 {{0, 307, 1}}};
  const std::vector<Step> two = {{{0, 0, 100, 10, 90}, {1, 0, 64}},
                                 {{0, 100, 70}, {1, 64, 130, 64, 194}},
                                 {{0, 170, 1}, {1, 194, 80, 200, 260}},
                                 {{0, 171, 1}, {1, 274, 1}}};
  for (const AttnConfig& c : attention_configs()) {
    if (c.layout == Layout::Ring) continue;
    const double tol = c.bf16_inputs ? kTolMat : 2 * kTolMat;
    guarded("attention image spans " + c.label(), [&] {
      for (Backend* be : {dense.get(), kernel.get()}) {
        const std::string side = be == dense.get() ? "spans-dense" : "spans-kernel";
        compare_attention(cpu(), *be, c, one, side + "-one", tol);
        compare_attention(cpu(), *be, c, two, side + "-two", tol);
      }
      const auto data = step_data(c, two, 8);
      const auto ref = run_attention(cpu(), c, two, data, false, true), got = run_attention(*dense, c, two, data, true, true);
      for (size_t i = 0; i < ref.size(); ++i)
        check("image spans over NaN-poisoned stores " + c.label() + " step " + std::to_string(i), ref[i], got[i], tol);
    });
  }
}

// With MARKBASE_CUDA_DEBUG=8 every row's keys are split (prefill rows too), so the merge kernel
// takes many rows, heads of 16 to 512 elements and windows.
TEST_F(CudaOps, AttentionSplitsOfEveryRowMerged) {
  const std::vector<Step> steps = {{{0, 0, 100}}, {{0, 100, 137}}, {{0, 237, 1}}, {{0, 238, 1}}};
  const std::unique_ptr<Backend> g = gpu_with("MARKBASE_CUDA_DEBUG", "8");
  for (const AttnConfig& c : {AttnConfig{8, 2, 256, 0, 0.f, 0.f, Layout::Paged},
                              AttnConfig{16, 2, 512, 64, 50.f, 1.f, Layout::Ring},
                              AttnConfig{4, 2, 16, 8, 0.f, 0.f, Layout::Ring}})
    guarded("attention splits everywhere " + c.label(),
            [&] { compare_attention(cpu(), *g, c, steps, "split-all", kTolMat); });
}

// A decode row's attention output goes to a block-quantized product as the attention (or merge)
// kernel quantized it (one kernel less a layer); the product matches the CPU's. So do 8 rows (with
// MARKBASE_CUDA_TILED_QUANT=1: the block products' tiled layout, written by the same kernels), and
// 40 rows into a BF16 product (the bf16 copy the same kernels write for cuBLAS).
TEST_F(CudaOps, AttentionThenBlockMatmulUsesTheAttentionsQuantization) {
  std::mt19937 rng(23);
  const AttnConfig c{8, 2, 256, 0, 0.f, 0.f, Layout::Flat};
  const int64_t m = 320;
  const std::unique_ptr<Backend> tiled = gpu_with_tiled_and_bf16_outputs();
  const Weight wq = random_weight(cpu(), *tiled, DType::Q4_0, {m, c.nh * c.hd}, rng);
  const Weight wb = random_weight(cpu(), *tiled, DType::BF16, {m, c.nh * c.hd}, rng);
  const auto data = step_data(c, {{{0, 0, 60}}, {{0, 60, 1}}}, 9);
  for (int64_t rows : {1, 8, 40}) {
    const Weight& w = rows > 16 ? wb : wq;
    const auto q_rows = rows == 1 ? data[1].q : randn(size_t(rows * c.nh * c.hd), rng);
    auto side = [&](Backend& be, const Tensor& wt) {
      mb::KVStore kv;
      kv.k = be.alloc(be.kv_dtype(), {61, c.nkv, c.hd});
      kv.v = be.alloc(be.kv_dtype(), {61, c.nkv, c.hd});
      kv.capacity = 61;
      std::vector<int32_t> pos(61);
      for (int i = 0; i < 61; ++i) pos[size_t(i)] = i;
      std::vector<float> k_all(data[0].k), v_all(data[0].v);
      k_all.insert(k_all.end(), data[1].k.begin(), data[1].k.end());
      v_all.insert(v_all.end(), data[1].v.begin(), data[1].v.end());
      Tensor k = upload(be, {61, c.nkv, c.hd}, k_all), v = upload(be, {61, c.nkv, c.hd}, v_all);
      be.kv_write(kv, k, v, pos.data());
      Tensor q = upload(be, {rows, c.nh, c.hd}, q_rows), out = poisoned(be, {rows, c.nh, c.hd});
      mb::AttentionParams ap;
      ap.scale = 1.f / std::sqrt(float(c.hd));
      be.attention(q, kv, pos.data() + 61 - rows, ap, out);
      Tensor y = be.scratch(DType::F32, {rows, m});
      be.matmul(out.reshaped({rows, c.nh * c.hd}), wt, y);
      Tensor att = upload(be, {rows, c.nh * c.hd}, download(be, out));  // the same values, quantized on their own
      Tensor y_ref = be.scratch(DType::F32, {rows, m});
      be.matmul(att, wt, y_ref);
      return std::make_pair(download(be, y), download(be, y_ref));
    };
    const std::string n = " (" + std::to_string(rows) + " rows)";
    const auto [yc, yc_ref] = side(cpu(), w.c);
    const auto [yg, yg_ref] = side(*tiled, w.g);
    check("attention then matmul" + n, yc, yg, kTolMat);
    check("attention's own quantization (or bf16) vs the product's of its output" + n, yg_ref, yg, 1e-6);
  }
}

// Several sequences in one kv_write_batch + attention_batch call: decode rows (count 1) beside
// prefill chunks, different lengths, each over its own store (or pages of one pool).
TEST_F(CudaOps, AttentionBatchMixedDecodeAndPrefill) {
  for (const AttnConfig& c : attention_configs()) {
    const auto steps = plan_steps({0, 100, 50, 299, 3, 17}, {1, 1, 37, 1, 16, 5}, 64);
    guarded("attention mixed-batch " + c.label(),
            [&] { compare_attention(cpu(), gpu(), c, steps, "mixed-batch", c.bf16_inputs ? kTolMat : 2 * kTolMat); });
  }
}

// A decode step of more sequences than one launch may take (the serving batch sizes: 40 here).
TEST_F(CudaOps, AttentionBatchManyDecodeSequences) {
  std::mt19937 rng(15);
  std::vector<int64_t> history, last;
  for (int s = 0; s < 40; ++s) history.push_back(1 + int64_t(rng() % 200)), last.push_back(1);
  AttnConfig rev{8, 2, 256, 48, 0.f, 0.f, Layout::Paged}, rev_fused = rev;
  rev.reversed = rev_fused.reversed = rev_fused.fused_inputs = true;
  for (const AttnConfig& c : {AttnConfig{8, 2, 256, 48, 0.f, 0.f, Layout::Paged},
                              AttnConfig{16, 2, 512, 0, 0.f, 1.f, Layout::Paged},
                              AttnConfig{8, 1, 256, 48, 0.f, 0.f, Layout::Ring}, rev, rev_fused})
    guarded("attention 40-decode " + c.label(),
            [&] { compare_attention(cpu(), gpu(), c, plan_steps(history, last, 64), "40-decode", kTolMat); });
}

// attention_inputs (head norms, rotary, V norm and the KV write in one op) before attention, one
// sequence and batches of more sequences than one launch takes.
TEST_F(CudaOps, AttentionInputsThenAttention) {
  std::mt19937 rng(16);
  std::vector<int64_t> history, last;
  for (int s = 0; s < 40; ++s) history.push_back(1 + int64_t(rng() % 120)), last.push_back(1 + (s % 7 == 0 ? 3 : 0));
  for (AttnConfig c :
       {AttnConfig{8, 2, 256, 48, 0.f, 0.f, Layout::Paged}, AttnConfig{16, 2, 512, 0, 0.f, 1.f, Layout::Paged},
        AttnConfig{8, 1, 256, 48, 0.f, 0.f, Layout::Ring}, AttnConfig{4, 2, 64, 0, 0.f, 0.f, Layout::Flat},
        AttnConfig{4, 2, 16, 8, 0.f, 0.f, Layout::Ring}}) {
    c.fused_inputs = true;
    c.bf16_inputs = false;
    guarded("attention_inputs one-seq " + c.label(), [&] {
      compare_attention(cpu(), gpu(), c, {{{0, 0, 100}}, {{0, 100, 1}}, {{0, 101, 1}}}, "inputs-one", 2 * kTolMat);
    });
    guarded("attention_inputs 40-seq " + c.label(), [&] {
      compare_attention(cpu(), gpu(), c, plan_steps(history, last, 64), "inputs-40", 2 * kTolMat);
    });
  }
}

// The contract: ops read only the rows of positions in each query's window. Stores start as NaN,
// so a kernel that reads (even masked) rows of other positions - rows not yet written, rows below
// the window, pages not in the table - turns its output NaN. Stricter than the other tests,
// whose stale rows are finite.
// A vision encoder's attention: images stacked in one call, every patch seeing every patch of its
// image (at its last position, or AttentionSeq::last), long enough for the GPU's dense path (batched
// GEMMs and a softmax; MARKBASE_CUDA_DENSE_ATTENTION=0 takes the attention kernel instead): E4B's
// ViT heads (12 of 64), the large ViT's (16 of 72), and a call with a short image (the kernel).
TEST_F(CudaOps, AttentionOfWholeImages) {
  std::mt19937 rng(62);
  struct Case {
    int64_t nh, hd;
    std::vector<int64_t> counts;
  };
  for (const Case& c : {Case{12, 64, {300, 256}}, Case{16, 72, {260, 420}}, Case{4, 64, {64, 420}}}) {
    int64_t n = 0;
    for (int64_t cnt : c.counts) n += cnt;
    const auto qv = randn(size_t(n * c.nh * c.hd), rng, 2.f), kv = randn(size_t(n * c.nh * c.hd), rng, 2.f),
               vv = randn(size_t(n * c.nh * c.hd), rng);
    std::vector<int32_t> slots(static_cast<size_t>(n)), last(static_cast<size_t>(n));
    for (int64_t b = 0, at = 0; b < int64_t(c.counts.size()); at += c.counts[size_t(b)], ++b)
      for (int64_t i = 0; i < c.counts[size_t(b)]; ++i) {
        slots[size_t(at + i)] = int32_t(i);
        last[size_t(at + i)] = int32_t(c.counts[size_t(b)] - 1);
      }
    mb::AttentionParams ap;
    ap.scale = 1.f / std::sqrt(float(c.hd));
    auto run = [&](Backend& be) {
      std::vector<mb::KVStore> stores(c.counts.size());
      std::vector<Backend::AttentionSeq> writes, reads;
      for (int64_t b = 0, at = 0; b < int64_t(c.counts.size()); at += c.counts[size_t(b)], ++b) {
        mb::KVStore& st = stores[size_t(b)];
        st.k = be.alloc(be.kv_dtype(), {c.counts[size_t(b)], c.nh, c.hd});
        st.v = be.alloc(be.kv_dtype(), {c.counts[size_t(b)], c.nh, c.hd});
        st.capacity = c.counts[size_t(b)];
      }
      for (int64_t b = 0, at = 0; b < int64_t(c.counts.size()); at += c.counts[size_t(b)], ++b) {
        writes.push_back({&stores[size_t(b)], at, c.counts[size_t(b)], slots.data() + at});
        // As the ViT asks (every patch at its image's last position), or through `last`.
        if (b % 2 == 0)
          reads.push_back({&stores[size_t(b)], at, c.counts[size_t(b)], last.data() + at, nullptr});
        else
          reads.push_back({&stores[size_t(b)], at, c.counts[size_t(b)], slots.data() + at, last.data() + at});
      }
      const Tensor q = upload(be, {n, c.nh, c.hd}, qv), k = upload(be, {n, c.nh, c.hd}, kv),
                   v = upload(be, {n, c.nh, c.hd}, vv);
      be.kv_write_batch(k, v, writes);
      Tensor out = poisoned(be, {n, c.nh, c.hd});
      be.attention_batch(q, reads, ap, out);
      return download(be, out);
    };
    std::vector<float> ref, got;
    guarded("whole images", [&] {
      ref = run(cpu());
      got = run(gpu());
    });
    if (ref.empty() || got.empty()) continue;
    check("attention of whole images, " + std::to_string(c.nh) + " heads of " + std::to_string(c.hd), ref, got,
          kTolMat);
  }
}

TEST_F(CudaOps, AttentionReadsOnlyTheRowsOfTheWindow) {
  for (const AttnConfig& c : {AttnConfig{8, 2, 256, 48, 0.f, 0.f, Layout::Paged},
                              AttnConfig{8, 2, 256, 0, 0.f, 0.f, Layout::Flat},
                              AttnConfig{8, 1, 256, 48, 0.f, 0.f, Layout::Ring},
                              AttnConfig{16, 2, 512, 0, 0.f, 1.f, Layout::Paged}}) {
    const auto steps = plan_steps({0, 100, 50, 299, 3, 17}, {1, 1, 37, 1, 16, 5}, 64);
    const auto data = step_data(c, steps, 8);
    const auto ref = run_attention(cpu(), c, steps, data, false, true);
    const auto got = run_attention(gpu(), c, steps, data, true, true);
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i)
      worst = std::max(worst, check("attention over NaN-poisoned stores " + c.label() + " step " + std::to_string(i),
                                    ref[i], got[i], kTolMat, false));
    std::printf("[ cuda-op  ] attention over NaN-poisoned stores %s: worst rel %.2e\n", c.label().c_str(), worst);
  }
}

// Greedy picks on the device: each row's first maximum as the host takes it, -1 for a row with a
// non-finite value; a vocabulary's width and ties across the block's threads and warps.
TEST_F(CudaOps, ArgmaxRowsMatchesTheHost) {
  std::mt19937 rng(33);
  for (int64_t V : {int64_t(5), int64_t(1000), int64_t(262144)}) {
    const int64_t r = 9;
    std::vector<float> x = randn(size_t(r * V), rng);
    // Row 1: the maximum twice, far apart (threads of different warps); row 2: all equal; row 3:
    // a NaN; row 4: an infinity; row 5: the maximum at the last column.
    x[size_t(1 * V + V / 3)] = 50.f, x[size_t(1 * V + V - 1)] = 50.f;
    std::fill(x.begin() + 2 * V, x.begin() + 3 * V, 0.25f);
    x[size_t(3 * V + V / 2)] = kNaN;
    x[size_t(4 * V)] = std::numeric_limits<float>::infinity();
    x[size_t(5 * V + V - 1)] = 60.f;
    std::vector<int32_t> got(static_cast<size_t>(r)), want(static_cast<size_t>(r));
    for (Backend* be : {&cpu(), &gpu()}) {
      Tensor t = upload(*be, {r, V}, x);
      Tensor ids = be->scratch(DType::I32, {r});
      be->argmax_rows(t, ids);
      be->to_host(ids, (be == &cpu() ? want : got).data());
    }
    EXPECT_EQ(got, want) << "V=" << V;
    EXPECT_EQ(want[1], int32_t(V / 3));
    EXPECT_EQ(want[2], 0);
    EXPECT_EQ(want[3], -1);
    EXPECT_EQ(want[4], -1);
    EXPECT_EQ(want[5], int32_t(V - 1));
  }
}

// Sampling on the device picks what the host's rules pick (core/token_pick.h) with the same draw:
// temperature alone and with min-p (vocabulary order), top-k (within and beyond the device's
// list: the host then picks), top-p with and without top-k (a nucleus beyond the list: the host),
// rows of many equal logits (ties go by id), a non-finite row (-1), greedy rows among them.
TEST_F(CudaOps, SampleRowsPicksAsTheHost) {
  std::mt19937 rng(41);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const std::vector<mb::TokenPick> kinds = {
      {1.f, 0, 1.f, 0.f},    {0.7f, 0, 1.f, 0.05f}, {1.f, 1, 1.f, 0.f},    {0.8f, 40, 1.f, 0.f},
      {1.2f, 1024, 1.f, 0.f}, {1.f, 2000, 1.f, 0.f}, {1.f, 0, 0.9f, 0.f},   {2.5f, 0, 0.95f, 0.f},
      {1.f, 64, 0.8f, 0.1f}, {0.5f, 0, 0.5f, 0.2f}, {0.f, 0, 1.f, 0.f},    {1.f, 50, 1.f, 0.3f}};
  // MARKBASE_TEST_SAMPLE_QUICK=1 (compute-sanitizer's racecheck, ~100x slower): the full-size rows
  // of the first two kinds, one draw each.
  const bool quick = std::getenv("MARKBASE_TEST_SAMPLE_QUICK") != nullptr;
  for (int64_t V : {int64_t(7), int64_t(1000), int64_t(262144)}) {
    if (quick && V != 262144) continue;
    for (int logits_kind = 0; logits_kind < (quick ? 2 : 4); ++logits_kind) {
      // 0: logits ~ N(0, 3); 1: rounded to a few levels (many ties: the device's sampled threshold
      // lets too many through and it selects exactly instead); 2: one row of a NaN; 3: all equal.
      std::vector<float> x = randn(size_t(kinds.size() * V), rng, 3.f);
      if (logits_kind == 1)
        for (float& v : x) v = std::round(v);
      if (logits_kind == 3) std::fill(x.begin(), x.end(), 0.5f);
      if (logits_kind == 2) x[size_t(V / 2)] = kNaN;
      const int64_t r = int64_t(kinds.size());
      for (int rep = 0; rep < (quick ? 1 : 6); ++rep) {
        std::vector<mb::TokenPick> picks = kinds;
        for (mb::TokenPick& p : picks) p.u = rep == 0 ? 0.0 : rep == 1 ? 0.999999 : unit(rng);
        const Tensor t = upload(gpu(), {r, V}, x);
        std::vector<int32_t> got(static_cast<size_t>(r)), want(static_cast<size_t>(r));
        gpu().sample_rows(t, picks, got);
        const Tensor tc = upload(cpu(), {r, V}, x);
        cpu().sample_rows(tc, picks, want);
        EXPECT_EQ(got, want) << "V=" << V << " logits " << logits_kind << " rep " << rep;
        std::vector<mb::PickCandidate> scratch;
        for (int64_t i = 0; i < r; ++i) {
          const std::span<const float> row(x.data() + i * V, size_t(V));
          const bool finite = std::all_of(row.begin(), row.end(), [](float v) { return std::isfinite(v); });
          EXPECT_EQ(want[size_t(i)], finite ? mb::pick_token(row, picks[size_t(i)], scratch) : -1) << i;
        }
      }
    }
  }
}

// A staged array's reserve (device room for a table to grow into) is not its host memory: a host
// array that lies past a staged array's bytes but within its reserve - here, in one buffer; in a
// process, the next heap block - is the op's own data, not the staged copy's unwritten room.
TEST_F(CudaOps, HostArraysPastAStagedArrayAreTheirOwn) {
  std::mt19937 rng(9);
  const int64_t n = 23, c = 64;
  const auto src = randn(size_t(n * c), rng);
  const Tensor sc = upload(cpu(), {n, c}, src), sg = upload(gpu(), {n, c}, src);
  std::vector<int32_t> buf(64, 0);
  const int32_t* staged = buf.data();                         // 4 ids, 256 bytes of reserve
  for (int i = 0; i < 4; ++i) buf[size_t(i)] = i;
  int32_t* own = buf.data() + 8;                              // 32 bytes past it: not staged
  const int32_t rows[5] = {22, 7, 0, 13, 5};
  std::copy(rows, rows + 5, own);
  gpu().stage({{staged, 4 * sizeof(int32_t), 64 * sizeof(int32_t)}});
  Unstage unstage(&gpu());
  Tensor oc = poisoned(cpu(), {5, c}), og = poisoned(gpu(), {5, c});
  cpu().gather_rows(sc, own, 5, oc);
  gpu().gather_rows(sg, own, 5, og);
  check("gather_rows with ids past a staged array", download(cpu(), oc), download(gpu(), og), 0);
  // And the staged array itself still reads its staged copy.
  Tensor oc2 = poisoned(cpu(), {4, c}), og2 = poisoned(gpu(), {4, c});
  cpu().gather_rows(sc, staged, 4, oc2);
  gpu().gather_rows(sg, staged, 4, og2);
  check("gather_rows with staged ids", download(cpu(), oc2), download(gpu(), og2), 0);
}

// ---------------------------------------------------------------- recorded steps

// A decode step's ops (embed, q/k/v matmuls, norm+rope, kv_write_batch, attention_batch, output
// matmul, softcap) recorded once and replayed with new staged ids, positions and page tables:
// every step equals the CPU's unrecorded ops.
TEST_F(CudaOps, RecordedStepReplaysWithNewStagedInputs) {
  const bool can_record = gpu().can_record_steps();
#ifndef MB_CUDA_TEST_SELF_CHECK
  ASSERT_TRUE(can_record) << "the CUDA backend should record steps";
#endif
  std::mt19937 rng(16);
  const int64_t V = 500, H = 512, nh = 4, nkv = 2, hd = 256, B = 3, max_pos = 64;
  const Weight table = [&] {
    const auto f = randn(size_t(V * H), rng, 0.05f);
    const Tensor src = host_weight(DType::Q8_0, {V, H}, f);
    return Weight{cpu().prepare_weight(src, DType::Q8_0, Backend::WeightUse::MatmulAndLookup),
                  gpu().prepare_weight(src, DType::Q8_0, Backend::WeightUse::MatmulAndLookup)};
  }();
  const Weight wq = random_weight(cpu(), gpu(), DType::Q4_0, {nh * hd, H}, rng);
  const Weight wk = random_weight(cpu(), gpu(), DType::Q4_0, {nkv * hd, H}, rng);
  const Weight wv = random_weight(cpu(), gpu(), DType::BF16, {nkv * hd, H}, rng);
  const Weight wo = random_weight(cpu(), gpu(), DType::Q4_K, {H, nh * hd}, rng);
  const auto normw = randn(size_t(hd), rng, 0.3f);
  const Tensor nc = upload(cpu(), {hd}, normw), ng = upload(gpu(), {hd}, normw);
  const auto inv = inv_freq_of(hd, hd / 4, 1e4f);

  struct Side {
    Backend* be;
    const Weight* w[5];  // table, q, k, v, o: pick .c or .g
    const Tensor* norm;
    bool gpu;
    Tensor pool_k, pool_v, logits;
    std::vector<mb::KVStore> stores;
  };
  // Host arrays: fixed addresses and sizes for the whole run (the staged layout must not move).
  std::vector<int32_t> ids(B), pos(B);
  std::vector<std::vector<int32_t>> tables(B, std::vector<int32_t>(size_t(max_pos / kPage)));
  for (int64_t s = 0; s < B; ++s)
    for (int64_t p = 0; p < max_pos / kPage; ++p) tables[size_t(s)][size_t(p)] = int32_t(p * B + s);
  auto make_side = [&](Backend& be, bool is_gpu, const Tensor& norm) {
    Side sd{&be, {&table, &wq, &wk, &wv, &wo}, &norm, is_gpu, {}, {}, {}, {}};
    const int64_t pool_rows = B * max_pos;
    sd.pool_k = be.alloc(be.kv_dtype(), {pool_rows, nkv, hd});
    sd.pool_v = be.alloc(be.kv_dtype(), {pool_rows, nkv, hd});
    sd.logits = be.alloc(DType::F32, {B, V});
    for (int64_t s = 0; s < B; ++s) {
      mb::KVStore st;
      st.k = sd.pool_k;
      st.v = sd.pool_v;
      st.capacity = pool_rows;
      st.pages = tables[size_t(s)].data();
      st.page_size = kPage;
      st.n_pages = max_pos / kPage;
      sd.stores.push_back(st);
    }
    return sd;
  };
  Side cs = make_side(cpu(), false, nc), gs = make_side(gpu(), true, ng);
  auto W = [](const Side& sd, int i) -> const Tensor& { return sd.gpu ? sd.w[i]->g : sd.w[i]->c; };
  // The ops of one step, outputs in sd.logits.
  auto ops = [&](Side& sd) {
    Backend& be = *sd.be;
    Tensor x = be.scratch(DType::F32, {B, H});
    be.embed(W(sd, 0), ids.data(), B, 22.6f, x);
    Tensor q = be.scratch(DType::F32, {B, nh, hd}), k = be.scratch(DType::F32, {B, nkv, hd}),
           v = be.scratch(DType::F32, {B, nkv, hd});
    be.matmuls(x, {&W(sd, 1), &W(sd, 2), &W(sd, 3)}, {&q, &k, &v});
    be.rms_norm_rope(q, sd.norm, 1e-6f, false, pos.data(), inv.data());
    be.rms_norm_rope(k, sd.norm, 1e-6f, false, pos.data(), inv.data());
    std::vector<Backend::AttentionSeq> seqs;
    for (int64_t s = 0; s < B; ++s) seqs.push_back({&sd.stores[size_t(s)], s, 1, pos.data() + s});
    be.kv_write_batch(k, v, seqs);
    Tensor att = be.scratch(DType::F32, {B, nh, hd});
    mb::AttentionParams ap;
    ap.scale = 1.f / 16.f;
    ap.window = 20;
    be.attention_batch(q, seqs, ap, att);
    Tensor h = be.scratch(DType::F32, {B, H});
    be.matmul(att.reshaped({B, nh * hd}), W(sd, 4), h);
    be.matmul(h, W(sd, 0), sd.logits);  // the tied LM head
    be.softcap(sd.logits, 30.f);
  };
  const uint64_t key = 0xC0DA5EEDull;
  auto stage = [&](Backend& be) {
    std::vector<mb::HostArray> a = {{ids.data(), ids.size() * 4, ids.size() * 4},
                                    {pos.data(), pos.size() * 4, pos.size() * 4}};
    for (auto& t : tables) a.push_back({t.data(), t.size() * 4, t.size() * 4});
    be.stage(a);
  };
  Unstage unstage(&gpu());
  int replays = 0, first_replay = -1;
  for (int step = 0; step < 40; ++step) {
    for (int64_t s = 0; s < B; ++s) {
      ids[size_t(s)] = int32_t(rng() % uint32_t(V));
      pos[size_t(s)] = int32_t(step + 3 * s);  // the sequences at different positions
    }
    // Pages wholly below every later query's window are given back (-1), as the runtime does.
    for (int64_t s = 0; s < B; ++s)
      for (int64_t p = 0; p < max_pos / kPage; ++p)
        if ((p + 1) * kPage - 1 < pos[size_t(s)] - 20 + 1) tables[size_t(s)][size_t(p)] = -1;
    stage(cpu());
    ops(cs);
    stage(gpu());
    // As Model::forward does: replay the key's recording, else record (a backend may run a key's
    // first steps as plain ops before it records one).
    bool replayed = false;
    if (step == 0 || !can_record) {
      ops(gs);  // unrecorded first, as a prefill comes before decode
    } else if (!(replayed = gpu().replay_step(key))) {
      EXPECT_LT(first_replay, 0) << "step " << step << ": a key replayed before has no recording now";
      gpu().begin_recording(key);
      ops(gs);
      gpu().end_recording(key);
    }
    if (replayed) ++replays, first_replay = first_replay < 0 ? step : first_replay;
    const char* how = step == 0 || !can_record ? " (unrecorded)" : replayed ? " (replay)" : " (recorded)";
    check("recorded decode step " + std::to_string(step) + how, download(cpu(), cs.logits), download(gpu(), gs.logits),
          kTolMat, step < 4 || step == 39);
  }
  if (can_record) {
    EXPECT_GE(first_replay, 1);
    EXPECT_LE(first_replay, 4) << "no replay within the first steps of one key";
    std::printf("[ cuda-op  ] recorded decode step: %d of 39 steps replayed, the first at step %d\n", replays,
                first_replay);
  }
  gpu().forget_recordings();
  EXPECT_FALSE(gpu().replay_step(key)) << "forget_recordings left the recording";
  EXPECT_EQ(cpu().replay_step(key), false);
}

}  // namespace
