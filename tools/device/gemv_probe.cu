// GEMV layouts measured alone, on the shapes of an E4B decode step (Q4_0 planes as the CUDA backend
// stores them: quants [rows][blocks][16], half scales [rows][blocks]), against a plain read of as
// many bytes: what a decode GEMV could gain from another lane-to-row mapping before it is built
// into kernels_matmul.cu. Each figure is the median per launch of a CUDA graph of 64 launches over
// rotating copies of the weights (300+ MB, so the L2 holds none), every launch waiting for the one
// before (no PDL), as a recorded step's kernels do. docs/cuda.md has the figures of an H200.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/gemv_probe tools/device/gemv_probe.cu
//   /tmp/gemv_probe        # on the GPU machine (no inputs; prints one line per variant)
//
// Variants: LPR lanes (or LPR/32 warps, reduced through shared memory) per row, RPG rows (GLU:
// gate/up pairs) per group at once, UB units of 32 weights a lane loads before it multiplies, and
// the grid at most `w` times what the GPU holds (0: a block per group of rows).
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

struct Args {
  const uint8_t* qs[2]; const __half* sc[2];
  int64_t rows, k;
  const int8_t* xq; const float* xd; const float* xs;
  float* y;
};
__device__ __forceinline__ int4 ldcs(const void* p) { return __ldcs(static_cast<const int4*>(p)); }
__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x))); }

struct Raw { int4 a; float d; };
__device__ __forceinline__ Raw ld(const uint8_t* qs, const __half* sc, int64_t row, int64_t nb, int64_t u) {
  return {ldcs(qs + (row * nb + u) * 16), __half2float(sc[row * nb + u])};
}
__device__ __forceinline__ float dot(const Raw& r, const Args& a, int64_t u) {
  const int8_t* xp = a.xq + u * 32;
  const int4 c = *reinterpret_cast<const int4*>(xp), d = *reinterpret_cast<const int4*>(xp + 16);
  int s = __dp4a(r.a.x & 0x0F0F0F0F, c.x, 0);
  s = __dp4a(r.a.y & 0x0F0F0F0F, c.y, s);
  s = __dp4a(r.a.z & 0x0F0F0F0F, c.z, s);
  s = __dp4a(r.a.w & 0x0F0F0F0F, c.w, s);
  s = __dp4a((r.a.x >> 4) & 0x0F0F0F0F, d.x, s);
  s = __dp4a((r.a.y >> 4) & 0x0F0F0F0F, d.y, s);
  s = __dp4a((r.a.z >> 4) & 0x0F0F0F0F, d.z, s);
  s = __dp4a((r.a.w >> 4) & 0x0F0F0F0F, d.w, s);
  return r.d * (a.xd[u] * float(s) - 8.f * a.xs[u]);
}

// LPR lanes (LPR <= 32) or LPR/32 warps (LPR > 32) per row group; RPG rows (GLU: pairs) per group; UB units a lane loads before multiplying.
template <int LPR, int RPG, bool GLU, int UB>
__global__ void __launch_bounds__(256) k_var(Args a) {
  constexpr int ND = (GLU ? 2 : 1) * RPG;
  constexpr int GPB = LPR >= 32 ? 8 / (LPR / 32) : 8 * (32 / LPR);  // groups per block
  __shared__ float red[8][ND];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int gib = LPR >= 32 ? warp / (LPR / 32) : threadIdx.x / LPR;
  const int sub = LPR >= 32 ? threadIdx.x % LPR : lane % LPR;
  const int64_t nb = a.k / 32;
  const int64_t rpb = int64_t(GPB) * RPG;
  for (int64_t base = int64_t(blockIdx.x) * rpb; base < a.rows; base += int64_t(gridDim.x) * rpb) {
    const int64_t r0 = base + int64_t(gib) * RPG;
    float acc[ND];
#pragma unroll
    for (int i = 0; i < ND; ++i) acc[i] = 0.f;
    for (int64_t u0 = sub; u0 < nb; u0 += int64_t(LPR) * UB) {
      Raw raw[ND][UB];
#pragma unroll
      for (int b = 0; b < UB; ++b)
#pragma unroll
        for (int i = 0; i < ND; ++i) {
          const int64_t row = r0 + (GLU ? i / 2 : i);
          const int m = GLU ? i % 2 : 0;
          if (u0 + LPR * b < nb && row < a.rows) raw[i][b] = ld(a.qs[m], a.sc[m], row, nb, u0 + LPR * b);
        }
#pragma unroll
      for (int b = 0; b < UB; ++b)
#pragma unroll
        for (int i = 0; i < ND; ++i) {
          const int64_t row = r0 + (GLU ? i / 2 : i);
          if (u0 + LPR * b < nb && row < a.rows) acc[i] += dot(raw[i][b], a, u0 + LPR * b);
        }
    }
#pragma unroll
    for (int i = 0; i < ND; ++i)
#pragma unroll
      for (int o = (LPR < 32 ? LPR : 32) / 2; o > 0; o >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
    if (LPR > 32) {
      __syncthreads();
      if (lane == 0)
#pragma unroll
        for (int i = 0; i < ND; ++i) red[warp][i] = acc[i];
      __syncthreads();
      if (sub == 0)
        for (int w = 1; w < LPR / 32; ++w)
#pragma unroll
          for (int i = 0; i < ND; ++i) acc[i] += red[warp + w][i];
    }
    if (sub == 0)
#pragma unroll
      for (int i = 0; i < RPG; ++i) {
        const int64_t row = r0 + i;
        if (row >= a.rows) break;
        a.y[row] = GLU ? gelu(acc[2 * i]) * acc[2 * i + 1] : acc[i];
      }
  }
}

__global__ void k_probe(const int4* p, int64_t n16, float* out) {
  int acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    int4 v0 = __ldcs(p + i), v1 = __ldcs(p + i + stride), v2 = __ldcs(p + i + 2 * stride), v3 = __ldcs(p + i + 3 * stride);
    acc ^= v0.x ^ v1.y ^ v2.z ^ v3.w ^ v0.w ^ v1.x ^ v2.y ^ v3.z;
  }
  for (; i < n16; i += stride) { int4 v = __ldcs(p + i); acc ^= v.x ^ v.w; }
  if (acc == 0x12345678) out[0] = 1.f;
}

struct Mat { std::vector<uint8_t*> qs; std::vector<__half*> sc; int64_t rows, k; };
Mat make(int64_t rows, int64_t k, int copies) {
  Mat m{{}, {}, rows, k};
  const int64_t nb = k / 32;
  std::vector<uint8_t> hq(rows * nb * 16); std::vector<__half> hs(rows * nb);
  for (auto& v : hq) v = uint8_t(rand());
  for (auto& v : hs) v = __float2half((rand() % 2000 - 1000) / 100000.f);
  for (int c = 0; c < copies; ++c) {
    uint8_t* q; __half* s;
    CK(cudaMalloc(&q, hq.size())); CK(cudaMalloc(&s, hs.size() * 2));
    CK(cudaMemcpy(q, hq.data(), hq.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(s, hs.data(), hs.size() * 2, cudaMemcpyHostToDevice));
    m.qs.push_back(q); m.sc.push_back(s);
  }
  return m;
}

int g_sms = 0;
int8_t* g_xq; float *g_xd, *g_xs, *g_y, *g_yref;

template <typename F>
float time_graph(F launch_i, int n) {
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < n; ++i) launch_i(i, st);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(ge, st));
  std::vector<float> t;
  for (int r = 0; r < 15; ++r) {
    cudaEventRecord(e0, st); CK(cudaGraphLaunch(ge, st)); cudaEventRecord(e1, st); CK(cudaEventSynchronize(e1));
    float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms * 1000.f / n);
  }
  std::sort(t.begin(), t.end());
  cudaGraphExecDestroy(ge); cudaGraphDestroy(g); cudaStreamDestroy(st);
  return t[t.size() / 2];
}

template <int LPR, int RPG, bool GLU, int UB>
void run(const char* name, const Mat& w0, const Mat& w1, int waves, bool ref) {
  auto kern = k_var<LPR, RPG, GLU, UB>;
  int per_sm = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, 256, 0));
  constexpr int GPB = LPR >= 32 ? 8 / (LPR / 32) : 8 * (32 / LPR);
  const int64_t rpb = int64_t(GPB) * RPG;
  int64_t grid = (w0.rows + rpb - 1) / rpb;
  if (waves > 0) grid = std::min<int64_t>(grid, int64_t(waves) * per_sm * g_sms);
  const int copies = int(w0.qs.size());
  auto mk = [&](int i) { Args a{}; a.qs[0] = w0.qs[i % copies]; a.sc[0] = w0.sc[i % copies];
    a.qs[1] = GLU ? w1.qs[i % copies] : nullptr; a.sc[1] = GLU ? w1.sc[i % copies] : nullptr;
    a.rows = w0.rows; a.k = w0.k; a.xq = g_xq; a.xd = g_xd; a.xs = g_xs; a.y = g_y; return a; };
  const int n = 64;
  float us = time_graph([&](int i, cudaStream_t st) { kern<<<unsigned(grid), 256, 0, st>>>(mk(i)); }, n);
  CK(cudaGetLastError());
  // correctness vs reference output (copy 0)
  kern<<<unsigned(grid), 256>>>(mk(0)); CK(cudaDeviceSynchronize());
  std::vector<float> y(w0.rows), yr(w0.rows);
  if (ref) CK(cudaMemcpy(g_yref, g_y, w0.rows * 4, cudaMemcpyDeviceToDevice));
  CK(cudaMemcpy(y.data(), g_y, w0.rows * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(yr.data(), g_yref, w0.rows * 4, cudaMemcpyDeviceToHost));
  double md = 0, mx = 0; for (int64_t i = 0; i < w0.rows; ++i) { md = std::max(md, (double)fabs(y[i] - yr[i])); mx = std::max(mx, (double)fabs(yr[i])); }
  const double bytes = double(w0.rows) * w0.k / 32 * 18 * (GLU ? 2 : 1);
  printf("  %-28s grid %6lld (%d/SM) %7.2f us  %6.2f TB/s  maxdiff %.2e of %.2e\n", name, (long long)grid, per_sm, us, bytes / us / 1e6, md, mx);
}

void probe(int64_t bytes) {
  const int copies = int(std::max<int64_t>(2, 400000000 / bytes));
  std::vector<int4*> b(copies);
  for (auto& p : b) { CK(cudaMalloc(&p, bytes)); CK(cudaMemset(p, 1, bytes)); }
  float* out; CK(cudaMalloc(&out, 4));
  const int64_t n16 = bytes / 16;
  for (int bl : {1, 2, 4}) {
    const int grid = std::min<int64_t>(g_sms * 8 / 1 * bl / 4 * 1, (n16 + 255) / 256);
    float us = time_graph([&](int i, cudaStream_t st) { k_probe<<<grid, 256, 0, st>>>(b[i % copies], n16, out); }, 64);
    printf("  probe %8.2f MB grid %5d: %7.2f us %6.2f TB/s\n", bytes / 1e6, grid, us, bytes / us / 1e6);
  }
  for (auto p : b) cudaFree(p);
  cudaFree(out);
}

int main() {
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t K = 16384;
  CK(cudaMalloc(&g_xq, K)); CK(cudaMalloc(&g_xd, K / 32 * 4)); CK(cudaMalloc(&g_xs, K / 32 * 4));
  CK(cudaMalloc(&g_y, 300000 * 4)); CK(cudaMalloc(&g_yref, 300000 * 4));
  { std::vector<int8_t> x(K); for (auto& v : x) v = int8_t(rand() % 255 - 127); std::vector<float> d(K / 32, 0.01f), s(K / 32, 0.02f);
    CK(cudaMemcpy(g_xq, x.data(), K, cudaMemcpyHostToDevice)); CK(cudaMemcpy(g_xd, d.data(), K / 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(g_xs, s.data(), K / 8, cudaMemcpyHostToDevice)); }
  printf("sms %d\n", g_sms);
  for (int64_t mb : {1, 4, 15, 30, 400}) probe(mb * 1000000);
  auto copies = [](int64_t rows, int64_t k) { return int(std::max<int64_t>(4, 300000000 / (rows * k / 32 * 18))); };
  {
    printf("GLU gate/up 10240 x 2560\n");
    Mat g = make(10240, 2560, 8), u = make(10240, 2560, 8);
    run<32, 1, true, 4>("base lpr32 rpg1 ub4 w2", g, u, 2, true);
    run<32, 1, true, 4>("lpr32 rpg1 ub4 w0", g, u, 0, false);
    run<16, 1, true, 5>("lpr16 rpg1 ub5 w2", g, u, 2, false);
    run<16, 1, true, 5>("lpr16 rpg1 ub5 w0", g, u, 0, false);
    run<16, 2, true, 3>("lpr16 rpg2 ub3 w0", g, u, 0, false);
    run<8, 1, true, 5>("lpr8 rpg1 ub5 w0", g, u, 0, false);
    run<8, 1, true, 10>("lpr8 rpg1 ub10 w0", g, u, 0, false);
    run<32, 2, true, 3>("lpr32 rpg2 ub3 w0", g, u, 0, false);
    run<32, 2, true, 3>("lpr32 rpg2 ub3 w2", g, u, 2, false);
    run<4, 1, true, 10>("lpr4 rpg1 ub10 w0", g, u, 0, false);
  }
  {
    printf("down 2560 x 10240\n");
    Mat d = make(2560, 10240, 20);
    run<32, 1, false, 8>("base lpr32 ub8 w2", d, d, 2, true);
    run<32, 1, false, 8>("lpr32 ub8 w0", d, d, 0, false);
    run<32, 1, false, 10>("lpr32 ub10 w0", d, d, 0, false);
    run<16, 1, false, 10>("lpr16 ub10 w0", d, d, 0, false);
    run<16, 1, false, 20>("lpr16 ub20 w0", d, d, 0, false);
    run<64, 1, false, 5>("lpr64 ub5 w0", d, d, 0, false);
    run<64, 1, false, 5>("lpr64 ub5 w2", d, d, 2, false);
    run<128, 1, false, 5>("lpr128 ub5 w0", d, d, 0, false);
    run<32, 2, false, 5>("lpr32 rpg2 ub5 w0", d, d, 0, false);
  }
  for (auto shp : {std::pair<int64_t, int64_t>{3072, 2560}, {2560, 2048}, {2560, 256}, {256, 2560}, {262144, 2560}}) {
    printf("plain %lld x %lld\n", (long long)shp.first, (long long)shp.second);
    Mat d = make(shp.first, shp.second, copies(shp.first, shp.second));
    run<32, 1, false, 8>("base lpr32 ub8 w2", d, d, 2, true);
    run<32, 1, false, 8>("lpr32 ub8 w0", d, d, 0, false);
    run<16, 1, false, 5>("lpr16 ub5 w0", d, d, 0, false);
    run<8, 1, false, 10>("lpr8 ub10 w0", d, d, 0, false);
    run<8, 2, false, 5>("lpr8 rpg2 ub5 w0", d, d, 0, false);
    run<4, 1, false, 4>("lpr4 ub4 w0", d, d, 0, false);
    run<64, 1, false, 4>("lpr64 ub4 w0", d, d, 0, false);
    run<128, 1, false, 4>("lpr128 ub4 w0", d, d, 0, false);
    for (auto& p : d.qs) cudaFree(p);
    for (auto& p : d.sc) cudaFree(p);
  }
}
