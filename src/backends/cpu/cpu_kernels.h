// Inner loops of the CPU backend, kept apart from the op plumbing. Kernels come in per-ISA tables
// (cpu_isa.h): a plain scalar one that runs on any x86-64 CPU and is the twin the SIMD ones are
// tested against, an AVX2 one and an AVX-512 one. The best table the CPU supports is picked at
// the first call; MARKBASE_CPU_ISA=scalar|avx2|avx512 forces one (isa_from_env says what else it
// may hold). Everything the CPU backend runs follows the active table, vec_dot included.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backends/cpu/cpu_isa.h"
#include "core/dtype.h"

namespace mb::cpu {

const KernelTable& kernels();
// The table for `isa` when it is compiled in and this CPU runs it; else null.
const KernelTable* kernels_for(Isa isa);
// Makes `isa` the active path (tests, benchmarks) and returns the previous one; throws when
// kernels_for(isa) is null. Not for use while kernels run on other threads.
Isa set_isa(Isa isa);
Isa best_isa();
// The path MARKBASE_CPU_ISA=value asks for: best_isa() for null or empty, else the named one
// (case-insensitive). Throws mb::Error for any other name and for a path kernels_for() lacks.
Isa isa_from_env(const char* value);
const char* isa_name(Isa isa);
bool cpu_has_avx512_vnni();
// Whether AMX tiles (INT8 / BF16) can run: the CPU has them, the OS enables their state and granted
// this process the permission Linux requires (requested on the first call). MARKBASE_AMX=0 says no.
bool cpu_amx_int8_ready();
bool cpu_amx_bf16_ready();
// Whether matmul runs bf16 weights times kAmxMinTokens or more tokens on AMX tiles (matmul_amx.h;
// f32-accurate results, but not the fma chain's bits): the active table is AVX-512, the build has
// the kernels, cpu_amx_bf16_ready(), and set_amx_bf16_matmul has not turned it off.
bool amx_bf16_matmul_active();
// Process-wide switch for that path (tests, benchmarks); on by default. Returns the previous value.
// Not for use while kernels run on other threads.
bool set_amx_bf16_matmul(bool on);
// Where the AVX-512 table leaves its GEMV (decode, batches of up to 8) for its GEMM. AMX replaces
// that GEMM, several times faster from here on; the GEMV stays, so decode keeps the fma chain's
// bits (below this, where the matmul is memory-bound, AMX measured only a little faster).
constexpr int64_t kAmxMinTokens = 9;

// 64-byte aligned memory that grows on demand and is kept, for kernels' per-thread scratch (a
// thread_local one per use). Its members are defined in cpu_kernels.cpp, built for the baseline
// target, so that per-ISA files share this one copy instead of each emitting its own.
class Scratch {
 public:
  Scratch() = default;
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* bytes(size_t n);  // at least n bytes; the contents are not kept across growth
  float* floats(size_t n);

 private:
  void* p_ = nullptr;
  size_t cap_ = 0;
};

bool is_kernel_weight_dtype(DType t);  // F32, BF16, F16
WType wtype(DType t);

// Parallel drivers over ThreadPool::global() with the active table.
// y[n, m] = x[n, k] · w[m, k]ᵀ; x rows ldx floats apart, y rows ldy apart. Block-quantized w
// (dequantized panel by panel into the f32 GEMM) only where matmul_blocks_supported(n).
// How bf16 weights (F32, F16 and block weights ignore it) take the f32 activations:
enum class Bf16Products {
  // f32-accurate: the fma chain, or from kAmxMinTokens on, AMX with the activations split.
  Exact,
  // The fma chain at any n: for callers whose n depends on other tokens of the batch (a MoE
  // expert's routed tokens), so that a token's bits do not.
  FmaChain,
  // From kAmxMinTokens on, the activations rounded to bf16 (nearest even) where AMX or
  // AVX512-BF16 runs the products (bf16_gemm.h; as transformers' bf16 modules and GPU GEMMs take
  // them); else as Exact. rounded_bf16_matmul_kernel() tells which.
  Rounded,
};
// With `clip`: y = clamp(clamp(x, x_lo..x_hi) · wᵀ, y_lo..y_hi), x kept (the AMX kernels clamp as
// they pack x and store y; other paths in passes of their own).
// act: what y goes through after the clamp (Backend::Activation); times: GeluTanhTimes' other
// factor, laid out as y.
enum class MatAct { None, Silu, GeluTanhTimes };
MatArgs::Epilogue epilogue_of(MatAct act);  // the active table's kernels for it; null for None
struct MatClip {
  float x_lo, x_hi, y_lo, y_hi;
  MatAct act = MatAct::None;
  const float* times = nullptr;
};
void matmul(const float* x, int64_t ldx, int64_t n, int64_t k, DType wt, const void* w, size_t w_stride,
            int64_t m, float* y, int64_t ldy, Bf16Products products = Bf16Products::Exact,
            const MatClip* clip = nullptr);
// The kernel Bf16Products::Rounded takes: "amx", "avx512bf16", or null (none here: exact products).
const char* rounded_bf16_matmul_kernel();
// Process-wide switch (tests, benchmarks) for Rounded's VDPBF16PS kernel where AMX does not run
// and the CPU has AVX512-BF16; on by default only where VDPBF16PS outruns the f32 FMAs (AMD).
// Returns the previous value. Not for use while kernels run on other threads.
bool set_avx512_bf16_matmul(bool on);
bool matmul_blocks_supported(int64_t n);
void attention(const AttnArgs& a);
// Several sequences' attention (each with its own queries, KV and positions) in one parallel region.
void attention(const AttnArgs* seqs, int64_t n_seqs);
// attention() of a sequence whose every query sees the same keys 0..last (an image in a vision
// tower: 64+ queries, 256+ keys; no window, soft-cap, pages, ring or key split) on the rounded bf16
// products, as torch's SDPA computes it on bf16 tensors: S = bf16(q)·bf16(k)ᵀ a block of queries
// at a time, E = exp(scale (S - max)) in f32, out = bf16(E)·bf16(v) / ΣE. False, with nothing
// done, where the case or the CPU (rounded_bf16_matmul_kernel) does not allow it.
bool attention_whole_rounded(const AttnArgs& a);
void gelu_tanh_mul(const float* g, const float* u, float* out, int64_t n);
// x = cap * tanh(x / cap)
void softcap(float* x, int64_t n, float cap);

// Single calls into the active table.
float dot_f32(const float* a, const float* b, int64_t n);
// Σ w[i]·x[i] for one row w of dtype t (a block type, F32, F16 or BF16) left in its file format:
// the fused dequantize-dot of the f32-activation path (quant_dot.cpp). The scalar table runs
// vec_dot_ref (core/quant.h); the AVX2 and AVX-512 tables run an AVX2 kernel whose products are
// the same, summed in f32 in another order.
float vec_dot(DType t, const void* row, const float* x, int64_t n);
// Converts n weights of `dtype` (F32, BF16, F16) to f32.
void to_f32(DType dtype, const void* src, float* dst, int64_t n);
// y += a * x
void axpy(float a, const float* x, float* y, int64_t n);
// Sum of n floats, streaming: used to measure read bandwidth.
float sum_f32(const float* x, int64_t n);
// Read-bandwidth probe over x[0, n), all threads of the global pool, each reading its share:
// seconds of one pass of a plain sum (prefetch false) or of a sum that also prefetches 2 KB
// ahead, as the matmul kernels do; read_bandwidth: bytes/s of the best of `passes` passes of
// each loop. Either loop alone can read less than decode streams (on many cores the plain sum
// was measured below what Q8_0 decode streamed, the prefetching one above it), so the best of
// both is the floor. On a machine shared with others the best pass catches moments the
// neighbours leave the memory alone, so the median of all the passes, a sustained rate, comes
// with it.
struct ReadBandwidth {
  double best = 0, median = 0;  // bytes/s
};
double read_pass_seconds(const float* x, int64_t n, bool prefetch);
ReadBandwidth read_bandwidth(const float* x, int64_t n, int passes = 5);
float gelu_tanh(float x);

// Scalar references.
float dot_f32_ref(const float* a, const float* b, int64_t n);
// y[t][r] = fma(x[t][k-1], w[r][k-1], ... fma(x[t][0], w[r][0], 0)): what the SIMD matmul paths
// return bit for bit.
void matmul_ref(const float* x, int64_t n, int64_t k, DType wt, const void* w, int64_t m, float* y);

}  // namespace mb::cpu
