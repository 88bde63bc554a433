#include "backends/cpu/qmatmul.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "backends/cpu/cpu_kernels.h"
#include "core/cache_hint.h"
#include "core/env_flag.h"
#include "core/error.h"
#include "core/mmap.h"
#include "core/quant.h"
#include "core/thread_pool.h"


namespace mb::cpu {

namespace {

using namespace blocks;

// Code layout of one 32-k block of a group (see qmatmul.h): k = 4q + i of row r sits in
//   8-bit codes:  byte 64q + 4r + i
//   4-bit codes:  byte 64(q/2) + 4r + i, low nibble for even q, high nibble for odd q
//   bit 4 of 5-bit codes: bit q of byte 256 + 4r + i
//   bits 4-5 of 6-bit codes: bits 2(q%4), 2(q%4)+1 of byte 256 + 64(q/4) + 4r + i
// The high bits of a code sit in the same byte lane as its nibble, so the SIMD kernels move them
// into place with one shift and one mask per quad (no bit-to-byte expansion).
QLayout layout_of(DType t) {
  const QLayout L = qlayout(t);
  MB_CHECK(L.bits != 0, "qmatmul: {} cannot be packed", dtype_name(t));
  return L;
}

unsigned get_code(const uint8_t* blk, int bits, int r, int kk) {
  const int q = kk / 4, i = kk % 4, lane = 4 * r + i;
  if (bits == 8) return blk[64 * q + lane];
  unsigned c = (blk[64 * (q / 2) + lane] >> (4 * (q & 1))) & 15u;
  if (bits == 5) c |= ((blk[256 + lane] >> q) & 1u) << 4;
  if (bits == 6) c |= ((blk[256 + 64 * (q / 4) + lane] >> (2 * (q % 4))) & 3u) << 4;
  return c;
}

uint16_t* f16s(uint8_t* p) { return reinterpret_cast<uint16_t*>(p); }
const uint16_t* f16s(const uint8_t* p) { return reinterpret_cast<const uint16_t*>(p); }

// Packs row r (0..15) of group g from its source row.
// Writes the 32 codes of row r (0..15) into a block of the group's layout.
void put_block(uint8_t* blk, int bits, int r, const uint8_t (&c)[32]) {
  if (bits == 8) {
    for (int q = 0; q < 8; ++q) std::memcpy(blk + 64 * q + 4 * r, c + 4 * q, 4);
    return;
  }
  for (int p = 0; p < 4; ++p)
    for (int i = 0; i < 4; ++i) blk[64 * p + 4 * r + i] = uint8_t((c[8 * p + i] & 15u) | ((c[8 * p + 4 + i] & 15u) << 4));
  for (int q = 0; q < 8; ++q)
    for (int i = 0; i < 4; ++i) {
      const unsigned hi = c[4 * q + i] >> 4;
      if (bits == 5) blk[256 + 4 * r + i] |= uint8_t((hi & 1u) << q);
      if (bits == 6) blk[256 + 64 * (q / 4) + 4 * r + i] |= uint8_t((hi & 3u) << (2 * (q % 4)));
    }
}

// Packs row r (0..15) of group g from its source row (the group's bytes start zeroed:
// alloc_streamed's memory is).
void pack_row(QPacked& w, int64_t g, int r, const uint8_t* src) {
  const QLayout L = layout_of(w.type);
  uint8_t* gp = w.data.get() + size_t(g) * w.group_bytes;
  uint8_t c[32];
  for (int64_t u = 0; u < w.units(); ++u) {
    uint8_t* cu = gp + w.scales_bytes + size_t(u) * w.unit_codes;
    uint8_t* su = gp + size_t(u) * w.unit_scales;
    switch (w.type) {
      case DType::Q8_0: {
        const Q8_0& b = reinterpret_cast<const Q8_0*>(src)[u];
        f16s(su)[r] = b.d;
        for (int j = 0; j < 32; ++j) c[j] = uint8_t(int(b.qs[j]) + 128);
        put_block(cu, 8, r, c);
        break;
      }
      case DType::Q4_0: {
        const Q4_0& b = reinterpret_cast<const Q4_0*>(src)[u];
        f16s(su)[r] = b.d;
        for (int j = 0; j < 16; ++j) {
          c[j] = b.qs[j] & 15u;
          c[j + 16] = b.qs[j] >> 4;
        }
        put_block(cu, 4, r, c);
        break;
      }
      case DType::Q5_0: {
        const Q5_0& b = reinterpret_cast<const Q5_0*>(src)[u];
        f16s(su)[r] = b.d;
        uint32_t qh;
        std::memcpy(&qh, b.qh, 4);
        for (int j = 0; j < 16; ++j) {
          c[j] = uint8_t((b.qs[j] & 15u) | (((qh >> j) & 1u) << 4));
          c[j + 16] = uint8_t((b.qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
        }
        put_block(cu, 5, r, c);
        break;
      }
      case DType::Q4_K: {
        // scales: d[16] f16, dmin[16] f16, sc[8][16] u8, m[8][16] u8
        const Q4_K& b = reinterpret_cast<const Q4_K*>(src)[u];
        f16s(su)[r] = b.d;
        f16s(su)[16 + r] = b.dmin;
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          k_scale_min(j, b.scales, sc, m);
          su[64 + 16 * j + r] = uint8_t(sc);
          su[192 + 16 * j + r] = uint8_t(m);
          for (int l = 0; l < 32; ++l) {
            const uint8_t byte = b.qs[32 * (j / 2) + l];
            c[l] = (j & 1) ? byte >> 4 : byte & 15u;
          }
          put_block(cu + size_t(j) * L.block_codes, 4, r, c);
        }
        break;
      }
      case DType::Q6_K: {
        // scales: d[16] f16, sc[16][16] i8 (sub-block of 16, row)
        const Q6_K& b = reinterpret_cast<const Q6_K*>(src)[u];
        f16s(su)[r] = b.d;
        for (int s = 0; s < 16; ++s) su[32 + 16 * s + r] = uint8_t(b.scales[s]);
        for (int blk = 0; blk < 8; ++blk) {
          for (int l = 0; l < 32; ++l) {
            const int e = 32 * blk + l, h = e / 128, q = (e % 128) / 32;
            const uint8_t ql = b.ql[64 * h + l + 32 * (q & 1)];
            const unsigned lo = (q < 2 ? ql : ql >> 4) & 15u, hi = (b.qh[32 * h + l] >> (2 * q)) & 3u;
            c[l] = uint8_t(lo | (hi << 4));
          }
          put_block(cu + size_t(blk) * L.block_codes, 6, r, c);
        }
        break;
      }
      default: fail("qmatmul: {} cannot be packed", dtype_name(w.type));
    }
  }
}

// Per-block weight scale a and offset b of row r (the order of operations is part of the
// contract: the SIMD kernel computes the same products).
struct BlockScale {
  float a, b;
};

BlockScale block_scale(const QPacked& w, const uint8_t* su, int r, int blk, int half) {
  switch (w.type) {
    case DType::Q8_0: { const float a = f16_to_f32(f16s(su)[r]); return {a, a * -128.f}; }  // qmatmul_ref: b unused
    case DType::Q4_0: { const float a = f16_to_f32(f16s(su)[r]); return {a, a * -8.f}; }
    case DType::Q5_0: { const float a = f16_to_f32(f16s(su)[r]); return {a, a * -16.f}; }
    case DType::Q4_K: {
      const float d = f16_to_f32(f16s(su)[r]), dmin = f16_to_f32(f16s(su)[16 + r]);
      return {d * float(su[64 + 16 * blk + r]), -(dmin * float(su[192 + 16 * blk + r]))};
    }
    case DType::Q6_K: {
      const float a = f16_to_f32(f16s(su)[r]) * float(int8_t(su[32 + 16 * (2 * blk + half) + r]));
      return {a, a * -32.f};
    }
    default: fail("qmatmul: {} cannot be packed", dtype_name(w.type));
  }
}

EnvFlag g_exact("MARKBASE_QUANT_MATMUL", "exact");

}  // namespace

bool qpack_supports(DType t, int64_t k) {
  switch (t) {
    case DType::Q8_0: case DType::Q4_0: case DType::Q5_0: return k > 0 && k % 32 == 0;
    case DType::Q4_K: case DType::Q6_K: return k > 0 && k % 256 == 0;
    default: return false;
  }
}

std::shared_ptr<const QPacked> qpack(DType t, const void* w, int64_t m, int64_t k,
                                     void (*on_source_done)(const void*, size_t)) {
  MB_CHECK(qpack_supports(t, k), "qmatmul: {} rows of {} cannot be packed", dtype_name(t), k);
  auto p = std::make_shared<QPacked>();
  p->type = t;
  p->m = m;
  p->k = k;
  p->groups = (m + kQRows - 1) / kQRows;
  const QLayout L = layout_of(t);
  p->unit = 32 * L.blocks_per_unit;
  p->block_codes = L.block_codes;
  p->unit_codes = L.block_codes * size_t(L.blocks_per_unit);
  p->unit_scales = L.unit_scales;
  p->scales_bytes = (size_t(p->units()) * p->unit_scales + 63) / 64 * 64;
  p->group_bytes = p->scales_bytes + size_t(p->units()) * p->unit_codes;
  const size_t total = p->bytes();
  p->data = alloc_streamed(total);
  const size_t row_bytes = dtype_row_bytes(t, k);
  const uint8_t* src = static_cast<const uint8_t*>(w);
  // Slabs of ~2 MB of source: after each, on_source_done may drop the pages just read, so a
  // mapped file and its packed copy are never both resident beyond one slab (the peak RSS of a
  // load is the packed weights plus this).
  const int64_t slab = std::max<int64_t>(1, int64_t((size_t(2) << 20) / (row_bytes * kQRows)));
  for (int64_t s0 = 0; s0 < p->groups; s0 += slab) {
    const int64_t s1 = std::min(p->groups, s0 + slab);
    ThreadPool::global().parallel_for(s1 - s0, 1, [&](int64_t b, int64_t e) {
      for (int64_t g = s0 + b; g < s0 + e; ++g)
        for (int r = 0; r < kQRows && g * kQRows + r < m; ++r)
          pack_row(*p, g, r, src + size_t(g * kQRows + r) * row_bytes);
    });
    if (on_source_done) {
      const int64_t r0 = s0 * kQRows, r1 = std::min(m, s1 * kQRows);
      on_source_done(src + size_t(r0) * row_bytes, size_t(r1 - r0) * row_bytes);
    }
  }
  return p;
}

void qunpack_row(const QPacked& w, int64_t row, float* out) {
  const int64_t g = row / kQRows;
  const int r = int(row % kQRows), bits = layout_of(w.type).bits;
  for (int64_t u = 0; u < w.units(); ++u)
    for (int e = 0; e < w.unit; ++e) {
      const int blk = e / 32;
      const BlockScale s = block_scale(w, w.scales(g, u), r, blk, (e % 32) / 16);
      const unsigned c = get_code(w.codes(g, u) + size_t(blk) * w.block_codes, bits, r, e % 32);
      out[u * w.unit + e] = s.a * float(c) + s.b;
    }
}

void quantize_acts_ref(const float* x, int64_t ldx, int64_t t0, int64_t t1, int64_t b0, int64_t b1, QActs& a) {
  const int64_t k = a.k;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + t * ldx + 32 * b;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      // Blocks below 1e-30 count as zeros: 1/d must stay finite (no inf·0 = NaN).
      const float d = amax >= 1e-30f ? amax / 127.f : 0.f, id = d > 0.f ? 1.f / d : 0.f;
      int8_t* q = a.q.data() + t * k + 32 * b;
      int s[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        q[i] = int8_t(std::nearbyint(xb[i] * id));
        s[i / 16] += q[i];
      }
      const size_t bi = size_t(t * (k / 32) + b);
      a.dx[bi] = d;
      a.qsum[bi] = s[0] + s[1];
      a.dsum32[bi] = d * float(s[0] + s[1]);
      a.dsum16[2 * bi] = d * float(s[0]);
      a.dsum16[2 * bi + 1] = d * float(s[1]);
    }
}

namespace {

void size_acts(QActs& a, int64_t n, int64_t k) {
  MB_CHECK(k % 32 == 0, "qmatmul: activation rows of {} are not whole 32-element blocks", k);
  a.n = n;
  a.k = k;
  a.q.resize(size_t(n * k));
  a.dx.resize(size_t(n * k / 32));
  a.dsum32.resize(size_t(n * k / 32));
  a.dsum16.resize(size_t(n * k / 16));
  a.qsum.resize(size_t(n * k / 32));
}

QuantizeActsFn quantize_acts_fn() {
  QuantizeActsFn fn = nullptr;
  if (kernels().isa == Isa::Avx512) fn = quantize_acts_avx512();
  if (!fn && kernels().isa >= Isa::Avx2) fn = quantize_acts_avx2();
  return fn ? fn : quantize_acts_ref;
}

}  // namespace

void quantize_acts(const float* x, int64_t ldx, int64_t n, int64_t k, QActs& a) {
  size_acts(a, n, k);
  QuantizeActsFn fn = quantize_acts_fn();
  if (n * k < (int64_t(1) << 16)) fn(x, ldx, 0, n, 0, k / 32, a);
  else
    ThreadPool::global().parallel_for(n, std::max<int64_t>(1, (int64_t(1) << 14) / k),
                                      [&](int64_t t0, int64_t t1) { fn(x, ldx, t0, t1, 0, k / 32, a); });
}

void qmatmul_ref(const QPacked& w, const QActs& x, float* y, int64_t ldy, int64_t g0, int64_t g1, int64_t t0,
                 int64_t t1) {
  const int bits = layout_of(w.type).bits;
  const int64_t nb = w.k / 32;
  for (int64_t g = g0; g < g1; ++g)
    for (int r = 0; r < kQRows && g * kQRows + r < w.m; ++r)
      for (int64_t t = t0; t < t1; ++t) {
        const int8_t* xq = x.qrow(t);
        float acc = 0.f;
        for (int64_t u = 0; u < w.units(); ++u)
          for (int blk = 0; blk < w.unit / 32; ++blk) {
            const int64_t kb = u * w.unit + 32 * blk, bi = t * nb + kb / 32;
            const uint8_t* cb = w.codes(g, u) + size_t(blk) * w.block_codes;
            const int halves = w.type == DType::Q6_K ? 2 : 1, len = 32 / halves;
            for (int h = 0; h < halves; ++h) {
              int32_t dot = 0;
              for (int e = h * len; e < (h + 1) * len; ++e) dot += int32_t(get_code(cb, bits, r, e)) * xq[kb + e];
              const BlockScale s = block_scale(w, w.scales(g, u), r, blk, h);
              if (w.type == DType::Q8_0) {
                // The signed weights' dot (c = w + 128), exact in int32: one product per block.
                acc = std::fma(float(dot - 128 * x.qsum[size_t(bi)]), s.a * x.dx[size_t(bi)], acc);
                continue;
              }
              acc = std::fma(float(dot), s.a * x.dx[size_t(bi)], acc);
              acc = std::fma(s.b, halves == 2 ? x.dsum16[size_t(2 * bi + h)] : x.dsum32[size_t(bi)], acc);
            }
          }
        y[t * ldy + g * kQRows + r] = acc;
      }
}

bool quant_matmul_exact() { return g_exact.get(); }

bool set_quant_matmul_exact(bool exact) { return g_exact.set(exact); }

QMatmulFn qmatmul_kernel() {
  if (quant_matmul_exact()) return nullptr;
  const Isa isa = kernels().isa;
  if (isa == Isa::Avx512 && cpu_has_avx512_vnni()) {
    if (QMatmulFn amx = qmatmul_amx(); amx && cpu_amx_int8_ready()) return amx;
    if (QMatmulFn vnni = qmatmul_avx512()) return vnni;
  }
  return isa >= Isa::Avx2 ? qmatmul_avx2() : nullptr;
}

namespace {

// Groups per task for `groups` row groups holding `bytes` of weights in all, n tokens: chunks of
// at least ~64 KB of weights x tokens, but never fewer chunks than threads while there are
// groups (64 KB alone would cut a small matrix, such as the per-layer-embedding gate, into fewer
// chunks than a many-core machine has threads, leaving most of them idle).
int64_t group_grain(int64_t bytes, int64_t groups, int64_t n) {
  const int64_t work = bytes / std::max<int64_t>(1, groups) * std::min<int64_t>(n, 16);
  const int64_t threads = ThreadPool::global().size();
  return std::max<int64_t>(1, std::min((int64_t(1) << 16) / std::max<int64_t>(1, work), groups / std::max<int64_t>(1, threads)));
}

// A region's own plan: n items in chunks of at least `grain`, the streams still to add.
ThreadPool::Ahead ahead_plan(int64_t n, int64_t grain) {
  ThreadPool::Ahead a;
  a.n = n;
  a.grain = grain;
  a.budget = ThreadPool::ahead_budget();
  return a;
}

// x[n, k] quantized into the calling thread's activations, which the region's tasks then read
// from the workers (a reference, so the tasks do not name a worker's own thread_local).
const QActs& quantized_on_caller(const float* x, int64_t ldx, int64_t n, int64_t k) {
  thread_local QActs acts;
  quantize_acts(x, ldx, n, k, acts);
  return acts;
}

// ys[i] (rows ldys[i] apart) = acts · ws[i]ᵀ for activations quantized already: all matrices'
// groups one region of tasks worth at least ~64 KB of weights x tokens each.
void run_matmuls_on(QMatmulFn fn, const std::vector<const QPacked*>& ws, const QActs& acts, int64_t n,
                    const std::vector<float*>& ys, const std::vector<int64_t>& ldys) {
  MB_CHECK(!ws.empty() && ws.size() == ys.size(), "qmatmul: {} weights for {} outputs", ws.size(), ys.size());
  MB_CHECK(acts.k == ws[0]->k && acts.n == n, "qmatmul: activations [{}, {}] for {} tokens of {} columns", acts.n,
           acts.k, n, ws[0]->k);
  std::vector<int64_t> first(ws.size() + 1, 0);  // global index of each matrix's first group
  int64_t bytes = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    MB_CHECK(ws[i]->k == ws[0]->k, "qmatmul: weights of {} and {} columns", ws[i]->k, ws[0]->k);
    first[i + 1] = first[i] + ws[i]->groups;
    bytes += int64_t(ws[i]->bytes());
  }
  const int64_t total = first.back(), grain = group_grain(bytes, total, n);
  ThreadPool::Ahead self = ahead_plan(total, grain);
  for (size_t i = 0; i < ws.size() && self.streams < ThreadPool::Ahead::kStreams; ++i)
    self.s[self.streams++] = {ws[i]->group(0), int32_t(first[i]), int32_t(first[i + 1]), ws[i]->group_bytes};
  ThreadPool::global().parallel_for(total, grain, [&](int64_t b, int64_t e) {
    for (size_t i = 0; i < ws.size() && b < e; ++i) {
      const int64_t lo = std::max(b, first[i]), hi = std::min(e, first[i + 1]);
      if (lo < hi) {
        fn(*ws[i], acts, ys[i], ldys[i], lo - first[i], hi - first[i], 0, n);
        if (n <= kDemoteTokens) {
          const int64_t r0 = (lo - first[i]) * kQRows, r1 = std::min(ws[i]->m, (hi - first[i]) * kQRows);
          for (int64_t t = 0; t < n; ++t) demote_to_shared_cache(ys[i] + t * ldys[i] + r0, size_t(r1 - r0) * sizeof(float));
        }
      }
    }
  }, ThreadPool::ahead_after(ws[0], self));
}

// The same for x [n, k] in floats, quantized once on the caller.
void run_matmuls(QMatmulFn fn, const std::vector<const QPacked*>& ws, const float* x, int64_t ldx, int64_t n,
                 const std::vector<float*>& ys, const std::vector<int64_t>& ldys) {
  MB_CHECK(!ws.empty(), "qmatmul: no weights");
  run_matmuls_on(fn, ws, quantized_on_caller(x, ldx, n, ws[0]->k), n, ys, ldys);
}

}  // namespace

void qmatmul(QMatmulFn fn, const QPacked& w, const float* x, int64_t ldx, int64_t n, float* y, int64_t ldy) {
  run_matmuls(fn, {&w}, x, ldx, n, {y}, {ldy});
}

namespace {

// out = gelu_tanh(acts · gateᵀ) * (acts · upᵀ) in one region whose tasks cover whole units of
// `unit` row groups; after(r0, r1) then runs in the task on its output rows [r0, r1).
template <class After>
void gate_up_region(QMatmulFn fn, const QPacked& gate, const QPacked& up, const QActs& acts, int64_t n, float* out,
                    float* u, int64_t unit, After&& after) {
  const KernelTable& K = kernels();
  const int64_t m = gate.m, units = (gate.groups + unit - 1) / unit;
  const int64_t grain = (group_grain(int64_t(gate.bytes() + up.bytes()), gate.groups, n) + unit - 1) / unit;
  ThreadPool::Ahead self = ahead_plan(units, grain);
  self.streams = 2;
  self.s[0] = {gate.group(0), 0, int32_t(units), size_t(unit) * gate.group_bytes};
  self.s[1] = {up.group(0), 0, int32_t(units), size_t(unit) * up.group_bytes};
  ThreadPool::global().parallel_for(units, grain, [&](int64_t b, int64_t e) {
    const int64_t g0 = b * unit, g1 = std::min(gate.groups, e * unit);
    fn(gate, acts, out, m, g0, g1, 0, n);
    fn(up, acts, u, m, g0, g1, 0, n);
    // The activation is elementwise with its tail on the same vector path, so applying it per
    // task gives the bits of one pass over the whole output.
    const int64_t r0 = g0 * kQRows, r1 = std::min(m, g1 * kQRows);
    for (int64_t t = 0; t < n; ++t) K.gelu_tanh_mul(out + t * m + r0, u + t * m + r0, out + t * m + r0, r1 - r0);
    after(r0, r1);
  }, ThreadPool::ahead_after(&gate, self));
}

}  // namespace

void qmatmul_gelu_mul(QMatmulFn fn, const QPacked& gate, const QPacked& up, const float* x, int64_t ldx, int64_t n,
                      float* out, float* u) {
  MB_CHECK(gate.m == up.m && gate.k == up.k, "qmatmul: gate {}x{} and up {}x{} differ", gate.m, gate.k, up.m, up.k);
  gate_up_region(fn, gate, up, quantized_on_caller(x, ldx, n, gate.k), n, out, u, 1, [](int64_t, int64_t) {});
}

void qmatmul_gated_ffn(QMatmulFn fn, const QPacked& gate, const QPacked& up, const QPacked& down, const float* x,
                       int64_t ldx, int64_t n, float* g, float* u, float* y, int64_t ldy) {
  MB_CHECK(gate.m == up.m && gate.k == up.k && down.k == gate.m && gate.m % 32 == 0,
           "qmatmul: gated FFN of gate {}x{}, up {}x{}, down {}x{}", gate.m, gate.k, up.m, up.k, down.m, down.k);
  // The down projection's activations: the caller's, filled by the first region's tasks, each
  // quantizing its own whole 32-column blocks (pairs of row groups).
  thread_local QActs mid_acts;
  QActs& mid = mid_acts;
  size_acts(mid, n, gate.m);
  const QuantizeActsFn quantize = quantize_acts_fn();
  gate_up_region(fn, gate, up, quantized_on_caller(x, ldx, n, gate.k), n, g, u, 2, [&](int64_t r0, int64_t r1) {
    const int64_t b0 = r0 / 32, b1 = r1 / 32, nb = gate.m / 32;
    quantize(g, gate.m, 0, n, b0, b1, mid);
    if (n > kDemoteTokens) return;
    for (int64_t t = 0; t < n; ++t) {  // every worker of the down projection reads all of them
      demote_to_shared_cache(mid.q.data() + t * gate.m + r0, size_t(r1 - r0));
      for (const float* v : {mid.dx.data(), mid.dsum32.data()}) demote_to_shared_cache(v + t * nb + b0, size_t(b1 - b0) * 4);
      demote_to_shared_cache(mid.qsum.data() + t * nb + b0, size_t(b1 - b0) * 4);
      demote_to_shared_cache(mid.dsum16.data() + 2 * (t * nb + b0), size_t(b1 - b0) * 8);
    }
  });
  run_matmuls_on(fn, {&down}, mid, n, {y}, {ldy});
}

void qmatmul_many(QMatmulFn fn, const std::vector<const QPacked*>& ws, const float* x, int64_t ldx, int64_t n,
                  const std::vector<float*>& ys) {
  std::vector<int64_t> ldys;
  for (const QPacked* w : ws) ldys.push_back(w->m);
  run_matmuls(fn, ws, x, ldx, n, ys, ldys);
}

}  // namespace mb::cpu
