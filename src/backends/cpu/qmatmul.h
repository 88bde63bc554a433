// Integer matmul for block-quantized weights, the CPU's default path for Q8_0, Q4_0, Q5_0, Q4_K and
// Q6_K on CPUs with AVX-512 VNNI or AVX2 (as llama.cpp does, activations are quantized to 8 bits per
// 32-element block; MARKBASE_QUANT_MATMUL=exact or set_quant_matmul_exact(true) selects the
// f32-activation path instead, whose numbers equal the dequantized weights').
//
// Weights are repacked once at load, 16 rows to a group, so that one 64-byte vector holds 4
// consecutive k of each of the 16 rows and one VPDPBUSD multiplies it by 4 broadcast activation
// bytes (on AVX2, each 32-byte half, 8 rows, takes VPMADDUBSW + VPMADDWD): lanes are rows, and
// each lane's sum runs over k in order exactly like the scalar twin (qmatmul_ref), so the SIMD
// result equals it bit for bit whatever the batch or thread count.
//
// Every weight w of a 32-element block (16 for Q6_K) is stored as an unsigned code c with
// w = a·c + b; with x ≈ dx·q per activation block,
//   y = Σ_blocks fma(float(Σ c·q), a·dx, ·) then fma(b, dx·Σq, ·)
// (a, b per row and block: Q4_0 a = d, b = -8d; Q5_0 -16d; Q4_K a = d·sc, b = -dmin·m;
// Q6_K a = d·sc, b = -32a). Q8_0 (c = w + 128) takes the signed dot instead, exact in int32:
//   y = Σ_blocks fma(float(Σ c·q - 128·Σq), d·dx, ·)
// one product per block (its b term would be the largest, and cancel the most).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "core/dtype.h"

namespace mb::cpu {

constexpr int kQRows = 16;  // rows per packed group

// The packed layout per type, shared by the packer and the kernels (plain constants, so kernel
// loops are pointer arithmetic). Per 16-row group and 32-k block: code bits and code bytes; per
// unit (1 block, or the 8 blocks of a K super-block): the bytes of scales.
struct QLayout {
  int bits = 0;
  size_t block_codes = 0;
  int blocks_per_unit = 0;
  size_t unit_scales = 0;
};
constexpr QLayout qlayout(DType t) {
  switch (t) {
    case DType::Q8_0: return {8, 512, 1, 32};     // d[16] f16
    case DType::Q4_0: return {4, 256, 1, 32};     // d[16] f16
    case DType::Q5_0: return {5, 320, 1, 32};     // d[16] f16
    case DType::Q4_K: return {4, 256, 8, 320};    // d[16], dmin[16] f16; sc[8][16], m[8][16] u8
    case DType::Q6_K: return {6, 384, 8, 288};    // d[16] f16; sc[16][16] i8
    default: return {};
  }
}

struct QPacked {
  DType type = DType::F32;
  int64_t m = 0, k = 0, groups = 0;
  int unit = 0;                  // k per unit: 32, or 256 for the K types
  size_t unit_codes = 0;         // bytes of codes per unit and group
  size_t unit_scales = 0;        // bytes of scales per unit and group
  size_t block_codes = 0;        // bytes of codes per 32-k block and group
  size_t scales_bytes = 0;       // scales of every unit of a group, padded to 64
  size_t group_bytes = 0;        // the scales, then the codes of every unit
  std::shared_ptr<uint8_t> data;  // 64-byte aligned
  // A group is one contiguous read, so decode streams the matrix front to back.
  int64_t units() const { return k / unit; }
  const uint8_t* group(int64_t g) const { return data.get() + size_t(g) * group_bytes; }
  const uint8_t* scales(int64_t g, int64_t u) const { return group(g) + size_t(u) * unit_scales; }
  const uint8_t* codes(int64_t g, int64_t u) const { return group(g) + scales_bytes + size_t(u) * unit_codes; }
  size_t bytes() const { return size_t(groups) * group_bytes; }
  // Prefetches group g's scales and the first `ahead` bytes of its codes: a task's kernel
  // prefetches `ahead` bytes past the block it reads, so without this the start of each task's
  // stream is demand misses, one after another, until that prefetch gets ahead.
  void prefetch_start(int64_t g, size_t ahead) const {
    const char* p = reinterpret_cast<const char*>(group(g));
    for (size_t off = 0, end = std::min(scales_bytes + ahead, group_bytes); off < end; off += 64)
      __builtin_prefetch(p + off, 0, 3);
  }
};

// Whether `t` with rows of k elements can be packed.
bool qpack_supports(DType t, int64_t k);
// Packs m rows of k elements of type t (rows dtype_row_bytes(t, k) apart). Uses all cores; calls
// on_source_done (when given) on each stretch of source rows as soon as it is packed.
std::shared_ptr<const QPacked> qpack(DType t, const void* w, int64_t m, int64_t k,
                                     void (*on_source_done)(const void*, size_t) = nullptr);
// Row r of the packed weights as f32: equals dequantize_row of the source row (tests).
void qunpack_row(const QPacked& w, int64_t r, float* out);

// Activations quantized per 32-element block: x ≈ dx·q, q in [-127, 127]; dsum32 = dx·Σq over the
// block and dsum16 over each half (Q6_K's sub-blocks).
// qsum = Σq per block as an integer (Q8_0's code offset comes off the dot with it).
struct QActs {
  int64_t n = 0, k = 0;
  std::vector<int8_t> q;  // [n][k]
  std::vector<float> dx, dsum32, dsum16;  // [n][k/32], [n][k/32], [n][k/16]
  std::vector<int32_t> qsum;              // [n][k/32]
  const int8_t* qrow(int64_t t) const { return q.data() + t * k; }
};
// x [n, k] (rows ldx apart; k a multiple of 32) -> a, with the widest rows function the active
// kernel table allows (same numbers: round to nearest even either way).
void quantize_acts(const float* x, int64_t ldx, int64_t n, int64_t k, QActs& a);
// Blocks [b0, b1) (32 columns each, from x's column 0) of tokens [t0, t1) of x into a (already
// sized): the scalar twin and the AVX-512 and AVX2 versions (null when not compiled in). A block
// depends only on its own 32 values, so any split into pieces gives the bytes of one pass.
using QuantizeActsFn = void (*)(const float* x, int64_t ldx, int64_t t0, int64_t t1, int64_t b0, int64_t b1, QActs& a);
void quantize_acts_ref(const float* x, int64_t ldx, int64_t t0, int64_t t1, int64_t b0, int64_t b1, QActs& a);
QuantizeActsFn quantize_acts_avx512();
QuantizeActsFn quantize_acts_avx2();

// y[t * ldy + r] for rows of groups [g0, g1) and tokens [t0, t1); rows past m are not written.
using QMatmulFn = void (*)(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1,
                           int64_t t0, int64_t t1);
void qmatmul_ref(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1, int64_t t0,
                 int64_t t1);
// The AVX-512 VNNI kernel; null when this build lacks it.
QMatmulFn qmatmul_avx512();
// The AVX2 kernel (VPMADDUBSW/VPMADDWD), equal to qmatmul_ref bit for bit too; null when this
// build lacks it.
QMatmulFn qmatmul_avx2();
// The AMX kernel: whole tiles of 16 tokens on AMX-INT8, the rest through the VNNI kernel; equal to
// qmatmul_ref bit for bit like it. Null when this build lacks AMX (cpu_amx_int8_ready() says
// whether the CPU and OS can run it).
QMatmulFn qmatmul_amx();
// The kernel the integer path uses now: with the AVX-512 table active and VNNI on the CPU, AMX
// when the CPU and OS allow it, else the AVX-512 VNNI one; with the AVX2 table (or AVX-512
// without VNNI) the AVX2 one; with the scalar table null (the caller then takes the
// f32-activation path).
QMatmulFn qmatmul_kernel();
// Process-wide choice between the integer path (default) and the f32-activation path; the
// default comes from MARKBASE_QUANT_MATMUL=int8|exact. Returns the previous setting.
bool set_quant_matmul_exact(bool exact);
bool quant_matmul_exact();

// y[n, m] = x[n, k] · wᵀ over ThreadPool::global() with `fn`.
void qmatmul(QMatmulFn fn, const QPacked& w, const float* x, int64_t ldx, int64_t n, float* y, int64_t ldy);
// ys[i][n, m_i] = x · ws[i]ᵀ for weights of the same k: x is quantized once and all the matrices'
// groups are one parallel region (Q, K, V; gate and up).
void qmatmul_many(QMatmulFn fn, const std::vector<const QPacked*>& ws, const float* x, int64_t ldx, int64_t n,
                  const std::vector<float*>& ys);

// out[n, m] = gelu_tanh(x · gateᵀ) * (x · upᵀ) for gate and up of the same shape: one region whose
// tasks compute the same row groups of both and apply the activation to them while they are in
// cache (a gated FFN without a separate activation pass). u: n x m floats of scratch.
void qmatmul_gelu_mul(QMatmulFn fn, const QPacked& gate, const QPacked& up, const float* x, int64_t ldx, int64_t n,
                      float* out, float* u);
// y[n, down.m] (rows ldy apart) = (gelu_tanh(x·gateᵀ) * (x·upᵀ)) · downᵀ, the same bits as
// qmatmul_gelu_mul then qmatmul. Each task of the first region also quantizes its own 32-column
// blocks of the activation for the down projection, so no thread gathers the [n, gate.m] floats
// from the others' caches before the second region can start (12288 floats a token on E2B). g
// and u are [n, gate.m] scratch (g ends as the activation); gate.m must be a multiple of 32.
void qmatmul_gated_ffn(QMatmulFn fn, const QPacked& gate, const QPacked& up, const QPacked& down, const float* x,
                       int64_t ldx, int64_t n, float* g, float* u, float* y, int64_t ldy);

// Calls f(std::integral_constant<DType, t>) for the packed types; false for any other.
template <class F> bool with_packed_type(DType t, F&& f) {
  switch (t) {
    case DType::Q8_0: f(std::integral_constant<DType, DType::Q8_0>{}); return true;
    case DType::Q4_0: f(std::integral_constant<DType, DType::Q4_0>{}); return true;
    case DType::Q5_0: f(std::integral_constant<DType, DType::Q5_0>{}); return true;
    case DType::Q4_K: f(std::integral_constant<DType, DType::Q4_K>{}); return true;
    case DType::Q6_K: f(std::integral_constant<DType, DType::Q6_K>{}); return true;
    default: return false;
  }
}

}  // namespace mb::cpu
