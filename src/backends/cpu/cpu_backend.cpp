// CPU backend: f32 activations, f32/bf16/f16 weights read in place from the mmap.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/qmatmul.h"
#include "core/mmap.h"
#include "core/error.h"
#include "core/quant.h"
#include "core/scratch_pool.h"
#include "core/thread_pool.h"

namespace mb {

namespace {

void check_f32(const Tensor& t, const char* op, const char* what) {
  MB_CHECK(t.dtype == DType::F32, "{}: {} must be F32, got {}", op, what, dtype_name(t.dtype));
}

// f(begin, end) over [0, n) elementwise, in chunks of 64K elements over the pool's threads (a
// wake-up costs more than a smaller chunk's work).
template <class F> void for_elements(int64_t n, F&& f) {
  constexpr int64_t kChunk = int64_t(1) << 16;
  if (n <= kChunk) {
    f(int64_t(0), n);
    return;
  }
  ThreadPool::global().parallel_for((n + kChunk - 1) / kChunk, 1,
                                    [&](int64_t b, int64_t e) { f(b * kChunk, std::min(n, e * kChunk)); });
}

// The weight of an rms_norm over rows of d, checked; null when w is.
const float* norm_weight(const Tensor* w, int64_t d, const char* op) {
  if (!w) return nullptr;
  MB_CHECK(w->dtype == DType::F32, "{}: weight must be f32, got {}", op, dtype_name(w->dtype));
  MB_CHECK(w->numel() == d, "{}: weight {} does not match rows of {}", op, w->shape_str(), d);
  return w->f32();
}

// y = x * (mean(x²) + eps)^-1/2 * (w, 1 + w or 1); y may be x. Every norm op goes through here, so
// fused and single ops give the same numbers.
void norm_row(const float* x, int64_t d, const float* w, float eps, bool add_one, float* y) {
  const float ms = cpu::dot_f32(x, x, d) / float(d) + eps;
  const float inv = 1.f / std::sqrt(ms);
  // One loop per case, each free of the aliasing GCC assumes between y and x (ivdep: y is x or
  // apart from it), so each vectorises; the scalar loop this replaces was most of a decode
  // step's norm time.
  if (!w) {
#pragma GCC ivdep
    for (int64_t j = 0; j < d; ++j) y[j] = x[j] * inv;
  } else if (add_one) {
#pragma GCC ivdep
    for (int64_t j = 0; j < d; ++j) y[j] = (x[j] * inv) * (1.f + w[j]);
  } else {
#pragma GCC ivdep
    for (int64_t j = 0; j < d; ++j) y[j] = (x[j] * inv) * w[j];
  }
}

// Rows per chunk for a row-wise op (norms, RoPE) over n rows, `grain` when there are many: a
// decode batch of up to one row per thread gets a chunk per row. Its rows take microseconds each
// (norm + RoPE of 8 heads, a norm of 1536), so chunks of several rows (the grain of many rows)
// make every norm of a batch step wait on those rows in turn while other cores idle.
int64_t row_grain(int64_t n, int64_t grain) { return n <= ThreadPool::global().size() ? 1 : grain; }

// cos/sin of the angles of n positions' distinct values ([values, half] each), and rotation of head
// vectors by one position's row of them. Distinct values, not positions: a vision tower's 2D RoPE
// rotates 60,480 half-heads of an image by ~100 distinct patch coordinates.
struct RopeTable {
  std::vector<float> inv_freq;
  std::vector<int32_t> pos;
  std::vector<int32_t> row;  // row[t]: pos[t]'s row of cs and sn
  std::vector<float> cs, sn;
  std::vector<std::pair<int64_t, int64_t>> runs;  // [begin, end) of the nonzero frequencies
  int64_t half = 0;

  RopeTable(const int32_t* p, int64_t n, const float* f, int64_t h)
      : inv_freq(f, f + h), pos(p, p + n), row(size_t(n)), half(h) {
    for (int64_t j = 0; j < h; ++j)
      if (f[j] != 0.f) {
        if (runs.empty() || runs.back().second != j) runs.push_back({j, j});
        runs.back().second = j + 1;
      }
    std::vector<int32_t> values(pos);
    std::sort(values.begin(), values.end());
    values.erase(std::unique(values.begin(), values.end()), values.end());
    for (int64_t t = 0; t < n; ++t)
      row[size_t(t)] = int32_t(std::lower_bound(values.begin(), values.end(), p[t]) - values.begin());
    const int64_t nv = int64_t(values.size());
    cs.resize(size_t(nv * h));
    sn.resize(size_t(nv * h));
    ThreadPool::global().parallel_for(nv, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        for (int64_t j = 0; j < h; ++j) {
          // Angles in f32 exactly as transformers forms them: float(pos) * inv_freq.
          const float a = float(values[size_t(i)]) * f[j];
          cs[size_t(i * h + j)] = std::cos(a);
          sn[size_t(i * h + j)] = std::sin(a);
        }
    });
  }
  int64_t angles() const { return int64_t(cs.size()); }
  bool same(const int32_t* p, int64_t n, const float* f, int64_t h) const {
    return h == half && int64_t(pos.size()) == n && std::equal(pos.begin(), pos.end(), p) &&
           std::equal(inv_freq.begin(), inv_freq.end(), f);
  }
  // Pairs with a zero frequency are left as they are (partial rotary: the unrotated tail), so
  // the rotation runs over the runs of nonzero ones, each a loop without a branch.
  void rotate(float* v, int64_t t) const {
    const float* ct = cs.data() + row[size_t(t)] * half;
    const float* st = sn.data() + row[size_t(t)] * half;
    for (const auto& [b, e] : runs) {
#pragma GCC ivdep
      for (int64_t j = b; j < e; ++j) {
        const float a = v[j], c = v[j + half];
        v[j] = a * ct[j] - c * st[j];
        v[j + half] = c * ct[j] + a * st[j];
      }
    }
  }
};

// The last few RopeTables, for the next call with the same positions and frequencies: every
// layer of a step rotates q and k at the step's positions with one of the model's few frequency
// sets (two on Gemma 4), and std::cos/sin were most of a decode step's rope time (a step
// rotates once per layer, with the same angles each time). Same functions of the same f32
// angles, so the same bits as computing them per call.
class RopeTables {
 public:
  std::shared_ptr<const RopeTable> get(const int32_t* pos, int64_t n, const float* inv_freq, int64_t half) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& t : tables_)
        if (t->same(pos, n, inv_freq, half)) return t;
    }
    auto t = std::make_shared<const RopeTable>(pos, n, inv_freq, half);
    // A long prompt's table is computed for its call alone (a 32k-token prompt at 256 angles a
    // position would keep 64 MB).
    if (t->angles() <= kMaxKeptAngles && n <= kMaxKeptPositions) {
      std::lock_guard<std::mutex> lock(mu_);
      tables_.insert(tables_.begin(), t);
      if (tables_.size() > kKeep) tables_.pop_back();
    }
    return t;
  }

 private:
  static constexpr size_t kKeep = 4;
  static constexpr int64_t kMaxKeptAngles = int64_t(1) << 18;
  static constexpr int64_t kMaxKeptPositions = int64_t(1) << 17;
  std::mutex mu_;
  std::vector<std::shared_ptr<const RopeTable>> tables_;  // most recent first
};

// The model's vector weights (norm weights, router scales) side by side in 2 MB blocks of huge
// pages. A decode step reads ~250 of them, each 1-6 KB, between the matmuls that evict them. In
// place in a GGUF mapping each sits on its own 4 KB pages between two large tensors, so each read
// was a TLB walk and a prefetch stream cut at 4 KB, from memory; here a whole model's vectors
// (1.2 MB on E2B) are one TLB entry, in the order the layers read them.
// A tensor of its own alloc_streamed memory: zeroed, from 2 MB up on huge pages.
Tensor streamed_tensor(DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  std::shared_ptr<uint8_t> p = alloc_streamed(std::max<size_t>(t.nbytes(), 1));
  t.data = p.get();
  t.owner = std::move(p);
  return t;
}

class VectorArena {
 public:
  Tensor copy(const Tensor& src) {
    const size_t bytes = (src.nbytes() + 63) / 64 * 64;
    if (bytes > kBlock / 4) {  // a large one gets its own block rather than wasting a block's tail
      Tensor t = streamed_tensor(src.dtype, src.shape);
      std::memcpy(t.data, src.data, src.nbytes());
      return t;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!block_ || used_ + bytes > kBlock) {
      block_ = alloc_streamed(kBlock);
      used_ = 0;
    }
    Tensor t = src;
    t.data = block_.get() + used_;
    t.owner = std::shared_ptr<void>(block_, t.data);
    std::memcpy(t.data, src.data, src.nbytes());
    used_ += bytes;
    return t;
  }

 private:
  static constexpr size_t kBlock = size_t(2) << 20;
  std::mutex mu_;
  std::shared_ptr<uint8_t> block_;
  size_t used_ = 0;
};

class CpuBackend final : public Backend {
 public:
  // MARKBASE_CPU_KV_ROUND=bf16: K/V values are rounded to bf16 as they are written (still stored
  // as f32), the precision of the CUDA backend's bf16 KV, so that parity tests compare the GPU with
  // a CPU doing the same arithmetic (random small models amplify the KV rounding alone to several
  // percent of the logit range; docs/cuda.md).
  CpuBackend() {
    const char* r = std::getenv("MARKBASE_CPU_KV_ROUND");
    kv_round_bf16_ = r && std::string(r) == "bf16";
  }
  std::string name() const override { return "cpu"; }
  Device device() const override { return Device::CPU; }

  // alloc_streamed: what is allocated here (KV caches) is read through every step, so from 2 MB
  // up it gets huge pages; its pages are zero until written, and only those written are resident.
  Tensor alloc(DType dtype, std::vector<int64_t> shape) override { return streamed_tensor(dtype, std::move(shape)); }
  Tensor scratch(DType dtype, std::vector<int64_t> shape) override {
    Tensor t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.owner = scratch_.get(t.nbytes());
    t.data = t.owner.get();
    return t;
  }

  bool supports_weight_dtype(DType d) const override {
    return d == DType::F32 || d == DType::BF16 || d == DType::F16 || dtype_is_quantized(d);
  }

  Tensor prepare_weight(const Tensor& src, DType dtype, WeightUse use) override {
    Tensor t = converted(src, dtype);
    const bool matmul_only = use == WeightUse::Matmul || use == WeightUse::MatmulRoundedInputs;
    if (src.rank() == 1 && t.dtype == DType::F32 && matmul_only) return vectors_.copy(t);
    if (!matmul_only && t.data == src.data) advise_random_access(src.data, src.nbytes());
    if (use == WeightUse::MatmulRoundedInputs && t.dtype == DType::BF16) {
      t.packed = rounded_inputs();
      return t;
    }
    // Block-quantized matmul weights get the integer kernels' layout when an integer kernel runs
    // here (not on the scalar table, not with MARKBASE_QUANT_MATMUL=exact: a copy nobody reads
    // would double the resident weights). The plain rows stay for lookups and the f32-activation
    // path; pages of the file read only to pack are given back.
    if (use != WeightUse::Lookup && src.rank() >= 2 && cpu::qpack_supports(t.dtype, t.cols()) && cpu::qmatmul_kernel()) {
      t.packed = cpu::qpack(t.dtype, t.data, t.rows(), t.cols(), t.data == src.data ? release_mapped_pages : nullptr);
    }
    return t;
  }

  Tensor converted(const Tensor& src, DType dtype) {
    MB_CHECK(supports_weight_dtype(src.dtype), "cpu backend: unsupported weight dtype {}", dtype_name(src.dtype));
    MB_CHECK(supports_weight_dtype(dtype), "cpu backend: unsupported target dtype {}", dtype_name(dtype));
    if (src.dtype == dtype) return src;
    if (dtype_is_quantized(src.dtype) || dtype_is_quantized(dtype)) return convert_rows(src, dtype);
    Tensor dst = host_tensor(dtype, src.shape);
    const int64_t n = src.numel();
    ThreadPool::global().parallel_for(n, 1 << 16, [&](int64_t b, int64_t e) {
      std::vector<float> tmp(size_t(e - b));
      cpu::to_f32(src.dtype, static_cast<const uint8_t*>(src.data) + b * dtype_size(src.dtype), tmp.data(), e - b);
      for (int64_t i = b; i < e; ++i) {
        float f = tmp[size_t(i - b)];
        if (dtype == DType::F32) dst.f32()[i] = f;
        else if (dtype == DType::BF16) dst.ptr<uint16_t>()[i] = f32_to_bf16(f);
        else dst.ptr<uint16_t>()[i] = f32_to_f16(f);
      }
    });
    return dst;
  }

  // Tensor::packed of a bf16 weight prepared for WeightUse::MatmulRoundedInputs: a tag, not a copy
  // (the rounded kernels read the rows where they lie).
  static const std::shared_ptr<const void>& rounded_inputs() {
    static const char tag = 0;
    static const std::shared_ptr<const void> p(&tag, [](const void*) {});
    return p;
  }

  // w's copy for the integer kernels (prepare_weight), or null; a bf16 weight's `packed` is the
  // rounded-inputs tag.
  static const cpu::QPacked* qpacked(const Tensor& w) {
    return dtype_is_quantized(w.dtype) ? static_cast<const cpu::QPacked*>(w.packed.get()) : nullptr;
  }

  void matmul(const Tensor& x, const Tensor& w, Tensor& y) override {
    matmul_with(x, w, y, w.packed == rounded_inputs() ? cpu::Bf16Products::Rounded : cpu::Bf16Products::Exact);
  }

  void matmul_clipped(const Tensor& x, const Tensor& w, const Clip& clip, Tensor& y, Activation act,
                      const Tensor* times) override {
    if (dtype_is_quantized(w.dtype)) return Backend::matmul_clipped(x, w, clip, y, act, times);
    check_activation(y, act, times);
    const cpu::MatClip c{clip.in_lo, clip.in_hi, clip.out_lo, clip.out_hi,
                         act == Activation::Silu            ? cpu::MatAct::Silu
                         : act == Activation::GeluTanhTimes ? cpu::MatAct::GeluTanhTimes
                                                            : cpu::MatAct::None,
                         times ? times->f32() : nullptr};
    matmul_with(x, w, y, w.packed == rounded_inputs() ? cpu::Bf16Products::Rounded : cpu::Bf16Products::Exact, &c);
  }

  void matmul_with(const Tensor& x, const Tensor& w, Tensor& y, cpu::Bf16Products products,
                   const cpu::MatClip* clip = nullptr) {
    check_f32(x, "matmul", "x");
    check_f32(y, "matmul", "y");
    const int64_t n = x.rows(), k = x.cols(), m = w.rows();
    MB_CHECK(w.cols() == k && y.numel() == n * m, "matmul: x {} · w {}ᵀ -> y {} do not fit",
             x.shape_str(), w.shape_str(), y.shape_str());
    if (dtype_is_quantized(w.dtype)) return matmul_quantized(x, w, y);
    MB_CHECK(cpu::is_kernel_weight_dtype(w.dtype), "matmul: unsupported weight dtype {}", dtype_name(w.dtype));
    cpu::matmul(x.f32(), k, n, k, w.dtype, w.data, size_t(k) * dtype_size(w.dtype), m, y.f32(), m, products, clip);
  }

  void matmuls(const Tensor& x, const std::vector<const Tensor*>& ws, const std::vector<Tensor*>& ys) override {
    MB_CHECK(ws.size() == ys.size(), "matmuls: {} weights for {} outputs", ws.size(), ys.size());
    cpu::QMatmulFn fn = cpu::qmatmul_kernel();
    bool fused = fn != nullptr && ws.size() > 1;
    for (size_t i = 0; fused && i < ws.size(); ++i) fused = qpacked(*ws[i]) != nullptr;
    if (!fused) return Backend::matmuls(x, ws, ys);
    check_f32(x, "matmuls", "x");
    std::vector<const cpu::QPacked*> packed;
    std::vector<float*> outs;
    for (size_t i = 0; i < ws.size(); ++i) {
      check_f32(*ys[i], "matmuls", "y");
      MB_CHECK(ws[i]->cols() == x.cols() && ys[i]->numel() == x.rows() * ws[i]->rows(),
               "matmuls: x {} · w {}ᵀ -> y {} do not fit", x.shape_str(), ws[i]->shape_str(), ys[i]->shape_str());
      packed.push_back(qpacked(*ws[i]));
      outs.push_back(ys[i]->f32());
    }
    cpu::qmatmul_many(fn, packed, x.f32(), x.cols(), x.rows(), outs);
  }

  void matmul_gelu_mul(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, Tensor& out) override {
    cpu::QMatmulFn fn = cpu::qmatmul_kernel();
    if (!fn || !qpacked(w_gate) || !qpacked(w_up)) return Backend::matmul_gelu_mul(x, w_gate, w_up, out);
    check_f32(x, "matmul_gelu_mul", "x");
    check_f32(out, "matmul_gelu_mul", "out");
    MB_CHECK(w_gate.cols() == x.cols() && w_up.cols() == x.cols() && w_up.rows() == w_gate.rows() &&
                 out.numel() == x.rows() * w_gate.rows(),
             "matmul_gelu_mul: x {} · gate {}ᵀ, up {}ᵀ -> out {} do not fit", x.shape_str(), w_gate.shape_str(),
             w_up.shape_str(), out.shape_str());
    Tensor up = scratch(DType::F32, out.shape);
    cpu::qmatmul_gelu_mul(fn, *qpacked(w_gate), *qpacked(w_up), x.f32(), x.cols(), x.rows(), out.f32(),
                          up.f32());
  }

  void gated_ffn(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down, Tensor& out) override {
    cpu::QMatmulFn fn = cpu::qmatmul_kernel();
    if (!fn || !qpacked(w_gate) || !qpacked(w_up) || !qpacked(w_down) || w_gate.rows() % 32 != 0)
      return Backend::gated_ffn(x, w_gate, w_up, w_down, out);
    check_f32(x, "gated_ffn", "x");
    check_f32(out, "gated_ffn", "out");
    const int64_t n = x.rows(), F = w_gate.rows();
    MB_CHECK(w_gate.cols() == x.cols() && w_up.cols() == x.cols() && w_up.rows() == F && w_down.cols() == F &&
                 out.numel() == n * w_down.rows(),
             "gated_ffn: x {} · gate {}ᵀ, up {}ᵀ, down {}ᵀ -> out {} do not fit", x.shape_str(), w_gate.shape_str(),
             w_up.shape_str(), w_down.shape_str(), out.shape_str());
    Tensor g = scratch(DType::F32, {n, F}), up = scratch(DType::F32, {n, F});
    cpu::qmatmul_gated_ffn(fn, *qpacked(w_gate), *qpacked(w_up), *qpacked(w_down), x.f32(), x.cols(), n, g.f32(), up.f32(),
                           out.f32(), w_down.rows());
  }

  void softcap(Tensor& x, float cap) override {
    check_f32(x, "softcap", "x");
    cpu::softcap(x.f32(), x.numel(), cap);
  }

  void clamp(Tensor& x, float lo, float hi) override {
    check_f32(x, "clamp", "x");
    float* p = x.f32();
    for_elements(x.numel(), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) p[i] = std::min(std::max(p[i], lo), hi);
    });
  }

  void clamp_into(const Tensor& x, float lo, float hi, Tensor& out) override {
    check_f32(x, "clamp_into", "x");
    check_f32(out, "clamp_into", "out");
    MB_CHECK(out.numel() == x.numel(), "clamp_into: x {} into out {}", x.shape_str(), out.shape_str());
    const float* src = x.f32();
    float* dst = out.f32();
    for_elements(x.numel(), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dst[i] = std::min(std::max(src[i], lo), hi);
    });
  }

  void silu(Tensor& x) override {
    check_f32(x, "silu", "x");
    float* p = x.f32();
    const cpu::KernelTable& K = cpu::kernels();
    for_elements(x.numel(), [&](int64_t b, int64_t e) { K.silu(p + b, e - b); });
  }

  // Mean and variance in double, as the towers' host LayerNorm did before it became an op.
  void layer_norm(const Tensor& x, const Tensor& w, const Tensor* b, float eps, bool relu, Tensor& y) override {
    check_f32(x, "layer_norm", "x");
    check_f32(y, "layer_norm", "y");
    const int64_t width = x.cols(), rows = x.numel() / std::max<int64_t>(width, 1);
    MB_CHECK(width > 0 && y.numel() == x.numel(), "layer_norm: x {} and y {} differ", x.shape_str(), y.shape_str());
    const float* wp = norm_weight(&w, width, "layer_norm");
    const float* bp = norm_weight(b, width, "layer_norm");
    const cpu::KernelTable& K = cpu::kernels();
    ThreadPool::global().parallel_for(rows, std::max<int64_t>(1, 16384 / width), [&](int64_t r0, int64_t r1) {
      // f32 vector sums: the mean, then the mean of what is left after it (a row far from zero
      // mean keeps ~1e-7 of its spread), then the variance of the centred row.
      std::vector<float> d(static_cast<size_t>(width));
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = x.f32() + r * width;
        float* out = y.f32() + r * width;
        float mean = K.sum(row, width) / float(width);
        for (int64_t c = 0; c < width; ++c) d[size_t(c)] = row[c] - mean;
        const float rest = K.sum(d.data(), width) / float(width);
        for (int64_t c = 0; c < width; ++c) d[size_t(c)] -= rest;
        const float rstd = 1.f / std::sqrt(K.dot(d.data(), d.data(), width) / float(width) + eps);
        for (int64_t c = 0; c < width; ++c) {
          float v = d[size_t(c)] * rstd * wp[c];
          if (bp) v += bp[c];
          out[c] = relu ? std::max(0.f, v) : v;
        }
      }
    });
  }

  void im2col(const Tensor& x, const uint8_t* row_valid, const Im2col& c, int64_t row0, Tensor& cols) override {
    check_f32(x, "im2col", "x");
    check_f32(cols, "im2col", "cols");
    const Im2colShape g = im2col_shape(x, c, row0, cols);
    ThreadPool::global().parallel_for(g.rows * g.wo, 16, [&](int64_t b, int64_t e) {
      for (int64_t o = b; o < e; ++o) {
        const int64_t oy = row0 + o / g.wo, ox = o % g.wo;
        float* dst = cols.f32() + o * g.patch;
        std::fill(dst, dst + g.patch, 0.f);
        for (int64_t i = 0; i < c.kernel; ++i) {
          const int64_t iy = oy * c.stride - c.pad + i;
          if (iy < 0 || iy >= g.h || (row_valid && !row_valid[iy])) continue;
          for (int64_t j = 0; j < c.kernel; ++j) {
            const int64_t ix = ox * c.stride - c.pad + j;
            if (ix < 0 || ix >= g.w) continue;
            const float* src = x.f32() + (iy * g.w + ix) * g.c;
            for (int64_t ch = 0; ch < g.c; ++ch) dst[ch * c.kernel * c.kernel + i * c.kernel + j] = src[ch];
          }
        }
      }
    });
  }

  void glu_causal_conv(const Tensor& g, const Tensor& w, Tensor& out) override {
    check_f32(g, "glu_causal_conv", "g");
    check_f32(out, "glu_causal_conv", "out");
    check_glu_causal_conv(g, w, out);
    const int64_t n = out.rows(), D = out.cols(), K = w.cols();
    std::vector<float> a(size_t(n * D));
    const cpu::KernelTable& KT = cpu::kernels();
    ThreadPool::global().parallel_for(n, 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) KT.glu(g.f32() + t * 2 * D, g.f32() + t * 2 * D + D, a.data() + t * D, D);
    });
    ThreadPool::global().parallel_for(n, 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t ch = 0; ch < D; ++ch) {
          float acc = 0.f;
          for (int64_t j = std::max<int64_t>(0, K - 1 - t); j < K; ++j)
            acc += w.f32()[ch * K + j] * a[size_t((t - (K - 1) + j) * D + ch)];
          out.f32()[t * D + ch] = acc;
        }
    });
  }

  // One query at a time: a query reads a few dozen keys, small next to the projections around it.
  void local_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_gain, const Tensor& rel_keys,
                       const LocalAttention& p, Tensor& out) override {
    for (const Tensor* t : {&q, &k, &v, &q_gain, &rel_keys, static_cast<const Tensor*>(&out)})
      check_f32(*t, "local_attention", "every tensor");
    const LocalAttentionShape s = local_attention_shape(q, k, v, q_gain, rel_keys, p, out);
    const int64_t nh = s.heads, hd = s.hd, width = nh * hd, n = s.n;
    const cpu::KernelTable& K = cpu::kernels();
    ThreadPool::global().parallel_for(n, 4, [&](int64_t begin, int64_t end) {
      // q̃ and q̃ · k_scale: content = q̃·k̃ is then one vector dot with the key as it lies.
      std::vector<float> qs(static_cast<size_t>(2 * hd)), logits(static_cast<size_t>(p.context));
      float* qk = qs.data() + hd;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t first = t / p.chunk * p.chunk - p.left;  // the frame of the context's first entry
        for (int64_t h = 0; h < nh; ++h) {
          const float* qt = q.f32() + t * width + h * hd;
          for (int64_t i = 0; i < hd; ++i) {
            qs[size_t(i)] = qt[i] * p.q_scale * q_gain.f32()[i];
            qk[i] = qs[size_t(i)] * p.k_scale;
          }
          float max_logit = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < p.context; ++j) {
            const int64_t src = first + j, d = t - src;
            float logit = p.invalid_logit;
            if (src >= 0 && src < n && p.valid[src] && d >= 0 && d < p.left) {
              const float content = K.dot(qk, k.f32() + src * width + h * hd, hd);
              const float position = K.dot(qs.data(), rel_keys.f32() + (d + p.rel_offset) * width + h * hd, hd);
              logit = std::tanh((content + position) / p.logit_cap) * p.logit_cap;
            }
            logits[size_t(j)] = logit;
            max_logit = std::max(max_logit, logit);
          }
          float sum = 0.f;
          for (float& l : logits) sum += (l = std::exp(l - max_logit));
          float* o = out.f32() + t * width + h * hd;
          std::fill(o, o + hd, 0.f);
          for (int64_t j = 0; j < p.context; ++j) {
            const int64_t src = first + j;
            if (src < 0 || src >= n) continue;  // zero values
            K.axpy(logits[size_t(j)] / sum, v.f32() + src * width + h * hd, o, hd);
          }
        }
      }
    });
  }

  void embed(const Tensor& table, const int32_t* ids, int64_t n, float scale, Tensor& out) override {
    check_f32(out, "embed", "out");
    const int64_t d = table.cols(), vocab = table.rows();
    MB_CHECK(out.rows() == n && out.cols() == d, "embed: out {} does not fit {} rows of {}", out.shape_str(), n, d);
    const size_t row_bytes = dtype_row_bytes(table.dtype, d);
    std::lock_guard<std::mutex> lock(lookup_mu_);
    size_t& touched = lookup_touched_[table.data];
    for (int64_t i = 0; i < n; ++i) {
      MB_CHECK(ids[i] >= 0 && ids[i] < vocab, "token id {} is outside the vocabulary [0, {})", ids[i], vocab);
      float* o = out.f32() + i * d;
      const uint8_t* row = static_cast<const uint8_t*>(table.data) + size_t(ids[i]) * row_bytes;
      if (dtype_is_quantized(table.dtype)) dequantize_row(table.dtype, row, o, d);
      else cpu::to_f32(table.dtype, row, o, d);
      for (int64_t j = 0; j < d; ++j) o[j] *= scale;
      // Each row read from a file-mapped table brings up to ~64 KB around it into the process
      // (the kernel maps neighbouring cached pages on a fault). Dropping the table's pages again
      // keeps its resident share near the rows being read, not every row ever read (E2B's
      // per-layer table is 2.3B parameters). One release over the whole table per ~2 MB of rows,
      // or per 1/128 of the table if that is more: each release is a TLB shootdown across the
      // process's threads, costly on a VM, so a release per row slowed prefill and a release over
      // a whole large table (E2B's) every few steps slowed decode (measured: docs/benchmarks.md).
      // 1/128 of the tables is at most ~1% more resident memory than the weights streamed.
      // Memory that is not a file mapping is left alone.
      touched += std::max<size_t>(row_bytes, kLookupWindow);
      if (touched >= std::max(kLookupBudget, table.nbytes() / 128)) {
        release_mapped_pages(table.data, table.nbytes());
        touched = 0;
      }
    }
  }

  void rms_norm(const Tensor& x, const Tensor* w, float eps, bool add_one, Tensor& y) override {
    check_f32(x, "rms_norm", "x");
    const int64_t d = x.cols(), rows = x.rows();
    MB_CHECK(y.numel() == x.numel(), "rms_norm: shapes {} and {} differ", x.shape_str(), y.shape_str());
    const float* wp = norm_weight(w, d, "rms_norm");
    ThreadPool::global().parallel_for(rows, row_grain(rows, std::max<int64_t>(1, 8192 / d)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row(x.f32() + r * d, d, wp, eps, add_one, y.f32() + r * d);
    });
  }

  void rope(Tensor& x, const int32_t* pos, const float* inv_freq) override {
    check_f32(x, "rope", "x");
    MB_CHECK(x.rank() == 3, "rope: expected [n, heads, head_dim], got {}", x.shape_str());
    const int64_t n = x.dim(0), heads = x.dim(1), hd = x.dim(2);
    const auto ang = rope_tables_.get(pos, n, inv_freq, hd / 2);
    ThreadPool::global().parallel_for(n, row_grain(n, 4), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t h = 0; h < heads; ++h) ang->rotate(x.f32() + (t * heads + h) * hd, t);
    });
  }

  void rms_norm_rope(Tensor& x, const Tensor* w, float eps, bool add_one, const int32_t* pos,
                     const float* inv_freq) override {
    check_f32(x, "rms_norm_rope", "x");
    MB_CHECK(x.rank() == 3, "rms_norm_rope: expected [n, heads, head_dim], got {}", x.shape_str());
    const int64_t n = x.dim(0), heads = x.dim(1), hd = x.dim(2);
    const float* wp = norm_weight(w, hd, "rms_norm_rope");
    const auto ang = rope_tables_.get(pos, n, inv_freq, hd / 2);
    ThreadPool::global().parallel_for(n, row_grain(n, 4), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          float* v = x.f32() + (t * heads + h) * hd;
          norm_row(v, hd, wp, eps, add_one, v);
          ang->rotate(v, t);
        }
    });
  }

  void add_rms_norm(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one, float scale) override {
    add_rms_norm_rows(x, branch, w, eps, add_one, scale, nullptr, nullptr);
  }

  // The next norm row by row while the new x is in cache: the same bits as the two ops.
  void add_rms_norm_norm(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one, float scale,
                         const Tensor* w_next, Tensor& y) override {
    check_f32(y, "add_rms_norm_norm", "y");
    MB_CHECK(y.numel() == x.numel(), "add_rms_norm_norm: y {} does not fit x {}", y.shape_str(), x.shape_str());
    add_rms_norm_rows(x, branch, w, eps, add_one, scale, norm_weight(w_next, x.cols(), "add_rms_norm_norm"), &y);
  }

  void add_rms_norm_rows(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one, float scale,
                         const float* w_next, Tensor* y) {
    check_f32(x, "add_rms_norm", "x");
    check_f32(branch, "add_rms_norm", "branch");
    MB_CHECK(x.numel() == branch.numel() && x.cols() == branch.cols(), "add_rms_norm: shapes {} and {} differ",
             x.shape_str(), branch.shape_str());
    const int64_t d = x.cols(), rows = x.rows();
    const float* wp = norm_weight(w, d, "add_rms_norm");
    ThreadPool::global().parallel_for(rows, row_grain(rows, std::max<int64_t>(1, 8192 / d)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        float* br = branch.f32() + r * d;
        float* xr = x.f32() + r * d;
        norm_row(br, d, wp, eps, add_one, br);
        // (x + y) * 1 is x + y exactly, so one loop serves both.
#pragma GCC ivdep
        for (int64_t j = 0; j < d; ++j) xr[j] = (xr[j] + br[j]) * scale;
        if (y) norm_row(xr, d, w_next, eps, add_one, y->f32() + r * d);
      }
    });
  }

  void kv_write(KVStore& kv, const Tensor& k, const Tensor& v, const int32_t* pos) override {
    const int64_t n = k.dim(0), row = k.numel() / std::max<int64_t>(1, n);
    MB_CHECK(kv.k.numel() == kv.capacity * row && v.numel() == k.numel(),
             "kv_write: K/V rows of {} do not fit the cache {}", row, kv.k.shape_str());
    for (int64_t t = 0; t < n; ++t) {
      MB_CHECK(pos[t] >= 0 && (!kv.pages || pos[t] / kv.page_size < kv.n_pages),
               "kv_write: position {} is beyond the sequence's {} KV pages", pos[t], kv.n_pages);
      int64_t s = kv.slot(pos[t]);
      MB_CHECK(s >= 0 && s < kv.capacity, "KV cache full: position {} needs more than {} slots", pos[t],
               kv.capacity);
      std::memcpy(kv.k.f32() + s * row, k.f32() + t * row, size_t(row) * 4);
      std::memcpy(kv.v.f32() + s * row, v.f32() + t * row, size_t(row) * 4);
      if (kv_round_bf16_)
        for (int64_t i = s * row; i < (s + 1) * row; ++i) {
          kv.k.f32()[i] = round_to_bf16(kv.k.f32()[i]);
          kv.v.f32()[i] = round_to_bf16(kv.v.f32()[i]);
        }
    }
  }

  void attention(const Tensor& q, const KVStore& kv, const int32_t* pos, const AttentionParams& p,
                 Tensor& out) override {
    attention_batch(q, {AttentionSeq{&kv, 0, q.dim(0), pos}}, p, out);
  }

  void attention_batch(const Tensor& q, const std::vector<AttentionSeq>& seqs, const AttentionParams& p,
                       Tensor& out) override {
    check_f32(q, "attention", "q");
    MB_CHECK(q.rank() == 3, "attention: expected q [n, heads, head_dim], got {}", q.shape_str());
    const int64_t n = q.dim(0), nh = q.dim(1), hd = q.dim(2);
    MB_CHECK(out.numel() == q.numel(), "attention: out {} does not fit q {}", out.shape_str(), q.shape_str());
    std::vector<cpu::AttnArgs> args;
    for (const AttentionSeq& s : seqs) {
      const KVStore& kv = *s.kv;
      const int64_t nkv = kv.k.dim(1);
      MB_CHECK(kv.k.dim(2) == hd && nkv > 0 && nh % nkv == 0, "attention: q {} and KV {} do not fit", q.shape_str(),
               kv.k.shape_str());
      MB_CHECK(kv.capacity > 0 && s.begin >= 0 && s.count >= 0 && s.begin + s.count <= n,
               "attention: rows [{}, {}) of q {} or an empty KV", s.begin, s.begin + s.count, q.shape_str());
      MB_CHECK(!kv.pages || (kv.page_size > 0 && (kv.page_size & (kv.page_size - 1)) == 0),
               "attention: KV pages of {} rows (a power of two is needed)", kv.page_size);
      const size_t off = size_t(s.begin * nh * hd);
      args.push_back({q.f32() + off, out.f32() + off, kv.k.f32(), kv.v.f32(), s.pos, s.count, nh, nkv, hd,
                      kv.capacity, kv.ring, kv.pages, kv.page_size, p.window, p.scale, p.softcap});
      args.back().last = s.last;
      MB_CHECK(!s.last || !kv.ring, "attention: keys past a query's position from a ring cache");
      if (p.rounded_inputs && kv.k.dtype == DType::F32 && cpu::attention_whole_rounded(args.back())) args.pop_back();
    }
    cpu::attention(args.data(), int64_t(args.size()));
  }

  void gelu_tanh_mul(const Tensor& gate, const Tensor& up, Tensor& out) override {
    const int64_t n = gate.numel();
    MB_CHECK(up.numel() == n && out.numel() == n, "gelu_tanh_mul: sizes differ");
    cpu::gelu_tanh_mul(gate.f32(), up.f32(), out.f32(), n);
  }

  void add(const Tensor& a, const Tensor& b, Tensor& out) override {
    const int64_t bn = add_operand(a, b, out);
    broadcast(a, b.f32(), bn, out, [](float x, float y) { return x + y; });
  }

  void mul(const Tensor& a, const Tensor& b, Tensor& out) override {
    const int64_t n = a.numel(), bn = b.numel();
    MB_CHECK(out.numel() == n && bn > 0 && n % bn == 0, "mul: sizes {} and {} do not broadcast", a.shape_str(),
             b.shape_str());
    broadcast(a, b.f32(), bn, out, [](float x, float y) { return x * y; });
  }

  // out[i] = op(a[i], b[i % bn]) over the threads, a run of b at a time (no division per element:
  // an audio tower's adds of 3 MB rows spent most of their time in it).
  template <class Op> static void broadcast(const Tensor& a, const float* b, int64_t bn, Tensor& out, Op op) {
    const float* x = a.f32();
    float* y = out.f32();
    for_elements(a.numel(), [&](int64_t s, int64_t e) {
      for (int64_t i = s; i < e;) {
        const int64_t j = i % bn, run = std::min(e - i, bn - j);
        for (int64_t r = 0; r < run; ++r) y[i + r] = op(x[i + r], b[j + r]);
        i += run;
      }
    });
  }

  void scale(Tensor& x, float s) override {
    for (int64_t i = 0, n = x.numel(); i < n; ++i) x.f32()[i] *= s;
  }


  void route_topk(const Tensor& logits, int k, const Tensor* per_expert_scale, Tensor& weights,
                  Tensor& experts) override {
    const int64_t n = logits.rows(), E = logits.cols();
    MB_CHECK(k > 0 && k <= E, "route_topk: k={} for {} experts", k, E);
    std::vector<float> prob(static_cast<size_t>(E));
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int64_t t = 0; t < n; ++t) {
      const float* l = logits.f32() + t * E;
      float mx = *std::max_element(l, l + E), sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (prob[size_t(e)] = std::exp(l[e] - mx));
      for (auto& v : prob) v /= sum;
      for (int64_t e = 0; e < E; ++e) order[size_t(e)] = int32_t(e);
      // Ties go to the lower expert index, as torch.topk does on CPU and CUDA in practice.
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return prob[size_t(a)] > prob[size_t(b)] || (prob[size_t(a)] == prob[size_t(b)] && a < b);
      });
      float tot = 0;
      for (int j = 0; j < k; ++j) tot += prob[size_t(order[size_t(j)])];
      for (int j = 0; j < k; ++j) {
        int32_t e = order[size_t(j)];
        float w = prob[size_t(e)] / tot;
        if (per_expert_scale) w *= per_expert_scale->f32()[e];
        weights.f32()[t * k + j] = w;
        experts.ptr<int32_t>()[t * k + j] = e;
      }
    }
  }

  void moe_gated_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down, const Tensor& weights,
                         const Tensor& experts, Tensor& out) override {
    const int64_t n = x.rows(), H = x.cols(), E = gate_up.dim(0), I2 = gate_up.dim(1), I = I2 / 2;
    const int64_t k = weights.cols();
    MB_CHECK(gate_up.rank() == 3 && down.rank() == 3 && gate_up.dim(2) == H && down.dim(0) == E &&
                 down.dim(1) == H && down.dim(2) == I,
             "moe: expert tensors {} / {} do not fit hidden size {}", gate_up.shape_str(), down.shape_str(), H);
    std::fill(out.f32(), out.f32() + out.numel(), 0.f);
    // Group the tokens routed to each expert so its weights stream once per call.
    std::vector<std::vector<std::pair<int64_t, float>>> routed(static_cast<size_t>(E));
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < k; ++j) {
        int32_t e = experts.ptr<int32_t>()[t * k + j];
        MB_CHECK(e >= 0 && e < E, "moe: expert index {} out of range", e);
        routed[size_t(e)].push_back({t, weights.f32()[t * k + j]});
      }
    const size_t gu_bytes = size_t(I2) * dtype_row_bytes(gate_up.dtype, H);
    const size_t dn_bytes = size_t(H) * dtype_row_bytes(down.dtype, I);
    for (int64_t e = 0; e < E; ++e) {
      auto& toks = routed[size_t(e)];
      if (toks.empty()) continue;
      const int64_t m = int64_t(toks.size());
      Tensor xe = scratch(DType::F32, {m, H}), gu = scratch(DType::F32, {m, I2});
      Tensor act = scratch(DType::F32, {m, I}), ye = scratch(DType::F32, {m, H});
      for (int64_t i = 0; i < m; ++i) std::memcpy(xe.f32() + i * H, x.f32() + toks[size_t(i)].first * H, size_t(H) * 4);
      Tensor wgu = gate_up;
      wgu.shape = {I2, H};
      wgu.data = static_cast<uint8_t*>(gate_up.data) + size_t(e) * gu_bytes;
      Tensor wdn = down;
      wdn.shape = {H, I};
      wdn.data = static_cast<uint8_t*>(down.data) + size_t(e) * dn_bytes;
      wgu.packed = packed_rows(gate_up, e * I2, I2);
      wdn.packed = packed_rows(down, e * H, H);
      // An expert's token count depends on the rest of the batch: its matmuls stay off the
      // count-dependent AMX-BF16 path, so a token's result is the same in any batch.
      matmul_with(xe, wgu, gu, cpu::Bf16Products::FmaChain);
      for (int64_t i = 0; i < m; ++i)
        cpu::kernels().gelu_tanh_mul(gu.f32() + i * I2, gu.f32() + i * I2 + I, act.f32() + i * I, I);
      matmul_with(act, wdn, ye, cpu::Bf16Products::FmaChain);
      for (int64_t i = 0; i < m; ++i)
        cpu::axpy(toks[size_t(i)].second, ye.f32() + i * H, out.f32() + toks[size_t(i)].first * H, H);
    }
  }

  void slice_cols(const Tensor& src, int64_t begin, Tensor& dst) override {
    const int64_t n = src.rows(), c = src.cols(), w = dst.cols();
    MB_CHECK(dst.rows() == n && begin >= 0 && begin + w <= c, "slice_cols: [{}, {}) of {} into {}", begin,
             begin + w, src.shape_str(), dst.shape_str());
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst.f32() + i * w, src.f32() + i * c + begin, size_t(w) * 4);
  }

  // In place: the rows are host memory already.
  void argmax_rows(const Tensor& x, Tensor& ids) override {
    check_f32(x, "argmax_rows", "x");
    MB_CHECK(ids.dtype == DType::I32 && ids.numel() > 0 && x.numel() % ids.numel() == 0,
             "argmax_rows: {} ids for x {}", ids.numel(), x.shape_str());
    const int64_t r = ids.numel(), V = x.numel() / r;
    for (int64_t i = 0; i < r; ++i) ids.ptr<int32_t>()[i] = first_max_or_nonfinite(x.f32() + i * V, V);
  }

  void gather_rows(const Tensor& src, const int32_t* rows, int64_t n, Tensor& dst) override {
    const int64_t c = src.cols();
    MB_CHECK(dst.rows() == n && dst.cols() == c, "gather_rows: {} rows of {} into {}", n, src.shape_str(),
             dst.shape_str());
    for (int64_t i = 0; i < n; ++i) {
      MB_CHECK(rows[i] >= 0 && rows[i] < src.rows(), "gather_rows: row {} out of range", rows[i]);
      std::memcpy(dst.f32() + i * c, src.f32() + int64_t(rows[i]) * c, size_t(c) * 4);
    }
  }

  void copy(const Tensor& src, Tensor& dst) override {
    MB_CHECK(src.nbytes() == dst.nbytes(), "copy: sizes differ ({} vs {})", src.shape_str(), dst.shape_str());
    const auto* from = static_cast<const uint8_t*>(src.data);
    auto* to = static_cast<uint8_t*>(dst.data);
    // An encoder's activations (8-30 MB) in 256 KB pieces over the threads.
    constexpr int64_t kPiece = int64_t(1) << 18;
    const int64_t n = int64_t(src.nbytes());
    ThreadPool::global().parallel_for((n + kPiece - 1) / kPiece, 4, [&](int64_t b, int64_t e) {
      std::memcpy(to + b * kPiece, from + b * kPiece, size_t(std::min(n, e * kPiece) - b * kPiece));
    });
  }

  void gather_sum_rows(const Tensor& src, const int32_t* rows, int64_t group, float scale, Tensor& dst) override {
    check_f32(src, "gather_sum_rows", "src");
    check_f32(dst, "gather_sum_rows", "dst");
    check_gather_sum_rows(src, rows, group, dst);
    const int64_t n = dst.rows(), c = src.cols();
    ThreadPool::global().parallel_for(n, 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        float* out = dst.f32() + i * c;
        std::fill(out, out + c, 0.f);
        for (int64_t j = 0; j < group; ++j) {
          const float* in = src.f32() + int64_t(rows[i * group + j]) * c;
          for (int64_t d = 0; d < c; ++d) out[d] += in[d] * scale;
        }
      }
    });
  }

  // The packed rows [row0, row0 + rows) of w when they start a packed group, else null.
  static std::shared_ptr<const void> packed_rows(const Tensor& w, int64_t row0, int64_t rows) {
    if (!qpacked(w) || row0 % cpu::kQRows != 0) return nullptr;
    auto all = std::static_pointer_cast<const cpu::QPacked>(w.packed);
    auto view = std::make_shared<cpu::QPacked>(*all);
    view->m = rows;
    view->groups = (rows + cpu::kQRows - 1) / cpu::kQRows;
    view->data = std::shared_ptr<uint8_t>(all->data, all->data.get() + size_t(row0 / cpu::kQRows) * all->group_bytes);
    return view;
  }

  // Block-quantized weights (GGUF files, --dtype q8_0/q4_0): packed ones take the integer kernel
  // when it runs here; otherwise f32 activations: the GEMM on dequantized panels for many tokens,
  // the fused dequantize-dot for one or two, a row dequantized once per call in between.
  void matmul_quantized(const Tensor& x, const Tensor& w, Tensor& y) {
    const int64_t n = x.rows(), k = x.cols(), m = w.rows();
    if (w.packed) {
      if (cpu::QMatmulFn fn = cpu::qmatmul_kernel()) {
        cpu::qmatmul(fn, *std::static_pointer_cast<const cpu::QPacked>(w.packed), x.f32(), k, n, y.f32(), m);
        return;
      }
    }
    const size_t row_bytes = dtype_row_bytes(w.dtype, k);
    if (cpu::matmul_blocks_supported(n)) {
      cpu::matmul(x.f32(), k, n, k, w.dtype, w.data, row_bytes, m, y.f32(), m);
      return;
    }
    const uint8_t* wbase = static_cast<const uint8_t*>(w.data);
    const float* xp = x.f32();
    float* yp = y.f32();
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / int64_t(row_bytes * size_t(std::min<int64_t>(n, 8))));
    ThreadPool::global().parallel_for(m, grain, [&](int64_t b, int64_t e) {
      thread_local std::vector<float> row;
      if (n > 2) row.resize(size_t(k));
      for (int64_t r = b; r < e; ++r) {
        const uint8_t* wr = wbase + size_t(r) * row_bytes;
        if (n <= 2) {
          for (int64_t t = 0; t < n; ++t) yp[t * m + r] = cpu::vec_dot(w.dtype, wr, xp + t * k, k);
          continue;
        }
        dequantize_row(w.dtype, wr, row.data(), k);
        for (int64_t t = 0; t < n; ++t) yp[t * m + r] = cpu::dot_f32(xp + t * k, row.data(), k);
      }
    });
  }

  // Row-wise conversion to or from a block type. A row whose length is not a whole number of
  // blocks cannot be quantized; such a tensor stays in its own dtype (as llama.cpp falls back).
  Tensor convert_rows(const Tensor& src, DType dtype) {
    const int64_t k = src.cols(), rows = src.rows();
    if (dtype_is_quantized(dtype) && k % int64_t(dtype_block_size(dtype)) != 0) return src;
    Tensor dst;
    dst.dtype = dtype;
    dst.shape = src.shape;
    const size_t in_bytes = dtype_row_bytes(src.dtype, k), out_bytes = dtype_row_bytes(dtype, k);
    Tensor storage = host_tensor(DType::U8, {int64_t(out_bytes * size_t(rows))});
    dst.data = storage.data;
    dst.owner = storage.owner;
    ThreadPool::global().parallel_for(rows, 16, [&](int64_t b, int64_t e) {
      std::vector<float> tmp(static_cast<size_t>(k));
      for (int64_t r = b; r < e; ++r) {
        const uint8_t* in = static_cast<const uint8_t*>(src.data) + size_t(r) * in_bytes;
        uint8_t* out = static_cast<uint8_t*>(dst.data) + size_t(r) * out_bytes;
        if (dtype_is_quantized(src.dtype)) dequantize_row(src.dtype, in, tmp.data(), k);
        else cpu::to_f32(src.dtype, in, tmp.data(), k);
        if (dtype_is_quantized(dtype)) quantize_row(dtype, tmp.data(), out, k);
        else if (dtype == DType::F32) std::memcpy(out, tmp.data(), size_t(k) * 4);
        else
          for (int64_t i = 0; i < k; ++i)
            reinterpret_cast<uint16_t*>(out)[i] = dtype == DType::BF16 ? f32_to_bf16(tmp[size_t(i)]) : f32_to_f16(tmp[size_t(i)]);
      }
    });
    return dst;
  }

  // A batch's logits are MBs (262k floats a row): one thread's memcpy was a visible share of a
  // batch decode step on many cores.
  void to_host(const Tensor& src, void* dst) override {
    const size_t bytes = src.nbytes();
    constexpr int64_t kChunk = 256 * 1024;
    ThreadPool::global().parallel_for(int64_t(bytes), kChunk, [&](int64_t b, int64_t e) {
      std::memcpy(static_cast<uint8_t*>(dst) + b, static_cast<const uint8_t*>(src.data) + b, size_t(e - b));
    });
  }

  void upload(const void* src, Tensor& dst) override { std::memcpy(dst.data, src, dst.nbytes()); }

 private:
  ScratchPool scratch_;
  bool kv_round_bf16_ = false;
  VectorArena vectors_;
  // Bytes of lookup rows read from each table (by its data pointer) since its pages were last
  // released (embed).
  static constexpr size_t kLookupWindow = 64 * 1024, kLookupBudget = 2 * 1024 * 1024;
  std::mutex lookup_mu_;
  std::map<const void*, size_t> lookup_touched_;
  RopeTables rope_tables_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() {
  cpu::kernels();  // a MARKBASE_CPU_ISA it cannot honour fails here, not at the first op
  return std::make_unique<CpuBackend>();
}

}  // namespace mb
