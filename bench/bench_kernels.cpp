// CPU kernel microbenchmarks, one entry per kernel path the CPU runs (scalar, avx2, avx512), all
// threads of the global pool:
//   Gemv/<isa>/<dtype>/n:<tokens>  decode matmul on 8192 x 2048 weights; bytes_per_second counts
//                                  weight bytes, `of_membw` is that over the read bandwidth
//                                  measured as `markbase bench --membw` does (MemBw/plain and
//                                  MemBw/prefetch: its two read loops over 1 GiB)
//   Gemm/<isa>/<dtype>/n:<tokens>  prefill matmul 6144 x 1536; GFLOPS = 2 n k m per second
//   Gemm/avx512-amx/BF16/...       the same bf16 matmuls on AMX tiles (where the CPU runs them);
//                                  Gemm/avx512/BF16 is the f32 GEMM with AMX turned off
//   Gemm/rounded-<kernel>/BF16/... the same on activations rounded to bf16 (Bf16Products::Rounded):
//                                  AMX tiles, or VDPBF16PS with AMX off (where the CPU runs it,
//                                  which the engine takes only where it is fast); .../vit<m>x<k>: an
//                                  E4B image's ViT matmuls, 2520 patches
//   GemmCold/rounded-<kernel>/...  the ViT's and an E4B clip's conformer matmuls (750 frames) with
//                                  weights rotated through 1 GiB, cold as a model's layers are
//   Attention/<isa>/...            one layer's attention, 8 query heads on 1 KV head of 256 dims
//                                  (vision2520: an image's 2520 patches, 12 heads of 64; rounded-<kernel>:
//                                  on the rounded bf16 products, cpu::attention_whole_rounded)
//   QMatmul/<dtype>/n:<tokens>     integer matmul of packed block-quantized 8192 x 2048 weights
//                                  (AVX-512 VNNI or AVX2); bytes are the packed weight bytes
//   QMatmulInCache/<dtype>/n:<t>   the same kernel on one cache-resident 512 x 2048 matrix, one
//                                  thread: its arithmetic rate (GMACS) without memory in the way
//   QMatmul/<dtype>/n:1/<m>x<k>    one decode matmul of an E2B layer's shape, through the pool;
//                                  QMatmulHot/...: the same matrix each time, from the caches
//   GatedFfn/<dtype>/fused|ops     one token through E2B's gated FFN: the backend's fused op, or
//                                  its ops one after the other
//   ParallelFor/<n>                cost of one near-empty region of the thread pool
// Weight sets rotate through more than 1 GiB so the GEMV reads memory, not the last-level cache.
//
//   ./build/bench/markbase_bench --benchmark_filter='Gemv|MemBw' --benchmark_repetitions=3
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/qmatmul.h"
#include "core/mmap.h"
#include "core/quant.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace {

using mb::DType;
using mb::cpu::Isa;

constexpr size_t kRotateBytes = size_t(1) << 30;

double g_membw_bytes_per_s = 0;

struct IsaScope {
  Isa prev;
  explicit IsaScope(Isa i) : prev(mb::cpu::set_isa(i)) {}
  ~IsaScope() { mb::cpu::set_isa(prev); }
};

struct AmxScope {
  bool prev;
  explicit AmxScope(bool on) : prev(mb::cpu::set_amx_bf16_matmul(on)) {}
  ~AmxScope() { mb::cpu::set_amx_bf16_matmul(prev); }
};
// Bf16Products::Rounded's VDPBF16PS kernel on or off (on by default only where it is fast).
struct DotScope {
  bool prev;
  explicit DotScope(bool on) : prev(mb::cpu::set_avx512_bf16_matmul(on)) {}
  ~DotScope() { mb::cpu::set_avx512_bf16_matmul(prev); }
};

mb::Tensor random_tensor(DType dt, std::vector<int64_t> shape, uint32_t seed) {
  mb::Tensor t = mb::host_tensor(dt, std::move(shape));
  const int64_t n = t.numel();
  mb::ThreadPool::global().parallel_for(n, 1 << 16, [&](int64_t b, int64_t e) {
    std::mt19937 rng(seed + uint32_t(b));
    std::normal_distribution<float> nd;
    for (int64_t i = b; i < e; ++i) {
      const float f = nd(rng);
      if (dt == DType::F32) t.f32()[i] = f;
      else t.ptr<uint16_t>()[i] = dt == DType::BF16 ? mb::f32_to_bf16(f) : mb::f32_to_f16(f);
    }
  });
  return t;
}

// The rows of a random [m, k] matrix quantized to the block type dt, as a file holds them.
std::vector<uint8_t> random_quantized(DType dt, int64_t m, int64_t k, uint32_t seed) {
  mb::Tensor f = random_tensor(DType::F32, {m, k}, seed);
  const size_t rb = mb::dtype_row_bytes(dt, k);
  std::vector<uint8_t> q(rb * size_t(m));
  mb::ThreadPool::global().parallel_for(m, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) mb::quantize_row(dt, f.f32() + r * k, q.data() + size_t(r) * rb, k);
  });
  return q;
}

// kRotateBytes allocated like packed weights (huge pages where offered), as `markbase bench
// --membw` does.
const float* membw_buffer() {
  static std::shared_ptr<uint8_t> mem = [] {
    std::shared_ptr<uint8_t> m = mb::alloc_streamed(kRotateBytes);
    std::memset(m.get(), 0, kRotateBytes);
    return m;
  }();
  return reinterpret_cast<const float*>(mem.get());
}

void MemBw(benchmark::State& state, bool prefetch) {
  const float* buf = membw_buffer();
  for (auto _ : state) state.SetIterationTime(mb::cpu::read_pass_seconds(buf, int64_t(kRotateBytes / 4), prefetch));
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(kRotateBytes));
}

// Rotating weight sets of m x k in `dt`, at least kRotateBytes in all.
struct WeightSet {
  std::vector<mb::Tensor> mats;
  size_t next = 0;
  const mb::Tensor& take() { return mats[next++ % mats.size()]; }
};
WeightSet& weights(DType dt, int64_t m, int64_t k, bool rotate) {
  static std::vector<std::pair<std::string, std::unique_ptr<WeightSet>>> cache;
  const std::string key = std::string(mb::dtype_name(dt)) + std::to_string(m) + "x" + std::to_string(k) + (rotate ? "r" : "");
  for (auto& [k2, ws] : cache)
    if (k2 == key) return *ws;
  auto ws = std::make_unique<WeightSet>();
  const size_t bytes = size_t(m * k) * mb::dtype_size(dt);
  const size_t count = rotate ? std::max<size_t>(2, (kRotateBytes + bytes - 1) / bytes) : 1;
  for (size_t i = 0; i < count; ++i) ws->mats.push_back(random_tensor(dt, {m, k}, uint32_t(100 + i)));
  cache.emplace_back(key, std::move(ws));
  return *cache.back().second;
}

bool measure_membw();

// cold: the weights rotate through kRotateBytes of copies (as gemv's do) for a GEMM too.
void Matmul(benchmark::State& state, Isa isa, DType dt, int64_t n, int64_t m, int64_t k, bool gemv, bool amx = false,
            mb::cpu::Bf16Products products = mb::cpu::Bf16Products::Exact, bool cold = false) {
  if (gemv) {
    [[maybe_unused]] static const bool measured = measure_membw();
  }
  IsaScope scope(isa);
  AmxScope amx_scope(amx);
  WeightSet& ws = weights(dt, m, k, gemv || cold);
  mb::Tensor x = random_tensor(DType::F32, {n, k}, 7), y = mb::host_tensor(DType::F32, {n, m});
  const size_t wbytes = size_t(m * k) * mb::dtype_size(dt);
  for (auto _ : state) {
    const mb::Tensor& w = ws.take();
    mb::cpu::matmul(x.f32(), k, n, k, dt, w.data, size_t(k) * mb::dtype_size(dt), m, y.f32(), m, products);
    benchmark::DoNotOptimize(y.f32());
  }
  state.counters["GFLOPS"] =
      benchmark::Counter(2.0 * double(n) * double(m) * double(k) * 1e-9 * double(state.iterations()),
                         benchmark::Counter::kIsRate);
  if (gemv) {
    state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(wbytes));
    if (g_membw_bytes_per_s > 0)
      state.counters["of_membw"] = benchmark::Counter(double(wbytes) * double(state.iterations()) / g_membw_bytes_per_s,
                                                      benchmark::Counter::kIsRate);
  }
}

void Attention(benchmark::State& state, Isa isa, int64_t n, int64_t ctx, int window) {
  IsaScope scope(isa);
  const int64_t nh = 8, nkv = 1, hd = 256;
  const int64_t cap = window > 0 ? window - 1 + n : ctx;
  mb::Tensor k = random_tensor(DType::F32, {cap, nkv, hd}, 11), v = random_tensor(DType::F32, {cap, nkv, hd}, 12);
  mb::Tensor q = random_tensor(DType::F32, {n, nh, hd}, 13), o = mb::host_tensor(DType::F32, {n, nh, hd});
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) pos[size_t(t)] = int32_t(ctx - n + t);
  mb::cpu::AttnArgs a{q.f32(), o.f32(), k.f32(), v.f32(), pos.data(), n, nh, nkv, hd, cap, window > 0, nullptr, 0, window,
                      1.f, 0.f};
  double flops = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t keys = window > 0 ? std::min<int64_t>(window, pos[size_t(t)] + 1) : pos[size_t(t)] + 1;
    flops += 4.0 * double(nh) * double(keys) * double(hd);
  }
  for (auto _ : state) {
    mb::cpu::attention(a);
    benchmark::DoNotOptimize(o.f32());
  }
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9 * double(state.iterations()), benchmark::Counter::kIsRate);
}

// A vision encoder's attention: every query of an image sees every key of it (E4B's ViT: 12 heads
// of 64 over 2,520 patches for a 280-token image).
void EncoderAttention(benchmark::State& state, Isa isa, int64_t n, int64_t nh, int64_t hd, bool rounded = false) {
  IsaScope scope(isa);
  mb::Tensor k = random_tensor(DType::F32, {n, nh, hd}, 11), v = random_tensor(DType::F32, {n, nh, hd}, 12);
  mb::Tensor q = random_tensor(DType::F32, {n, nh, hd}, 13), o = mb::host_tensor(DType::F32, {n, nh, hd});
  std::vector<int32_t> pos(static_cast<size_t>(n), int32_t(n - 1)), last(static_cast<size_t>(n), int32_t(n - 1));
  mb::cpu::AttnArgs a{q.f32(), o.f32(), k.f32(), v.f32(), pos.data(), n, nh, nh, hd, n, false, nullptr, 0, 0,
                      1.f / 8, 0.f};
  a.last = last.data();
  for (auto _ : state) {
    if (!rounded) mb::cpu::attention(a);
    else if (!mb::cpu::attention_whole_rounded(a)) return state.SkipWithError("no rounded bf16 kernel here");
    benchmark::DoNotOptimize(o.f32());
  }
  const double flops = 4.0 * double(n) * double(n) * double(nh) * double(hd);
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9 * double(state.iterations()), benchmark::Counter::kIsRate);
}

// The kernel's arithmetic rate with its weights in cache: one thread, one 512 x 2048 matrix read
// over and over (no rotation), the kernel called directly on all groups. GMAC/s counts n·m·k.
void QMatmulInCache(benchmark::State& state, DType dt, int64_t n) {
  mb::cpu::QMatmulFn fn = mb::cpu::qmatmul_kernel();
  if (!fn) {
    state.SkipWithError("no integer kernel (AVX-512 VNNI or AVX2) on this CPU");
    return;
  }
  const int64_t m = 512, k = 2048;
  const std::vector<uint8_t> q = random_quantized(dt, m, k, 23);
  auto w = mb::cpu::qpack(dt, q.data(), m, k);
  mb::Tensor x = random_tensor(DType::F32, {n, k}, 7), y = mb::host_tensor(DType::F32, {n, m});
  mb::cpu::QActs acts;
  mb::cpu::quantize_acts(x.f32(), k, n, k, acts);
  for (auto _ : state) {
    fn(*w, acts, y.f32(), m, 0, w->groups, 0, n);
    benchmark::DoNotOptimize(y.f32());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(w->bytes()));
  state.counters["GMACS"] = benchmark::Counter(double(n * m * k) * 1e-9 * double(state.iterations()), benchmark::Counter::kIsRate);
}

void QMatmul(benchmark::State& state, DType dt, int64_t n, int64_t m, int64_t k, bool rotate = true) {
  [[maybe_unused]] static const bool measured = measure_membw();
  mb::cpu::QMatmulFn fn = mb::cpu::qmatmul_kernel();  // AMX where allowed (MARKBASE_AMX=0: VNNI)
  if (!fn) {
    state.SkipWithError("no integer kernel (AVX-512 VNNI or AVX2) on this CPU");
    return;
  }
  static std::vector<std::pair<std::string, std::vector<std::shared_ptr<const mb::cpu::QPacked>>>> cache;
  const std::string key = std::string(mb::dtype_name(dt)) + std::to_string(m) + "x" + std::to_string(k) + (rotate ? "" : "hot");
  std::vector<std::shared_ptr<const mb::cpu::QPacked>>* set = nullptr;
  for (auto& [k2, v] : cache)
    if (k2 == key) set = &v;
  if (!set) {
    const std::vector<uint8_t> q = random_quantized(dt, m, k, 21);
    cache.emplace_back(key, std::vector<std::shared_ptr<const mb::cpu::QPacked>>{});
    set = &cache.back().second;
    do set->push_back(mb::cpu::qpack(dt, q.data(), m, k));
    while (rotate && set->size() * set->front()->bytes() < kRotateBytes);
  }
  mb::Tensor x = random_tensor(DType::F32, {n, k}, 7), y = mb::host_tensor(DType::F32, {n, m});
  size_t next = 0;
  for (auto _ : state) {
    const mb::cpu::QPacked& w = *(*set)[next++ % set->size()];
    mb::cpu::qmatmul(fn, w, x.f32(), k, n, y.f32(), m);
    benchmark::DoNotOptimize(y.f32());
  }
  const double wbytes = double(set->front()->bytes());
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(wbytes));
  state.counters["GFLOPS"] = benchmark::Counter(2.0 * double(n * m * k) * 1e-9 * double(state.iterations()), benchmark::Counter::kIsRate);
  if (g_membw_bytes_per_s > 0)
    state.counters["of_membw"] = benchmark::Counter(wbytes * double(state.iterations()) / g_membw_bytes_per_s, benchmark::Counter::kIsRate);
}

// One decode token through E2B's gated FFN (gate and up 12288x1536, down 1536x12288) as the CPU
// backend's fused op, or as its ops one after the other (the Backend default: the activation
// in floats, quantized again on the caller). Packed copies of one set of matrices rotate through
// kRotateBytes, as QMatmul's do (a few hundred MB can sit in a server's L3: cache, not memory).
void GatedFfn(benchmark::State& state, DType dt, bool fused) {
  const int64_t H = 1536, F = 12288;
  static std::unique_ptr<mb::Backend> be = mb::make_cpu_backend();
  struct Source {
    DType dt;
    std::vector<uint8_t> bytes[3];             // the rows as a file holds them, which the weights may view
    std::vector<std::array<mb::Tensor, 3>> sets;  // gate, up, down, packed once per set
  };
  static std::vector<std::unique_ptr<Source>> cache;
  Source* src = nullptr;
  for (auto& c : cache)
    if (c->dt == dt) src = c.get();
  if (!src) {
    cache.push_back(std::make_unique<Source>());
    src = cache.back().get();
    src->dt = dt;
    const int64_t shapes[3][2] = {{F, H}, {F, H}, {H, F}};
    for (int i = 0; i < 3; ++i) src->bytes[i] = random_quantized(dt, shapes[i][0], shapes[i][1], uint32_t(31 + i));
    size_t bytes = 0;
    while (bytes < kRotateBytes) {
      std::array<mb::Tensor, 3> w;
      for (int i = 0; i < 3; ++i) {
        mb::Tensor t;
        t.dtype = dt;
        t.shape = {shapes[i][0], shapes[i][1]};
        t.data = src->bytes[i].data();
        w[size_t(i)] = be->prepare_weight(t, dt);
        bytes += src->bytes[i].size();
      }
      src->sets.push_back(std::move(w));
    }
  }
  mb::Tensor x = random_tensor(DType::F32, {1, H}, 7), y = mb::host_tensor(DType::F32, {1, H});
  size_t next = 0;
  for (auto _ : state) {
    const std::array<mb::Tensor, 3>& w = src->sets[next++ % src->sets.size()];
    if (fused) be->gated_ffn(x, w[0], w[1], w[2], y);
    else be->mb::Backend::gated_ffn(x, w[0], w[1], w[2], y);
    benchmark::DoNotOptimize(y.f32());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(3 * mb::dtype_row_bytes(dt, H) * size_t(F)));
}

void ParallelFor(benchmark::State& state) {
  auto& pool = mb::ThreadPool::global();
  const int64_t n = state.range(0);
  std::vector<int64_t> sink(64);
  for (auto _ : state) pool.parallel_for(n, 1, [&](int64_t b, int64_t e) { sink[size_t(b % 64)] += e - b; });
  benchmark::DoNotOptimize(sink.data());
}

// What one parallel region costs beyond its work: a decode step opens ~250 of them, and on many
// cores the hand-off is a visible share of a small matrix's time. `chunks` chunks of ~`work_ns`
// each (a spin on the clock), one region per iteration.
void PoolRegion(benchmark::State& state, int64_t chunks, int64_t work_ns) {
  auto& pool = mb::ThreadPool::global();
  for (auto _ : state) {
    pool.parallel_for(chunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        while (std::chrono::steady_clock::now() - t0 < std::chrono::nanoseconds(work_ns)) {
        }
      }
    });
  }
}

bool register_all() {
  for (bool prefetch : {false, true})
    benchmark::RegisterBenchmark(prefetch ? "MemBw/prefetch" : "MemBw/plain",
                                 [=](benchmark::State& s) { MemBw(s, prefetch); })
        ->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(5);
  for (int64_t chunks : {int64_t(4), int64_t(mb::ThreadPool::global().size()) * 8})
    for (int64_t ns : {0, 1000})
      benchmark::RegisterBenchmark(("PoolRegion/chunks:" + std::to_string(chunks) + "/work_ns:" + std::to_string(ns)).c_str(),
                                   [=](benchmark::State& s) { PoolRegion(s, chunks, ns); })
          ->UseRealTime()->Unit(benchmark::kMicrosecond);
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512}) {
    if (!mb::cpu::kernels_for(isa)) continue;
    const std::string in = mb::cpu::isa_name(isa);
    for (DType dt : {DType::BF16, DType::F32, DType::F16})
      for (int64_t n : {1, 2, 4, 8}) {
        if (isa == Isa::Scalar && n > 1) continue;
        benchmark::RegisterBenchmark(("Gemv/" + in + "/" + std::string(mb::dtype_name(dt)) + "/n:" + std::to_string(n)).c_str(),
                                     [=](benchmark::State& s) { Matmul(s, isa, dt, n, 8192, 2048, true); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
      }
    for (DType dt : {DType::BF16, DType::F32})
      for (int64_t n : {16, 64, 512}) {
        if (isa == Isa::Scalar && n > 64) continue;
        benchmark::RegisterBenchmark(("Gemm/" + in + "/" + std::string(mb::dtype_name(dt)) + "/n:" + std::to_string(n)).c_str(),
                                     [=](benchmark::State& s) { Matmul(s, isa, dt, n, 6144, 1536, false); })
            ->UseRealTime()->Unit(benchmark::kMillisecond);
        if (isa == Isa::Avx512 && dt == DType::BF16 && mb::cpu::cpu_amx_bf16_ready())
          benchmark::RegisterBenchmark(("Gemm/avx512-amx/" + std::string(mb::dtype_name(dt)) + "/n:" + std::to_string(n)).c_str(),
                                       [=](benchmark::State& s) { Matmul(s, isa, dt, n, 6144, 1536, false, true); })
              ->UseRealTime()->Unit(benchmark::kMillisecond);
        for (bool amx : {true, false}) {
          if (isa != Isa::Avx512 || dt != DType::BF16) continue;
          AmxScope scope(amx);
          DotScope dot(true);
          const char* kernel = mb::cpu::rounded_bf16_matmul_kernel();
          if (!kernel || (!amx && std::string(kernel) == "amx")) continue;
          benchmark::RegisterBenchmark(("Gemm/rounded-" + std::string(kernel) + "/BF16/n:" + std::to_string(n)).c_str(),
                                       [=](benchmark::State& s) {
                                         DotScope dot_on(true);
                                         Matmul(s, isa, dt, n, 6144, 1536, false, amx, mb::cpu::Bf16Products::Rounded);
                                       })
              ->UseRealTime()->Unit(benchmark::kMillisecond);
        }
      }
    // An E4B image's ViT matmuls (2520 patches) on the rounded products, with the weights warm; those and an E4B
    // clip's conformer matmuls (750 frames) with the weights rotated through 1 GiB, cold in every cache as a
    // model's layers are.
    if (isa == Isa::Avx512 && mb::cpu::rounded_bf16_matmul_kernel()) {
      const std::string kernel = mb::cpu::rounded_bf16_matmul_kernel();
      struct S { const char* name; int64_t n, m, k; };
      for (S c : {S{"vit", 2520, 768, 768}, S{"vit", 2520, 3072, 768}, S{"vit", 2520, 768, 3072}, S{"conformer", 750, 1024, 1024},
                  S{"conformer", 750, 4096, 1024}, S{"conformer", 750, 1024, 4096}})
        for (bool cold : {false, true}) {
          if (!cold && std::string(c.name) != "vit") continue;
          const std::string shape = c.name + std::to_string(c.m) + "x" + std::to_string(c.k);
          benchmark::RegisterBenchmark(((cold ? "GemmCold/rounded-" : "Gemm/rounded-") + kernel + "/BF16/" + shape).c_str(),
                                       [=](benchmark::State& s) {
                                         Matmul(s, isa, DType::BF16, c.n, c.m, c.k, false, true,
                                                mb::cpu::Bf16Products::Rounded, cold);
                                       })
              ->UseRealTime()->Unit(benchmark::kMillisecond);
        }
    }
    struct A { const char* name; int64_t n, ctx; int window; };
    for (A c : {A{"decode_ctx64", 1, 64, 0}, A{"decode_ctx4096", 1, 4096, 0}, A{"decode_ring512", 1, 4096, 512}, A{"prefill64", 64, 64, 0},
                A{"prefill512", 512, 512, 0}, A{"prefill512_ring512", 512, 1024, 512}})
      benchmark::RegisterBenchmark(("Attention/" + in + "/" + c.name).c_str(),
                                   [=](benchmark::State& s) { Attention(s, isa, c.n, c.ctx, c.window); })
          ->UseRealTime()->Unit(benchmark::kMicrosecond);
    if (isa != Isa::Scalar)
      benchmark::RegisterBenchmark(("Attention/" + in + "/vision2520").c_str(),
                                   [=](benchmark::State& s) { EncoderAttention(s, isa, 2520, 12, 64); })
          ->UseRealTime()->Unit(benchmark::kMillisecond);
    if (isa == Isa::Avx512 && mb::cpu::rounded_bf16_matmul_kernel())
      benchmark::RegisterBenchmark(("Attention/rounded-" + std::string(mb::cpu::rounded_bf16_matmul_kernel()) + "/vision2520").c_str(),
                                   [=](benchmark::State& s) { EncoderAttention(s, isa, 2520, 12, 64, true); })
          ->UseRealTime()->Unit(benchmark::kMillisecond);
  }
  for (DType dt : {DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::Q4_K, DType::Q6_K})
    for (int64_t n : {1, 2, 8, 64, 512})
      benchmark::RegisterBenchmark(("QMatmul/" + std::string(mb::dtype_name(dt)) + "/n:" + std::to_string(n)).c_str(),
                                   [=](benchmark::State& s) { QMatmul(s, dt, n, 8192, 2048); })
          ->UseRealTime()->Unit(benchmark::kMillisecond);
  for (DType dt : {DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::Q4_K, DType::Q6_K})
    for (int64_t n : {1, 8, 64})
      benchmark::RegisterBenchmark(("QMatmulInCache/" + std::string(mb::dtype_name(dt)) + "/n:" + std::to_string(n)).c_str(),
                                   [=](benchmark::State& s) { QMatmulInCache(s, dt, n); })
          ->UseRealTime()->Unit(benchmark::kMicrosecond);
  // Decode (1 token) on the shapes of one synthetic E2B layer: the small K/V and Q matrices show
  // what each parallel region's start and end cost against its streaming. QMatmulHot reads one
  // matrix over and over from the cores' caches: its time less ParallelFor's is the activations'
  // quantization and the arithmetic, and QMatmul's time less it is what memory costs.
  for (bool hot : {false, true})
    for (DType dt : {DType::Q8_0, DType::Q4_0})
      for (auto [m, k] : {std::pair<int64_t, int64_t>{256, 1536}, {2048, 1536}, {1536, 2048}, {6144, 1536}, {1536, 6144}})
        benchmark::RegisterBenchmark((std::string(hot ? "QMatmulHot/" : "QMatmul/") + std::string(mb::dtype_name(dt)) + "/n:1/" + std::to_string(m) +
                                      "x" + std::to_string(k)).c_str(),
                                     [=](benchmark::State& s) { QMatmul(s, dt, 1, m, k, !hot); })
            ->UseRealTime()->Unit(benchmark::kMicrosecond);
  for (DType dt : {DType::Q8_0, DType::Q4_0})
    for (bool fused : {false, true})
      benchmark::RegisterBenchmark(("GatedFfn/" + std::string(mb::dtype_name(dt)) + (fused ? "/fused" : "/ops")).c_str(),
                                   [=](benchmark::State& s) { GatedFfn(s, dt, fused); })
          ->UseRealTime()->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("ParallelFor", ParallelFor)->Arg(2)->Arg(64)->UseRealTime();
  return true;
}

// Read bandwidth for `of_membw`, measured once, at the first GEMV entry, as `markbase bench
// --membw` measures it.
bool measure_membw() {
  g_membw_bytes_per_s = mb::cpu::read_bandwidth(membw_buffer(), int64_t(kRotateBytes / 4)).best;
  return true;
}

const bool registered = register_all();

}  // namespace
