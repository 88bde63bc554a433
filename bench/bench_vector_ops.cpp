// Issue rate of the AVX2 integer ops the Q4_0/Q8_0 kernels are built from, on one core:
//   VectorOps/avx2/<op>   12 independent chains of one op (so latency does not bound it); Gops
//                         is ops a second. Against it, QMatmulInCache's GMACS tells how close
//                         the kernel's mix (about 24 vector ops per 256 MACs, qmatmul_avx2.cpp)
//                         runs to what the core can issue.
//   ./build/bench/markbase_bench --benchmark_filter=VectorOps --benchmark_repetitions=3
#include <benchmark/benchmark.h>

#include "backends/cpu/cpu_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace {

constexpr int kChains = 12;
constexpr int64_t kRounds = 1 << 16;

// An empty asm each result passes through keeps every chain live and in its own register (the
// compiler can neither fold the chain nor drop the ones whose results look unused).
#define MB_CHAIN_STEP(OP, v) \
  v = OP(v, b);              \
  asm volatile("" : "+x"(v));

#define MB_VECTOR_OP_LOOP(NAME, OP)                                                                   \
  __attribute__((target("avx2"), noinline)) int NAME(int64_t rounds) {                                \
    const __m256i b = _mm256_set1_epi8(3);                                                           \
    __m256i c0 = _mm256_set1_epi8(1), c1 = _mm256_set1_epi8(2), c2 = _mm256_set1_epi8(3),             \
            c3 = _mm256_set1_epi8(4), c4 = _mm256_set1_epi8(5), c5 = _mm256_set1_epi8(6),             \
            c6 = _mm256_set1_epi8(7), c7 = _mm256_set1_epi8(8), c8 = _mm256_set1_epi8(9),             \
            c9 = _mm256_set1_epi8(10), c10 = _mm256_set1_epi8(11), c11 = _mm256_set1_epi8(12);        \
    for (int64_t r = 0; r < rounds; ++r) {                                                            \
      MB_CHAIN_STEP(OP, c0) MB_CHAIN_STEP(OP, c1) MB_CHAIN_STEP(OP, c2) MB_CHAIN_STEP(OP, c3)         \
      MB_CHAIN_STEP(OP, c4) MB_CHAIN_STEP(OP, c5) MB_CHAIN_STEP(OP, c6) MB_CHAIN_STEP(OP, c7)         \
      MB_CHAIN_STEP(OP, c8) MB_CHAIN_STEP(OP, c9) MB_CHAIN_STEP(OP, c10) MB_CHAIN_STEP(OP, c11)       \
    }                                                                                                 \
    const __m256i s = _mm256_add_epi32(                                                               \
        _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),        \
                         _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7))),       \
        _mm256_add_epi32(_mm256_add_epi32(c8, c9), _mm256_add_epi32(c10, c11)));                      \
    return _mm256_extract_epi32(s, 0);                                                                \
  }

MB_VECTOR_OP_LOOP(maddubs_loop, _mm256_maddubs_epi16)
MB_VECTOR_OP_LOOP(madd_loop, _mm256_madd_epi16)
MB_VECTOR_OP_LOOP(add16_loop, _mm256_add_epi16)

void VectorOps(benchmark::State& state, int (*loop)(int64_t)) {
  if (!mb::cpu::kernels_for(mb::cpu::Isa::Avx2)) {  // the library's one CPU check (the OS's state too)
    state.SkipWithError("no AVX2 on this CPU");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(loop(kRounds));
  state.counters["Gops"] =
      benchmark::Counter(double(kChains) * double(kRounds) * 1e-9 * double(state.iterations()), benchmark::Counter::kIsRate);
}

BENCHMARK_CAPTURE(VectorOps, avx2/vpmaddubsw, maddubs_loop)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(VectorOps, avx2/vpmaddwd, madd_loop)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(VectorOps, avx2/vpaddw, add16_loop)->Unit(benchmark::kMicrosecond);

}  // namespace

#endif
