// Kernels for bf16 weights times many f32 tokens on the CPU's bf16 products: AMX tiles
// (matmul_amx.cpp) and AVX512-BF16 dot products (matmul_bf16_dot.cpp). cpu::matmul takes them
// where the active kernel table is AVX-512 and the CPU runs them.
//
// Exact (amx_bf16_kernels): what the f32 GEMM computes, faster. Why AMX: one TDPBF16PS multiplies
// a 16 x 32 bf16 tile by a 32 x 16 one (16K flops) where an AVX-512 FMA does 32, so the f32 GEMM,
// which widens the weights and runs FMAs, leaves most of the core idle. Why split the
// activations: AMX multiplies bf16 by bf16, and rounding the f32 activations to bf16 would lose
// ~3 decimal digits (the parity tests check logits to 1e-4). Each activation x is written as a
// sum of bf16 parts, x = p0 + p1 + p2 (p0 = bf16(x), each next part bf16 of what is left); the
// weights are exactly bf16, so y = Σ p0·w + Σ p1·w + Σ p2·w in f32 tiles differs from the exact
// sum only by the f32 additions, like the f32 GEMM. Three parts, not two: with x ≈ hi + lo the
// per-term error is up to 2^-16 |x·w|, and the bf16 fixtures' logits moved by up to 7e-4 against
// exact math (limit 1e-4); with three the split is exact (three 8-bit significands hold f32's 24
// bits) and they stay within 2e-5, as with the f32 path. With three times the tile products a
// matmul still runs several times faster than the f32 GEMM.
//
// Rounded (amx_bf16_rounded_kernels, avx512_bf16_rounded_kernels): the activations rounded to
// bf16 (nearest even) once, as a GPU's bf16 GEMMs and transformers' bf16 modules take them: one
// product per weight instead of three on AMX, and twice the f32 FMA's rate for VDPBF16PS (which
// sums a pair of bf16 products into each f32 lane). For the weights that ask for it
// (Backend::WeightUse::MatmulRoundedInputs: the media towers' bf16 matrices).
//
// AMX roles: the weights are the A operand, 16 rows x 32 k, read from their rows in memory where
// they lie (the mapped file: nothing is repacked at load, decode keeps reading them as before)
// and kept in a per-task panel for the next token tiles; the activations are the B operand, split
// and packed once per call (pack_x) into the k-pair layout B tiles want. C tiles hold 16 weight
// rows x 16 tokens and are transposed into y.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backends/cpu/cpu_isa.h"

namespace mb::cpu {

struct Bf16GemmKernels {
  int tile_tokens;  // tokens per packed activation tile
  int row_step;     // weight rows per step: tasks should start on multiples of it
  // Rows a gemm call walks with every token at once; tasks of that many rows waste nothing.
  int64_t (*task_rows)(int64_t k);
  // Bytes of the packed activations for n tokens of k.
  size_t (*xp_bytes)(int64_t n, int64_t k);
  // Bytes of 64-byte aligned scratch a gemm call needs.
  size_t (*scratch_bytes)(int64_t n, int64_t k);
  // Packs the tokens of tiles [tile0, tile1) of a.x, split or rounded to bf16, into xp
  // (xp_bytes(a.n, a.k)).
  void (*pack_x)(const MatArgs& a, uint16_t* xp, int64_t tile0, int64_t tile1);
  // y for weight rows [r0, r1) and every token. AMX kernels load their tile configuration and
  // release the tiles before they return (other AMX kernels on the same thread use others).
  void (*gemm)(const MatArgs& a, const uint16_t* xp, int64_t r0, int64_t r1, void* scratch);
  // Whether pack_x and gemm apply MatArgs' bounds on x and y and its epilogue.
  bool clips;
};

// One head's attention over all of a sequence's keys on AMX tiles, as cpu::attention_whole_rounded
// computes it (scores of bf16 queries and keys in f32, numerators exp(scale (s - max)) rounded to
// bf16 times bf16 values, divided by their f32 sum), for `queries` queries a call. Why not two
// calls of the GEMM kernels: here the scores come out as [query][key] rows and the rounded
// numerators are the next product's A operand where they lie, where the GEMMs' layout (weights as
// A, tokens as B) transposes each score tile and packs the probabilities again (~30% of the time).
struct RoundedAttentionKernels {
  int64_t queries;
  // Bytes of one KV head's packed keys and values.
  size_t (*kv_bytes)(int64_t keys, int64_t hd);
  // Keys and values [32 b0, 32 b1) of one KV head (row j at k + j * ld, v + j * ld) into kv
  // (kv_bytes, 64-byte aligned); b1 up to ceil(keys / 32).
  void (*pack_kv)(const float* k, const float* v, int64_t ld, int64_t keys, int64_t hd, int64_t b0, int64_t b1,
                  uint16_t* kv);
  // Bytes of 64-byte aligned scratch a block call needs.
  size_t (*scratch_bytes)(int64_t keys, int64_t hd);
  // out[i] (ldo floats apart) for the n <= queries query rows q[i] (ldq apart) of one head.
  void (*block)(const float* q, int64_t ldq, int64_t n, int64_t keys, int64_t hd, float scale, const uint16_t* kv,
                float* out, int64_t ldo, void* scratch);
};

// The kernels, or null when the compiler could not build them (their files without the ISA's
// flags). They do not check the CPU: cpu_kernels.cpp does.
const Bf16GemmKernels* amx_bf16_kernels();
const Bf16GemmKernels* amx_bf16_rounded_kernels();
const Bf16GemmKernels* avx512_bf16_rounded_kernels();
const RoundedAttentionKernels* amx_rounded_attention_kernels();

}  // namespace mb::cpu
