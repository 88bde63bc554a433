// Kernel dispatch, the scalar kernel table, and the parallel drivers. Compiled for the baseline
// x86-64 target like the rest of the library: nothing here may assume AVX.
#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/bf16_gemm.h"
#include "core/cache_hint.h"
#include "core/quant.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "core/error.h"
#include "core/stats.h"
#include "core/thread_pool.h"

namespace mb::cpu {

namespace {

// ---------------------------------------------------------------- scalar table

float s_dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void s_axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

float s_sum(const float* x, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += x[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += x[i];
  return s;
}

void s_to_f32(WType t, const void* src, float* dst, int64_t n) {
  if (n <= 0) return;  // zero-length rows may come with null pointers; memcpy must not see them
  if (t == WType::F32) {
    std::memcpy(dst, src, size_t(n) * 4);
  } else if (t == WType::BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);  // portable, bit-identical to F16C
  }
}

float gelu_tanh_scalar(float x) {
  // Same formula as torch's gelu(approximate="tanh"), evaluated in f32 like its CPU/CUDA kernels.
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  float inner = k * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.f + std::tanh(inner));
}

void s_gelu_tanh_mul(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gelu_tanh_scalar(g[i]) * u[i];
}

void s_silu(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i]));
}

void s_glu(const float* x, const float* gate, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] / (1.f + std::exp(-gate[i]));
}

float s_exp_sum_row(float* x, int64_t n, float scale) {
  float m = x[0], sum = 0.f;
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  for (int64_t i = 0; i < n; ++i) sum += x[i] = std::exp(scale * (x[i] - m));
  return sum;
}

void s_softcap(float* x, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] * inv) * cap;
}

size_t wsize(WType t) { return t == WType::F32 ? 4 : 2; }

// Each row is widened once and reused for every token.
void s_gemv(const MatArgs& a, int64_t r0, int64_t r1) {
  thread_local std::vector<float> row;
  row.resize(size_t(a.k));
  const uint8_t* wb = static_cast<const uint8_t*>(a.w);
  for (int64_t r = r0; r < r1; ++r) {
    const float* wr;
    if (a.wt == WType::F32) {
      wr = reinterpret_cast<const float*>(wb + size_t(r) * a.w_stride);
    } else {
      s_to_f32(a.wt, wb + size_t(r) * a.w_stride, row.data(), a.k);
      wr = row.data();
    }
    for (int64_t t = 0; t < a.n; ++t) a.y[t * a.ldy + r] = s_dot(a.x + t * a.ldx, wr, a.k);
  }
}

size_t s_attn_scratch(int64_t, int64_t) { return 0; }

void attention_rows(const AttnArgs& a, int64_t t0, int64_t t1, int64_t h0, int64_t h1) {
  const int64_t nh = a.nh, hd = a.hd, group = nh / a.nkv;
  thread_local std::vector<float> scores;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t g = h / group, hi = attn_last_key(a, t);
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, int64_t(a.pos[t]) - a.window + 1) : 0;
      const float* qv = a.q + (t * nh + h) * hd;
      auto slot = [&](int64_t j) { return kv_row(a, j); };
      scores.resize(size_t(hi - lo + 1));
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = lo; j <= hi; ++j) {
        const float* kr = a.k + (slot(j) * a.nkv + g) * hd;
        float s = s_dot(qv, kr, hd) * a.scale;
        if (a.softcap > 0) s = a.softcap * std::tanh(s / a.softcap);
        scores[size_t(j - lo)] = s;
        mx = std::max(mx, s);
      }
      float sum = 0;
      for (auto& s : scores) sum += (s = std::exp(s - mx));
      const float inv = 1.f / sum;
      float* o = a.out + (t * nh + h) * hd;
      std::fill(o, o + hd, 0.f);
      for (int64_t j = lo; j <= hi; ++j)
        s_axpy(scores[size_t(j - lo)] * inv, a.v + (slot(j) * a.nkv + g) * hd, o, hd);
    }
}

void s_attention(const AttnArgs& a, int64_t t0, int64_t t1, int64_t h0, int64_t h1, float*) {
  attention_rows(a, t0, t1, h0, h1);
}

const KernelTable kScalar = {
    Isa::Scalar, "scalar", s_dot, s_axpy, s_sum, s_to_f32, s_gelu_tanh_mul, s_softcap, s_silu, s_glu, s_exp_sum_row,
    std::numeric_limits<int>::max(), s_gemv,
    0, 0, 0, nullptr, nullptr, nullptr, nullptr,
    s_attn_scratch, s_attention, nullptr,
};

// ---------------------------------------------------------------- CPU detection

struct CpuFeatures {
  bool avx2 = false, avx512 = false, avx512_vnni = false;
  bool amx_int8 = false, amx_bf16 = false;  // the CPU and the OS's XCR0
  // VDPBF16PS at twice the f32 FMA's products a cycle: AMD's (Zen 4 runs the 512-bit one as
  // two 256-bit halves, 64 flops a cycle a core); the Intel Xeon here runs it at half its FMAs'
  // rate (1.2 G instructions/s against 4.85 G on one core), where AMX is the bf16 path.
  bool avx512_bf16 = false, fast_avx512_bf16 = false;
};

CpuFeatures detect_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  unsigned xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool ymm_os = (xlo & 0x6u) == 0x6u;          // SSE + AVX state
  const bool zmm_os = ymm_os && (xlo & 0xe0u) == 0xe0u;  // opmask + ZMM_Hi256 + Hi16_ZMM
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5), f512 = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30),
             vl = b & (1u << 31);
  f.avx2 = ymm_os && avx2 && fma && f16c;
  f.avx512 = f.avx2 && zmm_os && f512 && dq && bw && vl;
  f.avx512_vnni = f.avx512 && (c & (1u << 11));
  const bool tiles_os = (xlo & 0x60000u) == 0x60000u;  // XTILECFG + XTILEDATA
  const bool amx_tile = d & (1u << 24);
  f.amx_int8 = f.avx512_vnni && tiles_os && amx_tile && (d & (1u << 25));
  f.amx_bf16 = f.avx512 && tiles_os && amx_tile && (d & (1u << 22));
  unsigned vendor[3];
  __get_cpuid(0, &a, &vendor[0], &vendor[2], &vendor[1]);
  const bool amd = std::memcmp(vendor, "AuthenticAMD", 12) == 0;
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx512_bf16 = f.avx512 && (a & (1u << 5));
  f.fast_avx512_bf16 = f.avx512_bf16 && amd;
#endif
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect_features();
  return f;
}

const KernelTable* available(Isa isa) {
  const CpuFeatures& f = features();
  switch (isa) {
    case Isa::Scalar: return table_scalar();
    case Isa::Avx2: return f.avx2 ? table_avx2() : nullptr;
    case Isa::Avx512: return f.avx512 ? table_avx512() : nullptr;
  }
  return nullptr;
}

Isa best_available() {
  if (available(Isa::Avx512)) return Isa::Avx512;
  if (available(Isa::Avx2)) return Isa::Avx2;
  return Isa::Scalar;
}

// Throws (isa_from_env) while MARKBASE_CPU_ISA holds a value it cannot honour; a static local whose
// initialiser throws is tried again at the next call, so every call reports the same error.
std::atomic<const KernelTable*>& active_slot() {
  static std::atomic<const KernelTable*> slot{available(isa_from_env(std::getenv("MARKBASE_CPU_ISA")))};
  return slot;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

const KernelTable* table_scalar() { return &kScalar; }

const KernelTable& kernels() { return *active_slot().load(std::memory_order_relaxed); }
const KernelTable* kernels_for(Isa isa) { return available(isa); }
Isa best_isa() { return best_available(); }

// A value that cannot be honoured is an error, not a warning and a fallback: a run on other
// kernels than the ones asked for would be measured or debugged under the wrong name, and an
// mb::Error reaches the user through the caller's error path (the CLI prints it, exit 1) without
// the library printing anything.
Isa isa_from_env(const char* value) {
  if (!value || !*value) return best_available();
  std::string s(value);
  for (auto& ch : s) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  Isa want;
  if (s == "scalar") want = Isa::Scalar;
  else if (s == "avx2") want = Isa::Avx2;
  else if (s == "avx512") want = Isa::Avx512;
  else fail("MARKBASE_CPU_ISA={} is not one of scalar, avx2, avx512 (unset: the best this CPU runs, {})", value,
            isa_name(best_available()));
  MB_CHECK(available(want) != nullptr,
           "MARKBASE_CPU_ISA={}: this CPU or build cannot run the {} kernels (the best it runs: {})", value,
           isa_name(want), isa_name(best_available()));
  return want;
}

Isa set_isa(Isa isa) {
  const KernelTable* t = available(isa);
  MB_CHECK(t != nullptr, "the {} kernels are not available on this CPU/build", isa_name(isa));
  return active_slot().exchange(t)->isa;
}

bool cpu_has_avx512_vnni() { return features().avx512_vnni; }

Scratch::~Scratch() { std::free(p_); }

void* Scratch::bytes(size_t n) {
  if (n > cap_ || !p_) {
    std::free(p_);
    cap_ = (std::max(n, cap_ + cap_ / 2) + 63) / 64 * 64;
    p_ = std::aligned_alloc(64, std::max<size_t>(64, cap_));
    MB_CHECK(p_ != nullptr, "out of memory for {} bytes of kernel scratch", cap_);
  }
  return p_;
}

float* Scratch::floats(size_t n) { return static_cast<float*>(bytes(n * sizeof(float))); }

namespace {
// Linux hands out the 8 KB tile state only to processes that ask (arch_prctl
// ARCH_REQ_XCOMP_PERM); until then the first tile instruction faults. Asked once per process.
bool request_amx_permission() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (const char* env = std::getenv("MARKBASE_AMX"); env && std::string(env) == "0") return false;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
bool amx_permitted() {
  static const bool ok = (features().amx_int8 || features().amx_bf16) && request_amx_permission();
  return ok;
}
}  // namespace

bool cpu_amx_int8_ready() { return features().amx_int8 && amx_permitted(); }
bool cpu_amx_bf16_ready() { return features().amx_bf16 && amx_permitted(); }

namespace {
std::atomic<bool> g_amx_bf16_on{true};
}  // namespace

bool amx_bf16_matmul_active() {
  return g_amx_bf16_on.load(std::memory_order_relaxed) && kernels().isa == Isa::Avx512 && amx_bf16_kernels() &&
         cpu_amx_bf16_ready();
}

bool set_amx_bf16_matmul(bool on) { return g_amx_bf16_on.exchange(on); }

namespace {
std::atomic<bool> g_bf16_dot_on{features().fast_avx512_bf16};
}  // namespace

bool set_avx512_bf16_matmul(bool on) { return g_bf16_dot_on.exchange(on); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "?";
}

bool is_kernel_weight_dtype(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

WType wtype(DType t) {
  switch (t) {
    case DType::F32: return WType::F32;
    case DType::BF16: return WType::BF16;
    case DType::F16: return WType::F16;
    default: fail("cpu kernels: weight dtype {} is not F32, BF16 or F16", dtype_name(t));
  }
}

namespace {

template <DType T> void dequant_as(const void* src, float* dst, int64_t n) { dequantize_row(T, src, dst, n); }

using DequantFn = void (*)(const void*, float*, int64_t);
DequantFn dequant_fn(DType t) {
  switch (t) {
    case DType::Q8_0: return dequant_as<DType::Q8_0>;
    case DType::Q4_0: return dequant_as<DType::Q4_0>;
    case DType::Q4_1: return dequant_as<DType::Q4_1>;
    case DType::Q5_0: return dequant_as<DType::Q5_0>;
    case DType::Q5_1: return dequant_as<DType::Q5_1>;
    case DType::Q4_K: return dequant_as<DType::Q4_K>;
    case DType::Q5_K: return dequant_as<DType::Q5_K>;
    case DType::Q6_K: return dequant_as<DType::Q6_K>;
    default: fail("cpu kernels: no dequantizer for {}", dtype_name(t));
  }
}

// bf16 weights times many tokens on bf16 products (bf16_gemm.h says why): the activations are
// split or rounded and packed once, then tasks of whole row steps run over every token.
void matmul_bf16_products(const Bf16GemmKernels& G, const MatArgs& a) {
  ThreadPool& pool = ThreadPool::global();
  thread_local Scratch xp_buf;
  uint16_t* xp = static_cast<uint16_t*>(xp_buf.bytes(G.xp_bytes(a.n, a.k)));
  const int64_t tiles = ceil_div(a.n, G.tile_tokens);
  pool.parallel_for(tiles, std::max<int64_t>(1, (int64_t(1) << 15) / (G.tile_tokens * a.k)),
                    [&](int64_t b, int64_t e) { G.pack_x(a, xp, b, e); });
  const int64_t step = G.row_step, threads = pool.size();
  int64_t blk = G.task_rows(a.k), tok_blk = a.n;
  if (ceil_div(a.m, blk) < 2 * threads) {
    // Too few row chunks for the threads. Thinner chunks would each stream every token's packed
    // activations (a ViT's 768 rows on 16 threads: 24 tasks of 32 rows, each reading all 2,520
    // tokens), so tokens are split too, into runs of whole token-tile pairs, while each run keeps
    // at least 64 tokens: a task's activations and its weight chunk then fit in L2.
    const int64_t chunks = ceil_div(a.m, blk), pair = 2 * int64_t(G.tile_tokens);
    const int64_t runs = std::min(ceil_div(2 * threads, chunks), std::max<int64_t>(1, a.n / 64));
    if (runs > 1) {
      blk = ceil_div(ceil_div(a.m, chunks), step) * step;  // the row chunks evened out
      tok_blk = ceil_div(ceil_div(a.n, runs), pair) * pair;
      // Runs are whole pairs of token tiles: shorten them while that leaves threads without a task.
      while (ceil_div(a.n, tok_blk) * chunks < 2 * threads && tok_blk - pair >= std::max<int64_t>(64, pair))
        tok_blk -= pair;
    } else {
      blk = std::max<int64_t>(step, ceil_div(ceil_div(a.m, 2 * threads), step) * step);
    }
  }
  // Task i: row chunk i / tok_tasks, token run i % tok_tasks (a thread's consecutive tasks share a chunk).
  const int64_t row_tasks = ceil_div(a.m, blk), tok_tasks = ceil_div(a.n, tok_blk), tasks = row_tasks * tok_tasks;
  const size_t tile_bytes = G.xp_bytes(G.tile_tokens, a.k);
  const double flops = 2.0 * double(a.n) * double(a.k) * double(a.m);
  pool.parallel_for(tasks, flops < 4e6 ? tasks : 1, [&](int64_t b, int64_t e) {
    thread_local Scratch buf;
    void* scratch = buf.bytes(G.scratch_bytes(std::min(a.n, tok_blk), a.k));
    for (int64_t i = b; i < e;) {
      const int64_t r = i / tok_tasks, t0 = (i % tok_tasks) * tok_blk;
      if (tok_tasks == 1) {  // runs of whole chunks in one call
        const int64_t r_end = std::min(e, row_tasks);
        G.gemm(a, xp, r * blk, std::min(a.m, r_end * blk), scratch);
        i = r_end;
        continue;
      }
      // The token run as a problem of its own: the packed activations are whole tiles of tile_bytes.
      MatArgs run = a;
      run.n = std::min(a.n - t0, tok_blk);
      run.y = a.y + t0 * a.ldy;
      if (a.times) run.times = a.times + t0 * a.ldy;
      const uint16_t* run_xp = xp + size_t(t0 / G.tile_tokens) * tile_bytes / 2;
      G.gemm(run, run_xp, r * blk, std::min(a.m, (r + 1) * blk), scratch);
      ++i;
    }
  });
}

const Bf16GemmKernels* rounded_bf16_kernels() {
  if (amx_bf16_matmul_active()) return amx_bf16_rounded_kernels();
  if (kernels().isa == Isa::Avx512 && features().avx512_bf16 && g_bf16_dot_on.load(std::memory_order_relaxed))
    return avx512_bf16_rounded_kernels();
  return nullptr;
}

}  // namespace

const char* rounded_bf16_matmul_kernel() {
  const Bf16GemmKernels* G = rounded_bf16_kernels();
  return !G ? nullptr : G == amx_bf16_rounded_kernels() ? "amx" : "avx512bf16";
}

namespace {
void silu_epilogue(float* y, const float*, int64_t n) { kernels().silu(y, n); }
void gelu_tanh_times_epilogue(float* y, const float* times, int64_t n) { kernels().gelu_tanh_mul(y, times, y, n); }
}  // namespace

MatArgs::Epilogue epilogue_of(MatAct act) {
  return act == MatAct::Silu ? silu_epilogue : act == MatAct::GeluTanhTimes ? gelu_tanh_times_epilogue : nullptr;
}

bool matmul_blocks_supported(int64_t n) {
  const KernelTable& K = kernels();
  return K.gemm && n > K.gemv_max_tokens;
}

void matmul(const float* x, int64_t ldx, int64_t n, int64_t k, DType wt, const void* w, size_t w_stride,
            int64_t m, float* y, int64_t ldy, Bf16Products products, const MatClip* clip) {
  if (n <= 0 || m <= 0) return;
  if (k == 0) {
    const float y0 = clip ? std::min(std::max(0.f, clip->y_lo), clip->y_hi) : 0.f;
    for (int64_t t = 0; t < n; ++t) std::fill(y + t * ldy, y + t * ldy + m, y0);
    if (const auto epilogue = clip ? epilogue_of(clip->act) : nullptr)
      for (int64_t t = 0; t < n; ++t) epilogue(y + t * ldy, clip->times ? clip->times + t * ldy : nullptr, m);
    return;
  }
  const KernelTable& K = kernels();
  MatArgs a{x, ldx, n, k, m, w, WType::Block, w_stride, y, ldy};
  if (dtype_is_quantized(wt)) {
    MB_CHECK(matmul_blocks_supported(n), "cpu matmul: {} weights need the GEMM path ({} tokens)", dtype_name(wt), n);
    a.dequant = dequant_fn(wt);
    a.block = dtype_block_size(wt);
    a.block_bytes = dtype_block_bytes(wt);
  } else {
    a.wt = wtype(wt);
  }
  if (clip) {
    a.x_lo = clip->x_lo;
    a.x_hi = clip->x_hi;
    a.y_lo = clip->y_lo;
    a.y_hi = clip->y_hi;
    a.epilogue = epilogue_of(clip->act);
    a.times = clip->times;
  }
  if (a.wt == WType::BF16 && n >= kAmxMinTokens && products != Bf16Products::FmaChain) {
    const Bf16GemmKernels* G = products == Bf16Products::Rounded ? rounded_bf16_kernels() : nullptr;
    if (!G && amx_bf16_matmul_active()) G = amx_bf16_kernels();
    if (G && (!clip || G->clips)) return matmul_bf16_products(*G, a);
  }
  ThreadPool& pool = ThreadPool::global();
  if (clip) {
    // Kernels without bounds: x clamped into a copy first, y clamped after.
    thread_local Scratch xc_buf;
    float* xc = xc_buf.floats(size_t(n * k));  // the workers' thread_locals are others: pass the pointer
    pool.parallel_for(n, std::max<int64_t>(1, 4096 / k), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t i = 0; i < k; ++i) xc[t * k + i] = std::min(std::max(x[t * ldx + i], clip->x_lo), clip->x_hi);
    });
    matmul(xc, k, n, k, wt, w, w_stride, m, y, ldy, products);
    pool.parallel_for(n, std::max<int64_t>(1, 4096 / m), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        for (float *p = y + t * ldy, *end = p + m; p < end; ++p) *p = std::min(std::max(*p, clip->y_lo), clip->y_hi);
        if (a.epilogue) a.epilogue(y + t * ldy, a.times ? a.times + t * ldy : nullptr, m);
      }
    });
    return;
  }
  if (!K.gemm || n <= K.gemv_max_tokens) {
    const int64_t row_bytes = k * int64_t(wsize(a.wt));
    // Chunks of whole 16-row groups worth at least 64 KB of weights x tokens (up to 8): smaller
    // matmuls stay on the calling thread, where a wake-up would cost more than the work.
    constexpr int64_t unit = 16;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (unit * row_bytes * std::min<int64_t>(n, 8)));
    pool.parallel_for(ceil_div(m, unit), grain, [&](int64_t b, int64_t e) {
      K.gemv(a, b * unit, std::min(m, e * unit));
    });
    return;
  }
  thread_local Scratch xp_buf;
  float* xp = xp_buf.floats(K.gemm_xp_floats(n, k));
  const int64_t tiles = ceil_div(n, K.gemm_tile_tokens);
  pool.parallel_for(tiles, std::max<int64_t>(1, (int64_t(1) << 15) / (K.gemm_tile_tokens * k)),
                    [&](int64_t b, int64_t e) { K.gemm_pack_x(a, xp, b, e); });
  // Row tasks of gemm_row_block rows, smaller (whole register tiles) when that leaves fewer than
  // two tasks per thread.
  const int64_t R = K.gemm_rows, threads = pool.size();
  int64_t blk = K.gemm_row_block;
  if (ceil_div(m, blk) < 2 * threads) blk = std::max<int64_t>(R, ceil_div(ceil_div(m, 2 * threads), R) * R);
  const int64_t tasks = ceil_div(m, blk);
  const double flops = 2.0 * double(n) * double(k) * double(m);
  pool.parallel_for(tasks, flops < 4e6 ? tasks : 1, [&](int64_t b, int64_t e) {
    thread_local Scratch buf;
    float* scratch = buf.floats(K.gemm_scratch_floats(n, k));
    K.gemm(a, xp, b * blk, std::min(m, e * blk), scratch);
  });
}

void attention(const AttnArgs& a) { attention(&a, 1); }

bool attention_whole_rounded(const AttnArgs& a) {
  constexpr int64_t kMinQueries = 64, kMinKeys = 256;
  // Queries a task: their scores (kQueries x keys f32) and packed probabilities stay in L2.
  constexpr int64_t kQueries = 64;
  const Bf16GemmKernels* G = rounded_bf16_kernels();
  if (!G || a.pages || a.ring || a.window > 0 || a.softcap > 0.f || a.part || a.key_begin != 0 ||
      a.key_end != INT64_MAX || a.n < kMinQueries || !(a.scale > 0.f))
    return false;
  const int64_t last = attn_last_key(a, 0), keys = last + 1;
  if (keys < kMinKeys || keys > a.capacity) return false;
  for (int64_t t = 1; t < a.n; ++t)
    if (attn_last_key(a, t) != last) return false;
  const int64_t nh = a.nh, nkv = a.nkv, hd = a.hd, group = nh / nkv;
  ThreadPool& pool = ThreadPool::global();
  if (const RoundedAttentionKernels* R = G == amx_bf16_rounded_kernels() ? amx_rounded_attention_kernels() : nullptr) {
    thread_local Scratch kv_buf;
    const size_t head_bytes = R->kv_bytes(keys, hd);
    uint8_t* kv = static_cast<uint8_t*>(kv_buf.bytes(head_bytes * size_t(nkv)));
    constexpr int64_t kPackBlocks = 8;  // 256 keys a task
    const int64_t key_blocks = ceil_div(keys, 32), pack_tasks = ceil_div(key_blocks, kPackBlocks);
    pool.parallel_for(nkv * pack_tasks, 1, [&](int64_t b, int64_t e) {
      for (int64_t task = b; task < e; ++task) {
        const int64_t g = task / pack_tasks, b0 = task % pack_tasks * kPackBlocks;
        R->pack_kv(a.k + g * hd, a.v + g * hd, nkv * hd, keys, hd, b0, std::min(key_blocks, b0 + kPackBlocks),
                   reinterpret_cast<uint16_t*>(kv + size_t(g) * head_bytes));
      }
    });
    // Head-major: neighbouring tasks share a head's packed keys and values in cache.
    const int64_t blocks = ceil_div(a.n, R->queries);
    pool.parallel_for(nh * blocks, 1, [&](int64_t b, int64_t e) {
      thread_local Scratch buf;
      void* scratch = buf.bytes(R->scratch_bytes(keys, hd));
      for (int64_t task = b; task < e; ++task) {
        const int64_t h = task / blocks, t0 = task % blocks * R->queries;
        const size_t row = size_t((t0 * nh + h) * hd);
        R->block(a.q + row, nh * hd, std::min(R->queries, a.n - t0), keys, hd, a.scale,
                 reinterpret_cast<const uint16_t*>(kv + size_t(h / group) * head_bytes), a.out + row, nh * hd,
                 scratch);
      }
    });
    return true;
  }
  // Each KV head's keys [keys][hd] and values transposed [hd][keys] in bf16: the GEMMs' weights.
  thread_local Scratch kv_buf;
  uint16_t* kb = static_cast<uint16_t*>(kv_buf.bytes(size_t(2 * nkv * keys * hd) * 2));
  uint16_t* vt = kb + nkv * keys * hd;
  constexpr int64_t kKeyBlock = 256;
  const int64_t key_blocks = ceil_div(keys, kKeyBlock);
  pool.parallel_for(nkv * key_blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; ++task) {
      const int64_t g = task / key_blocks, j0 = task % key_blocks * kKeyBlock, j1 = std::min(keys, j0 + kKeyBlock);
      for (int64_t j = j0; j < j1; ++j) {
        const float* k = a.k + (j * nkv + g) * hd;
        const float* v = a.v + (j * nkv + g) * hd;
        uint16_t* kr = kb + (g * keys + j) * hd;
        for (int64_t d = 0; d < hd; ++d) {
          kr[d] = f32_to_bf16(k[d]);
          vt[(g * hd + d) * keys + j] = f32_to_bf16(v[d]);
        }
      }
    }
  });
  const KernelTable& K = kernels();
  const int64_t blocks = ceil_div(a.n, kQueries);
  pool.parallel_for(nh * blocks, 1, [&](int64_t b, int64_t e) {
    thread_local Scratch s_buf, xp_buf, gemm_buf;
    for (int64_t task = b; task < e; ++task) {
      const int64_t h = task % nh, t0 = task / nh * kQueries, n = std::min(kQueries, a.n - t0), g = h / group;
      float* s = s_buf.floats(size_t(kQueries * keys + kQueries));
      void* scratch = gemm_buf.bytes(std::max(G->scratch_bytes(kQueries, hd), G->scratch_bytes(kQueries, keys)));
      const size_t row = size_t((t0 * nh + h) * hd);
      const MatArgs qk{a.q + row, nh * hd, n, hd, keys, kb + g * keys * hd, WType::BF16, size_t(hd) * 2, s, keys};
      uint16_t* xp = static_cast<uint16_t*>(xp_buf.bytes(std::max(G->xp_bytes(kQueries, hd), G->xp_bytes(kQueries, keys))));
      G->pack_x(qk, xp, 0, ceil_div(n, G->tile_tokens));
      G->gemm(qk, xp, 0, keys, scratch);
      // P's numerators go to bf16 and the sums divide the products after, as torch's CPU flash
      // attention does on bf16 tensors.
      float* inv = s + kQueries * keys;
      for (int64_t i = 0; i < n; ++i) inv[i] = 1.f / K.exp_sum_row(s + i * keys, keys, a.scale);
      const MatArgs pv{s, keys, n, keys, hd, vt + g * hd * keys, WType::BF16, size_t(keys) * 2, a.out + row, nh * hd};
      G->pack_x(pv, xp, 0, ceil_div(n, G->tile_tokens));
      G->gemm(pv, xp, 0, hd, scratch);
      for (int64_t i = 0; i < n; ++i)
        for (float *o = a.out + row + i * nh * hd, *e = o + hd; o < e; ++o) *o *= inv[i];
    }
  });
  return true;
}

void attention(const AttnArgs* seqs, int64_t n_seqs) {
  const KernelTable& K = kernels();
  ThreadPool& pool = ThreadPool::global();
  const int64_t threads = pool.size();
  // Tasks: (sequence, KV head, block of up to 16 tokens, slice of the group's heads, key split),
  // all sequences in one region: a decode batch's sequences are one token each, and a region per
  // sequence costs more in hand-offs than its attention. When that leaves fewer tasks than
  // threads (decode), keys are split first (flash decoding: each task reads a share of the cache
  // instead of all of it, merged after the region), then heads (each slice reads the same keys).
  auto span_of = [](const AttnArgs& a, int64_t& lo, int64_t& hi) {
    lo = INT64_MAX;
    hi = -1;
    for (int64_t t = 0; t < a.n; ++t) {
      lo = std::min<int64_t>(lo, a.window > 0 ? std::max<int64_t>(0, int64_t(a.pos[t]) - a.window + 1) : 0);
      hi = std::max<int64_t>(hi, attn_last_key(a, t));
    }
  };
  struct Plan {
    int64_t tb = 1, ntb = 0, group = 1, lo = 0, hi = -1, split0 = 0, nsplit = 1, hs = 1, nslice = 1, first = 0;
    float* part = nullptr;
  };
  std::vector<Plan> plans(static_cast<size_t>(n_seqs));
  int64_t base = 0, max_group = 1;
  double flops = 0;
  for (int64_t i = 0; i < n_seqs; ++i) {
    const AttnArgs& a = seqs[i];
    Plan& pl = plans[size_t(i)];
    if (a.n <= 0 || a.nh <= 0) continue;
    // Tokens a task takes: 16, or more while a task's rows (tokens x the group's heads) stay within
    // 8K floats of head dims and every thread keeps two tasks: a larger tile transposes each key
    // block once for more rows (an image's 2,520 patches in 12 single-head groups of 64: 206 -> 158
    // ms a layer on 2 Zen 4 cores at 128 tokens). Rows are computed alone, so the bits do not change.
    int64_t tb = 16;
    while (tb * 2 * (a.nh / a.nkv) * a.hd <= 8192 && ceil_div(a.n, 2 * tb) * a.nkv >= 2 * threads) tb *= 2;
    pl.tb = std::min<int64_t>(a.n, tb);
    pl.ntb = ceil_div(a.n, pl.tb);
    pl.group = a.nh / a.nkv;
    max_group = std::max(max_group, pl.group);
    base += a.nkv * pl.ntb;
    span_of(a, pl.lo, pl.hi);
    flops += 4.0 * double(a.n) * double(a.nh) * double(std::max<int64_t>(pl.hi - pl.lo + 1, 1)) * double(a.hd);
  }
  if (base == 0) return;
  // Split tasks only for a few tokens per sequence (decode, a short verification block): their
  // partials take nsplit x tokens x heads x (hd + 2) floats, 17 MB for one token at 128k keys.
  bool split_keys = base < threads && K.attn_merge != nullptr;
  for (int64_t i = 0; i < n_seqs && split_keys; ++i) split_keys = seqs[i].n <= 4;
  int64_t tasks = 0;
  for (int64_t i = 0; i < n_seqs; ++i) {
    const AttnArgs& a = seqs[i];
    Plan& pl = plans[size_t(i)];
    if (pl.ntb == 0) continue;
    if (split_keys) {
      pl.split0 = pl.lo / kAttnSplit * kAttnSplit;
      pl.nsplit = pl.hi / kAttnSplit - pl.lo / kAttnSplit + 1;
    }
    tasks += a.nkv * pl.ntb * pl.nsplit;
  }
  int64_t hsplit = 1;
  while (tasks * hsplit < threads && hsplit < max_group) ++hsplit;
  thread_local std::vector<float> parts;  // split partials of the sequences that have several
  size_t part_floats = 0;
  tasks = 0;
  for (int64_t i = 0; i < n_seqs; ++i) {
    const AttnArgs& a = seqs[i];
    Plan& pl = plans[size_t(i)];
    pl.first = tasks;
    if (pl.ntb == 0) continue;
    pl.hs = ceil_div(pl.group, std::min(hsplit, pl.group));
    pl.nslice = ceil_div(pl.group, pl.hs);
    tasks += a.nkv * pl.ntb * pl.nslice * pl.nsplit;
    if (pl.nsplit > 1) part_floats += size_t(pl.nsplit * a.n * a.nh * (a.hd + 2));
  }
  parts.resize(part_floats);
  for (size_t off = 0, i = 0; i < size_t(n_seqs); ++i)
    if (plans[i].nsplit > 1) {
      plans[i].part = parts.data() + off;
      off += size_t(plans[i].nsplit * seqs[i].n * seqs[i].nh * (seqs[i].hd + 2));
    }
  // Tasks are merged into chunks of >= 2e5 flops only when there are plenty of them: a decode
  // call's few tasks (one head slice of a short context each) would otherwise land on two or three
  // threads, each also transposing the same keys once per task it was given.
  const int64_t grain = tasks <= 4 * threads ? 1 : std::max<int64_t>(1, int64_t(2e5 / (flops / double(tasks))));
  // A decode step's keys and values were written steps ago and the weights streamed since have
  // evicted them: fetched on demand they were most of attention's time. One sequence's key
  // splits go to the region before (ThreadPool::ahead_after), for the workers to fetch while the
  // caller normalises, rotates and stores this step's q/k/v; task j reads split j % nsplit. Whole
  // rows: with several KV heads a task fetches its neighbours' too (the budget bounds it).
  const ThreadPool::Ahead* ahead = nullptr;
  // Paged keys qualify when their pages lie in order in the pool (a lone sequence's usually do).
  auto rows_in_order = [](const AttnArgs& a, int64_t lo, int64_t hi) {
    if (!a.pages) return true;
    for (int64_t p = lo / a.page_size; p < hi / a.page_size; ++p)
      if (a.pages[p + 1] != a.pages[p] + 1) return false;
    return true;
  };
  if (split_keys && n_seqs == 1 && plans[0].ntb > 0 &&
      rows_in_order(seqs[0], plans[0].split0, plans[0].hi)) {
    const AttnArgs& a = seqs[0];
    const Plan& pl = plans[0];
    ThreadPool::Ahead self;
    self.n = tasks;
    self.grain = grain;
    self.budget = 2 * ThreadPool::ahead_budget();  // a split's K and V: 128 KB at hd 256, 256 KB at 512
    const size_t split_bytes = size_t(kAttnSplit * a.nkv * a.hd) * sizeof(float);
    const int64_t first_slot = kv_row(a, pl.split0);
    for (const float* base : {a.k, a.v})
      self.s[self.streams++] = {base + first_slot * a.nkv * a.hd, 0, int32_t(tasks), split_bytes, int32_t(pl.nsplit)};
    ahead = ThreadPool::ahead_after(nullptr, self);
  }
  pool.parallel_for(tasks, grain, [&](int64_t b, int64_t e) {
    thread_local Scratch buf;
    size_t i = 0;
    for (int64_t task = b; task < e; ++task) {
      while (i + 1 < plans.size() && task >= plans[i + 1].first) ++i;  // skips sequences without tasks
      const Plan& pl = plans[i];
      AttnArgs a = seqs[i];
      // task -> (KV head, token block, head slice, key split), split fastest.
      int64_t local = task - pl.first;
      const int64_t split = local % pl.nsplit;
      local /= pl.nsplit;
      const int64_t slice = local % pl.nslice;
      local /= pl.nslice;
      const int64_t blk = local % pl.ntb, g = local / pl.ntb;
      const int64_t t0 = blk * pl.tb, t1 = std::min(a.n, t0 + pl.tb);
      const int64_t h0 = g * pl.group + slice * pl.hs, h1 = std::min(h0 + pl.hs, (g + 1) * pl.group);
      if (h0 >= h1) continue;
      if (pl.nsplit > 1) {
        a.key_begin = pl.split0 + split * kAttnSplit;
        a.key_end = a.key_begin + kAttnSplit;
        a.part = pl.part + size_t(split * a.n * a.nh * (a.hd + 2));
      }
      float* scratch = buf.floats(std::max<size_t>(16, K.attn_scratch_floats((t1 - t0) * (h1 - h0), a.hd)));
      K.attention(a, t0, t1, h0, h1, scratch);
      // Decode: the caller merges the splits (or the output projection reads the rows) next.
      if (a.n <= kDemoteTokens)
        for (int64_t t = t0; t < t1; ++t) {
          if (a.part) demote_to_shared_cache(a.part + (t * a.nh + h0) * (a.hd + 2), size_t((h1 - h0) * (a.hd + 2)) * 4);
          else demote_to_shared_cache(a.out + (t * a.nh + h0) * a.hd, size_t((h1 - h0) * a.hd) * 4);
        }
    }
  }, ahead);
  for (size_t i = 0; i < size_t(n_seqs); ++i) {
    const Plan& pl = plans[i];
    if (pl.nsplit <= 1) continue;
    const AttnArgs& a = seqs[i];
    const size_t stride = size_t(a.n * a.nh * (a.hd + 2));
    for (int64_t r = 0; r < a.n * a.nh; ++r)
      K.attn_merge(pl.part + size_t(r * (a.hd + 2)), pl.nsplit, stride, a.hd, a.out + r * a.hd);
  }
}

void gelu_tanh_mul(const float* g, const float* u, float* out, int64_t n) {
  const KernelTable& K = kernels();
  // An exp and a few fmas an element: a decode step's 12288-wide FFN is worth splitting on many
  // cores (the kernel's tail takes the same vector path, so the split does not change a bit).
  ThreadPool::global().parallel_for(n, 1 << 12, [&](int64_t b, int64_t e) {
    K.gelu_tanh_mul(g + b, u + b, out + b, e - b);
  });
}

float dot_f32(const float* a, const float* b, int64_t n) { return kernels().dot(a, b, n); }
void to_f32(DType dtype, const void* src, float* dst, int64_t n) { kernels().to_f32(wtype(dtype), src, dst, n); }
void axpy(float a, const float* x, float* y, int64_t n) { kernels().axpy(a, x, y, n); }
float sum_f32(const float* x, int64_t n) { return kernels().sum(x, n); }

double read_pass_seconds(const float* x, int64_t n, bool prefetch) {
  ThreadPool& pool = ThreadPool::global();
  std::vector<float> sinks(size_t(pool.size()) * 16);  // a cache line apart
  constexpr int64_t kPiece = 1024, kAhead = 512;        // floats: 4 KB a call, 2 KB ahead
  const KernelTable& K = kernels();  // on the caller: its error, if any, is the caller's
  const auto t0 = std::chrono::steady_clock::now();
  pool.run_on_all([&](int t, int nt) {
    const int64_t per = (n / nt + 15) / 16 * 16, b = std::min(n, per * t), e = std::min(n, b + per);
    float acc = 0.f;
    if (!prefetch) acc = K.sum(x + b, e - b);
    for (int64_t i = b; prefetch && i < e; i += kPiece) {
      for (int64_t j = 0; j < kPiece; j += 16) __builtin_prefetch(x + std::min(e - 1, i + kAhead + j));
      acc += K.sum(x + i, std::min(kPiece, e - i));
    }
    sinks[size_t(t) * 16] = acc;
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float keep = sinks[0];
  (void)keep;
  return s;
}

ReadBandwidth read_bandwidth(const float* x, int64_t n, int passes) {
  std::vector<double> rates;
  for (int rep = 0; rep < 2 * passes; ++rep) rates.push_back(double(n) * 4.0 / read_pass_seconds(x, n, rep % 2 == 1));
  return {*std::max_element(rates.begin(), rates.end()), median(rates)};
}
float gelu_tanh(float x) { return gelu_tanh_scalar(x); }

void softcap(float* x, int64_t n, float cap) {
  const KernelTable& K = kernels();
  ThreadPool::global().parallel_for(n, 1 << 14, [&](int64_t b, int64_t e) { K.softcap(x + b, e - b, cap); });
}

float dot_f32_ref(const float* a, const float* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(a[i]) * b[i];
  return float(s);
}

void matmul_ref(const float* x, int64_t n, int64_t k, DType wt, const void* w, int64_t m, float* y) {
  std::vector<float> row(static_cast<size_t>(k));
  const bool blocks = dtype_is_quantized(wt);
  const size_t stride = blocks ? dtype_row_bytes(wt, k) : size_t(k) * wsize(wtype(wt));
  for (int64_t r = 0; r < m; ++r) {
    const uint8_t* src = static_cast<const uint8_t*>(w) + size_t(r) * stride;
    if (blocks) dequantize_row(wt, src, row.data(), k);
    else s_to_f32(wtype(wt), src, row.data(), k);
    for (int64_t t = 0; t < n; ++t) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc = std::fma(x[t * k + i], row[size_t(i)], acc);
      y[t * m + r] = acc;
    }
  }
}

}  // namespace mb::cpu
