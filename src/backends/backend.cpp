// Checks shared by every backend's ops (backend.h).
#include "backends/backend.h"

namespace mb {

Backend::Im2colShape Backend::im2col_shape(const Tensor& x, const Im2col& c, int64_t row0, const Tensor& cols) {
  MB_CHECK(x.rank() == 3 && cols.rank() == 3 && c.kernel > 0 && c.stride > 0 && c.pad >= 0,
           "im2col: x {} and cols {} should be [H, W, C] and [rows, W', C·k·k] (kernel {}, stride {}, pad {})",
           x.shape_str(), cols.shape_str(), c.kernel, c.stride, c.pad);
  Im2colShape s{};
  s.h = x.dim(0);
  s.w = x.dim(1);
  s.c = x.dim(2);
  s.ho = (s.h + 2 * c.pad - c.kernel) / c.stride + 1;
  s.wo = (s.w + 2 * c.pad - c.kernel) / c.stride + 1;
  s.rows = cols.dim(0);
  s.patch = s.c * c.kernel * c.kernel;
  MB_CHECK(s.ho > 0 && s.wo > 0 && row0 >= 0 && row0 + s.rows <= s.ho && cols.dim(1) == s.wo && cols.dim(2) == s.patch,
           "im2col: cols {} from row {} does not fit the {}x{} grid of {} patches of x {}", cols.shape_str(), row0,
           s.ho, s.wo, s.patch, x.shape_str());
  return s;
}

Backend::LocalAttentionShape Backend::local_attention_shape(const Tensor& q, const Tensor& k, const Tensor& v,
                                                            const Tensor& q_gain, const Tensor& rel_keys,
                                                            const LocalAttention& p, const Tensor& out) {
  MB_CHECK(q.rank() == 3 && k.shape == q.shape && v.shape == q.shape && out.shape == q.shape,
           "local_attention: q {}, k {}, v {} and out {} should be one [n, heads, head_dim] shape", q.shape_str(),
           k.shape_str(), v.shape_str(), out.shape_str());
  const LocalAttentionShape s{q.dim(0), q.dim(1), q.dim(2)};
  MB_CHECK(p.chunk > 0 && p.left > 0 && p.context > 0 && p.logit_cap > 0 && p.rel_offset >= 0 && p.valid != nullptr,
           "local_attention: chunk {}, left {}, context {}, soft-cap {}, relative offset {}{}", p.chunk, p.left,
           p.context, p.logit_cap, p.rel_offset, p.valid ? "" : ", no frame mask");
  MB_CHECK(q_gain.numel() == s.hd && rel_keys.cols() == s.heads * s.hd && rel_keys.rows() >= p.left + p.rel_offset,
           "local_attention: q_gain {} and relative keys {} do not fit {} heads of {} and {} distances from row {}",
           q_gain.shape_str(), rel_keys.shape_str(), s.heads, s.hd, p.left, p.rel_offset);
  return s;
}

}  // namespace mb
