// The seam between the CPU backend and its per-ISA kernel builds. Each ISA's kernels live in a file
// compiled with that ISA's flags (cpu_kernels_avx2.cpp, cpu_kernels_avx512.cpp) and export one
// KernelTable; cpu_kernels.cpp picks a table at run time. This header is included by those files,
// so it holds only plain declarations: an inline function here would be emitted by every
// translation unit that includes it, and the linker could keep an AVX-512 copy for all callers.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mb::cpu {

enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// Weight element types the kernels widen to f32 (values match nothing outside this header).
// Block: a block-quantized type, widened through MatArgs::dequant (GEMM only).
enum class WType : int { F32 = 0, BF16 = 1, F16 = 2, Block = 3 };

// y[t * ldy + r] = Σ_k x[t * ldx + k] · w[r][k] for tokens t < n, rows r in the task's range.
struct MatArgs {
  const float* x;
  int64_t ldx;
  int64_t n, k, m;
  const void* w;
  WType wt;
  size_t w_stride;  // bytes between weight rows
  float* y;
  int64_t ldy;
  // WType::Block: rows of `block`-element blocks of `block_bytes`, turned into f32 by `dequant`.
  void (*dequant)(const void* src, float* dst, int64_t n) = nullptr;
  int64_t block = 1;
  size_t block_bytes = 0;
  // Bounds on x as it is read and on y as it is written, for kernels that take them
  // (Bf16GemmKernels::clips; cpu::matmul clamps in passes of its own for the others).
  float x_lo = -__builtin_inff(), x_hi = __builtin_inff(), y_lo = -__builtin_inff(), y_hi = __builtin_inff();
  // Then, by the same kernels, on each finished run of a token's outputs (after the clamp): y[t][r0, r1)
  // = epilogue(y[t][r0, r1), times[t][r0, r1)) (times laid out as y; null where the epilogue has none).
  using Epilogue = void (*)(float* y, const float* times, int64_t n);
  Epilogue epilogue = nullptr;
  const float* times = nullptr;
};

// One sequence's causal attention; see Backend::attention for the contract.
struct AttnArgs {
  const float* q;   // [n, nh, hd]
  float* out;       // [n, nh, hd]
  const float* k;   // [capacity, nkv, hd]
  const float* v;
  const int32_t* pos;
  int64_t n, nh, nkv, hd, capacity;
  bool ring;
  const int32_t* pages;  // non-null: key j is at row pages[j / page_size] * page_size + j % page_size
  int64_t page_size;
  int window;
  float scale, softcap;
  // A key split (flash decoding): only keys at positions [key_begin, key_end), and instead of
  // `out`, the unnormalised result of each (token t, head h) row, O[hd] then the running max M
  // and sum L, at part + (t * nh + h) * (hd + 2). attn_merge folds a row's splits in order.
  int64_t key_begin = 0, key_end = INT64_MAX;
  float* part = nullptr;
  // Non-null: query t sees keys up to position last[t] (>= pos[t]; an image's tokens see the whole
  // image) instead of up to pos[t]; the window still counts back from pos[t].
  const int32_t* last = nullptr;
};

inline int64_t attn_last_key(const AttnArgs& a, int64_t t) { return a.last ? a.last[t] : a.pos[t]; }

// Keys are split at multiples of this many positions (a multiple of every kernel's key block):
// a row's result is the fold, in key order, of the softmax partials of its splits, whether one
// task runs them all (prefill) or each split is its own task merged after (decode on many cores),
// so a token gets the same bits alone or in a batch, on any number of threads.
constexpr int64_t kAttnSplit = 64;

// The cache row of key position j (KVStore::slot). Page sizes are powers of two: this runs for
// every key in the kernels' inner loops, where a division would cost more than the row's address.
inline int64_t kv_row(const AttnArgs& a, int64_t j) {
  if (a.pages) {
    const int shift = __builtin_ctzll(uint64_t(a.page_size));
    return int64_t(a.pages[j >> shift]) << shift | (j & (a.page_size - 1));
  }
  return a.ring ? j % a.capacity : j;
}

struct KernelTable {
  Isa isa;
  const char* name;

  float (*dot)(const float* a, const float* b, int64_t n);
  void (*axpy)(float a, const float* x, float* y, int64_t n);
  float (*sum)(const float* x, int64_t n);
  void (*to_f32)(WType t, const void* src, float* dst, int64_t n);
  // out = gelu_tanh(g) * u; out may alias g or u.
  void (*gelu_tanh_mul)(const float* g, const float* u, float* out, int64_t n);
  // x = cap * tanh(x / cap)
  void (*softcap)(float* x, int64_t n, float cap);
  // x = x · sigmoid(x)
  void (*silu)(float* x, int64_t n);
  // out = x · sigmoid(gate) (a gated linear unit); out may alias x or gate.
  void (*glu)(const float* x, const float* gate, float* out, int64_t n);
  // x = exp(scale (x - m)) over n > 0 finite values, m their max, scale > 0; returns their f32 sum
  // (a softmax's numerators and denominator).
  float (*exp_sum_row)(float* x, int64_t n, float scale);

  // Matmul for a few tokens (n <= gemv_max_tokens): streams each weight row once. Rows [r0, r1).
  int gemv_max_tokens;
  void (*gemv)(const MatArgs& a, int64_t r0, int64_t r1);

  // Matmul for many tokens: x is first packed (gemm_pack_x, tokens [t0, t1) in whole tiles of
  // gemm_tile_tokens) into xp, then row ranges are computed independently. gemm_row_block is the
  // row granularity tasks should use; scratch must hold gemm_scratch_floats(n, k) floats,
  // 64-byte aligned. Null gemm: gemv handles every n.
  int gemm_tile_tokens;
  int gemm_row_block;
  int gemm_rows;  // rows per register tile: task boundaries on multiples of it waste nothing
  size_t (*gemm_xp_floats)(int64_t n, int64_t k);
  size_t (*gemm_scratch_floats)(int64_t n, int64_t k);
  void (*gemm_pack_x)(const MatArgs& a, float* xp, int64_t t0, int64_t t1);
  void (*gemm)(const MatArgs& a, const float* xp, int64_t r0, int64_t r1, float* scratch);

  // Attention for tokens [t0, t1) and heads [h0, h1) of KV head g (heads in [g*group, (g+1)*group)).
  // scratch: attn_scratch_floats(rows, hd) floats, 64-byte aligned.
  size_t (*attn_scratch_floats)(int64_t rows, int64_t hd);
  void (*attention)(const AttnArgs& a, int64_t t0, int64_t t1, int64_t h0, int64_t h1, float* scratch);
  // out[hd] = the normalised fold of n_parts partial rows (AttnArgs::part layout) part_stride
  // floats apart, in order. Null: this table's attention takes no key splits.
  void (*attn_merge)(const float* parts, int64_t n_parts, size_t part_stride, int64_t hd, float* out);
};

// Tables compiled into this build; each returns null when its ISA was not compiled in. They do
// not check the CPU: cpu_kernels.cpp does.
const KernelTable* table_scalar();
const KernelTable* table_avx2();
const KernelTable* table_avx512();

}  // namespace mb::cpu
