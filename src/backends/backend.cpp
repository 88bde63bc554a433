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

int64_t Backend::add_operand(const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t n = a.numel(), bn = b.numel();
  MB_CHECK(out.numel() == n && bn > 0 && n % bn == 0 && (bn == n || bn == a.cols()),
           "add: sizes {} and {} do not broadcast", a.shape_str(), b.shape_str());
  return bn;
}

void Backend::check_glu_causal_conv(const Tensor& g, const Tensor& w, const Tensor& out) {
  const int64_t n = out.rows(), D = out.cols();
  MB_CHECK(g.rows() == n && g.cols() == 2 * D && w.rows() == D && w.cols() > 0 && w.dtype == DType::F32,
           "glu_causal_conv: g {} and w {} {} do not fit out {}", g.shape_str(), dtype_name(w.dtype), w.shape_str(),
           out.shape_str());
}

void Backend::check_gather_sum_rows(const Tensor& src, const int32_t* rows, int64_t group, const Tensor& dst) {
  MB_CHECK(dst.cols() == src.cols() && group > 0, "gather_sum_rows: groups of {} rows of {} into {}", group,
           src.shape_str(), dst.shape_str());
  for (int64_t i = 0; i < dst.rows() * group; ++i)
    MB_CHECK(rows[i] >= 0 && rows[i] < src.rows(), "gather_sum_rows: row {} out of range", rows[i]);
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
