// Scalar reference quantizers and dequantizers. Each formula keeps ggml's operation order (and so
// gguf-py's, which copies it), because bit-exactness depends on every intermediate rounding.
#include "core/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"

// A fused multiply-add rounds once where the reference rounds twice.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace mb {

namespace {

using namespace blocks;

constexpr float kGroupMaxEps = 1e-15f;

inline float h2f(uint16_t h) { return f16_to_f32(h); }
inline uint16_t f2h(float f) { return f32_to_f16(f); }

// ggml's nearest_int: round half to even by adding 1.5 * 2^23 (exact for |f| <= 2^22); plain bit
// arithmetic, so NaN or huge inputs give garbage but never undefined behaviour.
inline int nearest_int(float f) {
  float v = f + 12582912.f;
  int32_t i;
  std::memcpy(&i, &v, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// Truncation as ggml's `(int8_t)(v)` and numpy's trunc for the in-range values these quantizers
// produce; saturating so that inf/NaN inputs stay defined.
inline int trunc_clamp(float v, int hi) {
  if (!(v > 0.f)) return 0;
  if (v >= float(hi)) return hi;
  return int(v);
}

// ---- 32-element block types -------------------------------------------------------------------

// The element of largest magnitude, signed (first one on ties, as numpy's argmax).
inline float signed_absmax(const float* x, int n) {
  float amax = 0.f, max = 0.f;
  for (int j = 0; j < n; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

void quantize_q8_0(const float* x, Q8_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127;
    const float id = d ? 1.0f / d : 0.0f;
    y[b].d = f2h(d);
    for (int j = 0; j < 32; ++j) {
      const float r = std::roundf(x[j] * id);  // half away from zero, as ggml and np_roundf
      y[b].qs[j] = int8_t(r >= 127.f ? 127 : r > -128.f ? int(r) : r == r ? -128 : 0);
    }
  }
}

void quantize_q4_0(const float* x, Q4_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    const float d = signed_absmax(x, 32) / -8;
    const float id = d ? 1.0f / d : 0.0f;
    y[b].d = f2h(d);
    for (int j = 0; j < 16; ++j) {
      const int q0 = trunc_clamp(x[j] * id + 8.5f, 15), q1 = trunc_clamp(x[j + 16] * id + 8.5f, 15);
      y[b].qs[j] = uint8_t(q0 | (q1 << 4));
    }
  }
}

void quantize_q4_1(const float* x, Q4_1* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    const auto [lo, hi] = std::minmax_element(x, x + 32);
    const float min = *lo, max = *hi;
    const float d = (max - min) / 15;
    const float id = d ? 1.0f / d : 0.0f;
    y[b].d = f2h(d);
    y[b].m = f2h(min);
    for (int j = 0; j < 16; ++j) {
      const int q0 = trunc_clamp((x[j] - min) * id + 0.5f, 15);
      const int q1 = trunc_clamp((x[j + 16] - min) * id + 0.5f, 15);
      y[b].qs[j] = uint8_t(q0 | (q1 << 4));
    }
  }
}

// Q5_0/Q5_1 share the packing of 5-bit values: low nibbles in qs, bit 4 in qh.
void pack_q5(const int* q, uint8_t* qs, uint8_t* qh_bytes) {
  uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    qs[j] = uint8_t((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4));
    qh |= uint32_t((q[j] >> 4) & 1) << j;
    qh |= uint32_t((q[j + 16] >> 4) & 1) << (j + 16);
  }
  std::memcpy(qh_bytes, &qh, 4);
}

void quantize_q5_0(const float* x, Q5_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    const float d = signed_absmax(x, 32) / -16;
    const float id = d ? 1.0f / d : 0.0f;
    y[b].d = f2h(d);
    int q[32];
    for (int j = 0; j < 32; ++j) q[j] = trunc_clamp(x[j] * id + 16.5f, 31);
    pack_q5(q, y[b].qs, y[b].qh);
  }
}

void quantize_q5_1(const float* x, Q5_1* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 32) {
    const auto [lo, hi] = std::minmax_element(x, x + 32);
    const float min = *lo, max = *hi;
    const float d = (max - min) / 31;
    const float id = d ? 1.0f / d : 0.0f;
    y[b].d = f2h(d);
    y[b].m = f2h(min);
    int q[32];
    for (int j = 0; j < 32; ++j) q[j] = trunc_clamp((x[j] - min) * id + 0.5f, 31);
    pack_q5(q, y[b].qs, y[b].qh);
  }
}

void dequantize_q8_0(const Q8_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += 32) {
    const float d = h2f(x[b].d);
    for (int j = 0; j < 32; ++j) y[j] = float(x[b].qs[j]) * d;
  }
}

void dequantize_q4_0(const Q4_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += 32) {
    const float d = h2f(x[b].d);
    for (int j = 0; j < 16; ++j) {
      y[j] = float((x[b].qs[j] & 0xF) - 8) * d;
      y[j + 16] = float((x[b].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequantize_q4_1(const Q4_1* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += 32) {
    const float d = h2f(x[b].d), m = h2f(x[b].m);
    for (int j = 0; j < 16; ++j) {
      y[j] = float(x[b].qs[j] & 0xF) * d + m;
      y[j + 16] = float(x[b].qs[j] >> 4) * d + m;
    }
  }
}

inline void unpack_q5(const uint8_t* qs, const uint8_t* qh_bytes, int* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = (qs[j] & 0xF) | int(((qh >> j) & 1) << 4);
    q[j + 16] = (qs[j] >> 4) | int(((qh >> (j + 16)) & 1) << 4);
  }
}

void dequantize_q5_0(const Q5_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += 32) {
    const float d = h2f(x[b].d);
    int q[32];
    unpack_q5(x[b].qs, x[b].qh, q);
    for (int j = 0; j < 32; ++j) y[j] = float(q[j] - 16) * d;
  }
}

void dequantize_q5_1(const Q5_1* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += 32) {
    const float d = h2f(x[b].d), m = h2f(x[b].m);
    int q[32];
    unpack_q5(x[b].qs, x[b].qh, q);
    for (int j = 0; j < 32; ++j) y[j] = float(q[j]) * d + m;
  }
}

// ---- K types (256-element super-blocks) ------------------------------------------------------

// ggml's make_qkx2_quants: a scale and (non-positive) min for n values in [0, nmax], chosen by a
// weighted least-squares search over nstep+1 trial scales.
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min,
                       uint8_t* Laux, float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    std::fill(L, L + n, 0);
    *the_min = -min;
    return 0.f;
  }
  float iscale = nmax / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = uint8_t(std::max(0, std::min(nmax, l)));
    float diff = scale * L[i] + min - x[i];
    diff = diff * diff;
    best_error += weights[i] * diff;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = std::max(0, std::min(nmax, l));
      Laux[i] = uint8_t(l);
      const float w = weights[i];
      sum_l += w * l;
      sum_l2 += w * l * l;
      sum_xl += w * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * Laux[i] + this_min - x[i];
        diff = diff * diff;
        cur_error += weights[i] * diff;
      }
      if (cur_error < best_error) {
        std::copy(Laux, Laux + n, L);
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

// ggml's make_qx_quants with rmse_type 1 and no importance weights: a signed scale for values in
// [-nmax, nmax - 1], refined over 18 trial scales; L gets the values offset by nmax.
float make_qx_quants(int n, int nmax, const float* x, int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    std::fill(L, L + n, int8_t(0));
    return 0.f;
  }
  float iscale = -nmax / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = std::max(-nmax, std::min(nmax - 1, l));
    L[i] = int8_t(l + nmax);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * x[i]);
      l = std::max(-nmax, std::min(nmax - 1, l));
      const float w = x[i] * x[i];
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) {
        const int l = nearest_int(iscale * x[i]);
        L[i] = int8_t(nmax + std::max(-nmax, std::min(nmax - 1, l)));
      }
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Q4_K and Q5_K: per 32-element sub-block a scale and min from make_qkx2_quants, both re-quantized
// to 6 bits against the block's largest; then every value re-quantized against the stored scales.
// Returns the final values in L (0..nmax).
void quantize_k_scales(const float* x, int nmax, float rmin, int nstep, uint16_t& d_out, uint16_t& dmin_out,
                       uint8_t* packed, uint8_t* L) {
  uint8_t Laux[32];
  float weights[32], mins[8], scales[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, rmin, 0.1f, nstep);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  std::memset(packed, 0, 12);
  for (int j = 0; j < 8; ++j) {
    const uint8_t ls = std::min<uint8_t>(63, uint8_t(nearest_int(inv_scale * scales[j])));
    const uint8_t lm = std::min<uint8_t>(63, uint8_t(nearest_int(inv_min * mins[j])));
    if (j < 4) {
      packed[j] = ls;
      packed[j + 4] = lm;
    } else {
      packed[j + 4] = uint8_t((ls & 0xF) | ((lm & 0xF) << 4));
      packed[j - 4] |= uint8_t((ls >> 4) << 6);
      packed[j] |= uint8_t((lm >> 4) << 6);
    }
  }
  d_out = f2h(max_scale / 63.f);
  dmin_out = f2h(max_min / 63.f);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    k_scale_min(j, packed, sc, m);
    const float d = h2f(d_out) * sc;
    if (!d) continue;
    const float dm = h2f(dmin_out) * m;
    for (int i = 0; i < 32; ++i) {
      const int l = nearest_int((x[32 * j + i] + dm) / d);
      L[32 * j + i] = uint8_t(std::max(0, std::min(nmax, l)));
    }
  }
}

void quantize_q4_k(const float* x, Q4_K* y, int64_t nb) {
  uint8_t L[256];
  for (int64_t b = 0; b < nb; ++b, x += 256) {
    quantize_k_scales(x, 15, -1.f, 20, y[b].d, y[b].dmin, y[b].scales, L);
    for (int g = 0; g < 4; ++g)
      for (int l = 0; l < 32; ++l) y[b].qs[32 * g + l] = uint8_t(L[64 * g + l] | (L[64 * g + 32 + l] << 4));
  }
}

void quantize_q5_k(const float* x, Q5_K* y, int64_t nb) {
  uint8_t L[256];
  for (int64_t b = 0; b < nb; ++b, x += 256) {
    quantize_k_scales(x, 31, -0.5f, 15, y[b].d, y[b].dmin, y[b].scales, L);
    std::memset(y[b].qh, 0, 32);
    for (int g = 0; g < 4; ++g)
      for (int l = 0; l < 32; ++l) {
        const int l1 = L[64 * g + l], l2 = L[64 * g + 32 + l];
        y[b].qh[l] |= uint8_t(((l1 >> 4) << (2 * g)) | ((l2 >> 4) << (2 * g + 1)));
        y[b].qs[32 * g + l] = uint8_t((l1 & 0xF) | ((l2 & 0xF) << 4));
      }
  }
}

void quantize_q6_k(const float* x, Q6_K* y, int64_t nb) {
  int8_t L[256];
  float scales[16];
  for (int64_t b = 0; b < nb; ++b, x += 256) {
    float max_scale = 0, max_abs_scale = 0;
    for (int s = 0; s < 16; ++s) {
      scales[s] = make_qx_quants(16, 32, x + 16 * s, L + 16 * s);
      if (std::fabs(scales[s]) > max_abs_scale) {
        max_abs_scale = std::fabs(scales[s]);
        max_scale = scales[s];
      }
    }
    if (max_abs_scale < kGroupMaxEps) {
      std::memset(&y[b], 0, sizeof(Q6_K));
      continue;
    }
    const float iscale = -128.f / max_scale;
    y[b].d = f2h(1 / iscale);
    for (int s = 0; s < 16; ++s) y[b].scales[s] = int8_t(std::min(127, nearest_int(iscale * scales[s])));
    for (int s = 0; s < 16; ++s) {
      const float d = h2f(y[b].d) * y[b].scales[s];
      if (!d) continue;
      for (int i = 0; i < 16; ++i) {
        const int l = nearest_int(x[16 * s + i] / d);
        L[16 * s + i] = int8_t(std::max(-32, std::min(31, l)) + 32);
      }
    }
    for (int h = 0; h < 2; ++h) {
      uint8_t* ql = y[b].ql + 64 * h;
      uint8_t* qh = y[b].qh + 32 * h;
      const int8_t* Lh = L + 128 * h;
      for (int l = 0; l < 32; ++l) {
        ql[l] = uint8_t((Lh[l] & 0xF) | ((Lh[l + 64] & 0xF) << 4));
        ql[l + 32] = uint8_t((Lh[l + 32] & 0xF) | ((Lh[l + 96] & 0xF) << 4));
        qh[l] = uint8_t((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) | ((Lh[l + 64] >> 4) << 4) | ((Lh[l + 96] >> 4) << 6));
      }
    }
  }
}

// Q4_K and Q5_K: 64-element groups, low nibbles with sub-block 2g, high nibbles with 2g + 1; Q5_K
// adds bit 2g / 2g + 1 of qh as the fifth bit.
template <bool kFifthBit, class Block>
void dequantize_q45_k(const Block* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = h2f(x[b].d), dmin = h2f(x[b].dmin);
    for (int g = 0; g < 4; ++g, y += 64) {
      int sc, m;
      k_scale_min(2 * g, x[b].scales, sc, m);
      const float d1 = d * sc, m1 = dmin * m;
      k_scale_min(2 * g + 1, x[b].scales, sc, m);
      const float d2 = d * sc, m2 = dmin * m;
      const uint8_t* q = x[b].qs + 32 * g;
      for (int l = 0; l < 32; ++l) {
        int lo = q[l] & 0xF, hi = q[l] >> 4;
        if constexpr (kFifthBit) {
          lo |= ((x[b].qh[l] >> (2 * g)) & 1) << 4;
          hi |= ((x[b].qh[l] >> (2 * g + 1)) & 1) << 4;
        }
        y[l] = d1 * float(lo) - m1;
        y[32 + l] = d2 * float(hi) - m2;
      }
    }
  }
}

void dequantize_q6_k(const Q6_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = h2f(x[b].d);
    for (int h = 0; h < 2; ++h, y += 128) {
      const uint8_t* ql = x[b].ql + 64 * h;
      const uint8_t* qh = x[b].qh + 32 * h;
      const int8_t* sc = x[b].scales + 8 * h;
      for (int l = 0; l < 32; ++l) {
        const int s = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * float(sc[s]) * float(q1);
        y[l + 32] = d * float(sc[s + 2]) * float(q2);
        y[l + 64] = d * float(sc[s + 4]) * float(q3);
        y[l + 96] = d * float(sc[s + 6]) * float(q4);
      }
    }
  }
}

}  // namespace

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
  dtype_row_bytes(t, n);  // rejects partial blocks
  const int64_t nb = n / dtype_block_size(t);
  switch (t) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_f16(src[i]);
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_bf16(src[i]);
      return;
    case DType::Q8_0: return quantize_q8_0(src, static_cast<Q8_0*>(dst), nb);
    case DType::Q4_0: return quantize_q4_0(src, static_cast<Q4_0*>(dst), nb);
    case DType::Q4_1: return quantize_q4_1(src, static_cast<Q4_1*>(dst), nb);
    case DType::Q5_0: return quantize_q5_0(src, static_cast<Q5_0*>(dst), nb);
    case DType::Q5_1: return quantize_q5_1(src, static_cast<Q5_1*>(dst), nb);
    case DType::Q4_K: return quantize_q4_k(src, static_cast<Q4_K*>(dst), nb);
    case DType::Q5_K: return quantize_q5_k(src, static_cast<Q5_K*>(dst), nb);
    case DType::Q6_K: return quantize_q6_k(src, static_cast<Q6_K*>(dst), nb);
    default: fail("cannot quantize to {}", dtype_name(t));
  }
}

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  dtype_row_bytes(t, n);
  const int64_t nb = n / dtype_block_size(t);
  switch (t) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
      return;
    case DType::Q8_0: return dequantize_q8_0(static_cast<const Q8_0*>(src), dst, nb);
    case DType::Q4_0: return dequantize_q4_0(static_cast<const Q4_0*>(src), dst, nb);
    case DType::Q4_1: return dequantize_q4_1(static_cast<const Q4_1*>(src), dst, nb);
    case DType::Q5_0: return dequantize_q5_0(static_cast<const Q5_0*>(src), dst, nb);
    case DType::Q5_1: return dequantize_q5_1(static_cast<const Q5_1*>(src), dst, nb);
    case DType::Q4_K: return dequantize_q45_k<false>(static_cast<const Q4_K*>(src), dst, nb);
    case DType::Q5_K: return dequantize_q45_k<true>(static_cast<const Q5_K*>(src), dst, nb);
    case DType::Q6_K: return dequantize_q6_k(static_cast<const Q6_K*>(src), dst, nb);
    default: fail("cannot dequantize {}", dtype_name(t));
  }
}

float vec_dot_ref(DType t, const void* row, const float* x, int64_t n) {
  dtype_row_bytes(t, n);
  const int64_t bs = dtype_is_quantized(t) ? dtype_block_size(t) : std::min<int64_t>(n, 256);
  const size_t bb = dtype_row_bytes(t, bs);
  std::vector<float> w(static_cast<size_t>(bs));
  double sum = 0;
  const uint8_t* p = static_cast<const uint8_t*>(row);
  for (int64_t i = 0; i < n; i += bs, p += bb) {
    const int64_t m = std::min(bs, n - i);  // plain types: a shorter last chunk
    dequantize_row(t, p, w.data(), m);
    for (int64_t j = 0; j < m; ++j) sum += double(w[size_t(j)]) * double(x[i + j]);
  }
  return float(sum);
}

}  // namespace mb
