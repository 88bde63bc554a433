#include "backends/profiling_backend.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/dtype.h"

namespace mb {

template <class F> void ProfilingBackend::timed(const Key& key, double weight_bytes, F&& f) {
  if (!enabled_) return f();
  if (marks_) {
    in_.mark();
    f();
    in_.mark();
    pending_.emplace_back(key, weight_bytes);
    if (pending_.size() >= 4096) collect_marks();  // bounds the events in flight
    return;
  }
  in_.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  in_.synchronize();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Entry& e = stats_[key];
  ++e.calls;
  e.seconds += s;
  e.weight_bytes += weight_bytes;
}

void ProfilingBackend::collect_marks() {
  if (pending_.empty()) return;
  const std::vector<double> d = in_.marked_seconds();  // op, gap, op, gap, ..., op
  for (size_t i = 0; i < pending_.size() && 2 * i < d.size(); ++i) {
    Entry& e = stats_[pending_[i].first];
    ++e.calls;
    e.seconds += d[2 * i];
    e.weight_bytes += pending_[i].second;
    if (2 * i + 1 < d.size()) stats_[Key{"(device idle between ops)", 0, 0, -1, 0}].seconds += d[2 * i + 1];
  }
  pending_.clear();
}

// A host row's key: an op name in parentheses with dtype -2, so the table's total and shares leave it out (the
// device's idle row already holds that time where the backend is asynchronous; a synchronous one's op rows
// leave it out).
void ProfilingBackend::host_time(const char* what, double seconds) {
  if (!enabled_) return;
  Entry& e = stats_[Key{what, 0, 0, -2, 0}];
  ++e.calls;
  e.seconds += seconds;
}

std::vector<ProfilingBackend::Entry> ProfilingBackend::entries() const {
  std::vector<Entry> out;
  for (const auto& [key, e] : stats_) {
    Entry r = e;
    const auto& [op, rows, cols, dtype, n_weights] = key;
    r.label = dtype == -2 ? fmt::format("(host) {}", op)
              : dtype < 0 ? std::string(op)
                          : fmt::format("{} {}x{} {}", op, rows, cols, dtype_name(DType(dtype)));
    r.host = dtype == -2;
    if (n_weights > 1) r.label += fmt::format(" (+{} more)", n_weights - 1);
    out.push_back(std::move(r));
  }
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) { return a.seconds > b.seconds; });
  return out;
}

std::string ProfilingBackend::table(const std::string& title) {
  collect_marks();
  const std::vector<Entry> rows = entries();
  double total = 0;
  for (const Entry& e : rows) total += e.host ? 0.0 : e.seconds;
  std::string out = fmt::format("{}: {:.3f} s in backend ops{}\n", title, total,
                                marks_ ? " (device time from marks in its stream; the idle gaps between ops are a row)" : "");
  return out + format_rows(rows, total);
}

std::string ProfilingBackend::format_rows(std::vector<Entry> rows, double total_seconds, double units) {
  std::sort(rows.begin(), rows.end(), [](const Entry& a, const Entry& b) { return a.seconds > b.seconds; });
  std::string out = fmt::format("  {:>10} {:>7} {:>10} {:>12}  {}\n", "ms", "share", "calls", "weight GB/s", "op");
  for (const Entry& e : rows) {
    const std::string gbs =
        e.weight_bytes > 0 && e.seconds > 0 ? fmt::format("{:.1f}", e.weight_bytes / e.seconds / 1e9) : "";
    out += fmt::format("  {:>10.3f} {:>6.1f}% {:>10.6g} {:>12}  {}\n", e.seconds * 1e3 / units,
                       total_seconds > 0 ? 100 * e.seconds / total_seconds : 0.0, double(e.calls) / units, gbs,
                       e.label);
  }
  return out;
}

Tensor ProfilingBackend::alloc(DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  timed("alloc", [&] { t = in_.alloc(dtype, std::move(shape)); });
  return t;
}

Tensor ProfilingBackend::scratch(DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  timed("scratch", [&] { t = in_.scratch(dtype, std::move(shape)); });
  return t;
}

void ProfilingBackend::matmul(const Tensor& x, const Tensor& w, Tensor& y) {
  timed(Key{"matmul", w.rows(), w.cols(), int(w.dtype), 1}, double(w.nbytes()), [&] { in_.matmul(x, w, y); });
}

void ProfilingBackend::matmul_clipped(const Tensor& x, const Tensor& w, const Clip& clip, Tensor& y, Activation act,
                                      const Tensor* times) {
  const char* op = act == Activation::Silu ? "matmul_clipped_silu"
                   : act == Activation::GeluTanhTimes ? "matmul_clipped_gelu_times"
                                                       : "matmul_clipped";
  timed(Key{op, w.rows(), w.cols(), int(w.dtype), 1}, double(w.nbytes()),
        [&] { in_.matmul_clipped(x, w, clip, y, act, times); });
}

void ProfilingBackend::matmuls(const Tensor& x, const std::vector<const Tensor*>& ws, const std::vector<Tensor*>& ys) {
  if (ws.empty()) return in_.matmuls(x, ws, ys);
  double bytes = 0;
  for (const Tensor* w : ws) bytes += double(w->nbytes());
  timed(Key{"matmuls", ws[0]->rows(), ws[0]->cols(), int(ws[0]->dtype), ws.size()}, bytes,
        [&] { in_.matmuls(x, ws, ys); });
}

void ProfilingBackend::matmul_gelu_mul(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, Tensor& out) {
  timed(Key{"matmul_gelu_mul", w_gate.rows(), w_gate.cols(), int(w_gate.dtype), 2},
        double(w_gate.nbytes() + w_up.nbytes()), [&] { in_.matmul_gelu_mul(x, w_gate, w_up, out); });
}

void ProfilingBackend::gated_ffn(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down,
                                 Tensor& out) {
  timed(Key{"gated_ffn", w_gate.rows(), w_gate.cols(), int(w_gate.dtype), 3},
        double(w_gate.nbytes() + w_up.nbytes() + w_down.nbytes()), [&] { in_.gated_ffn(x, w_gate, w_up, w_down, out); });
}

void ProfilingBackend::embed(const Tensor& table, const int32_t* ids, int64_t n, float scale, Tensor& out) {
  timed("embed", [&] { in_.embed(table, ids, n, scale, out); });
}
void ProfilingBackend::rms_norm(const Tensor& x, const Tensor* w, float eps, bool add_one, Tensor& y) {
  timed("rms_norm", [&] { in_.rms_norm(x, w, eps, add_one, y); });
}
void ProfilingBackend::rope(Tensor& x, const int32_t* pos, const float* inv_freq) {
  timed("rope", [&] { in_.rope(x, pos, inv_freq); });
}
void ProfilingBackend::rms_norm_rope(Tensor& x, const Tensor* w, float eps, bool add_one, const int32_t* pos,
                                     const float* inv_freq) {
  timed("rms_norm_rope", [&] { in_.rms_norm_rope(x, w, eps, add_one, pos, inv_freq); });
}
void ProfilingBackend::add_rms_norm(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one, float scale) {
  timed("add_rms_norm", [&] { in_.add_rms_norm(x, branch, w, eps, add_one, scale); });
}
void ProfilingBackend::kv_write(KVStore& kv, const Tensor& k, const Tensor& v, const int32_t* pos) {
  timed("kv_write", [&] { in_.kv_write(kv, k, v, pos); });
}
void ProfilingBackend::add_rms_norm_norm(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one,
                                         float scale, const Tensor* w_next, Tensor& y) {
  timed("add_rms_norm_norm", [&] { in_.add_rms_norm_norm(x, branch, w, eps, add_one, scale, w_next, y); });
}
void ProfilingBackend::matmul_gelu_times(const Tensor& x, const Tensor& w, const Tensor& m, Tensor& out) {
  timed("matmul_gelu_times", [&] { in_.matmul_gelu_times(x, w, m, out); });
}
void ProfilingBackend::attention_inputs(Tensor& q, Tensor* k, Tensor* v, const AttentionInputs& p,
                                        const std::vector<AttentionSeq>& writes) {
  timed("attention_inputs", [&] { in_.attention_inputs(q, k, v, p, writes); });
}
void ProfilingBackend::kv_write_batch(const Tensor& k, const Tensor& v, const std::vector<AttentionSeq>& seqs) {
  timed("kv_write", [&] { in_.kv_write_batch(k, v, seqs); });
}
void ProfilingBackend::attention(const Tensor& q, const KVStore& kv, const int32_t* pos, const AttentionParams& p,
                                 Tensor& out) {
  timed("attention", [&] { in_.attention(q, kv, pos, p, out); });
}
void ProfilingBackend::attention_batch(const Tensor& q, const std::vector<AttentionSeq>& seqs,
                                       const AttentionParams& p, Tensor& out) {
  timed("attention", [&] { in_.attention_batch(q, seqs, p, out); });
}
void ProfilingBackend::gelu_tanh_mul(const Tensor& gate, const Tensor& up, Tensor& out) {
  timed("gelu_tanh_mul", [&] { in_.gelu_tanh_mul(gate, up, out); });
}
void ProfilingBackend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  timed("add", [&] { in_.add(a, b, out); });
}
void ProfilingBackend::mul(const Tensor& a, const Tensor& b, Tensor& out) {
  timed("mul", [&] { in_.mul(a, b, out); });
}
void ProfilingBackend::scale(Tensor& x, float s) {
  timed("scale", [&] { in_.scale(x, s); });
}
void ProfilingBackend::softcap(Tensor& x, float cap) {
  timed("softcap", [&] { in_.softcap(x, cap); });
}
void ProfilingBackend::clamp(Tensor& x, float lo, float hi) {
  timed("clamp", [&] { in_.clamp(x, lo, hi); });
}
void ProfilingBackend::clamp_into(const Tensor& x, float lo, float hi, Tensor& out) {
  timed("clamp_into", [&] { in_.clamp_into(x, lo, hi, out); });
}
void ProfilingBackend::silu(Tensor& x) {
  timed("silu", [&] { in_.silu(x); });
}
void ProfilingBackend::layer_norm(const Tensor& x, const Tensor& w, const Tensor* b, float eps, bool relu, Tensor& y) {
  timed("layer_norm", [&] { in_.layer_norm(x, w, b, eps, relu, y); });
}
void ProfilingBackend::im2col(const Tensor& x, const uint8_t* row_valid, const Im2col& c, int64_t row0,
                              Tensor& cols) {
  timed("im2col", [&] { in_.im2col(x, row_valid, c, row0, cols); });
}
void ProfilingBackend::glu_causal_conv(const Tensor& g, const Tensor& w, Tensor& out) {
  timed("glu_causal_conv", [&] { in_.glu_causal_conv(g, w, out); });
}
void ProfilingBackend::local_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_gain,
                                       const Tensor& rel_keys, const LocalAttention& p, Tensor& out) {
  timed("local_attention", [&] { in_.local_attention(q, k, v, q_gain, rel_keys, p, out); });
}
void ProfilingBackend::route_topk(const Tensor& logits, int k, const Tensor* per_expert_scale, Tensor& weights,
                                  Tensor& experts) {
  timed("route_topk", [&] { in_.route_topk(logits, k, per_expert_scale, weights, experts); });
}
void ProfilingBackend::moe_gated_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down,
                                         const Tensor& weights, const Tensor& experts, Tensor& out) {
  timed("moe_gated_experts", [&] { in_.moe_gated_experts(x, gate_up, down, weights, experts, out); });
}
void ProfilingBackend::slice_cols(const Tensor& src, int64_t begin, Tensor& dst) {
  timed("slice_cols", [&] { in_.slice_cols(src, begin, dst); });
}
void ProfilingBackend::gather_rows(const Tensor& src, const int32_t* rows, int64_t n, Tensor& dst) {
  timed("gather_rows", [&] { in_.gather_rows(src, rows, n, dst); });
}
void ProfilingBackend::gather_sum_rows(const Tensor& src, const int32_t* rows, int64_t group, float scale,
                                       Tensor& dst) {
  timed("gather_sum_rows", [&] { in_.gather_sum_rows(src, rows, group, scale, dst); });
}
void ProfilingBackend::copy(const Tensor& src, Tensor& dst) {
  timed("copy", [&] { in_.copy(src, dst); });
}
void ProfilingBackend::to_host(const Tensor& src, void* dst) {
  timed("to_host", [&] { in_.to_host(src, dst); });
}
void ProfilingBackend::argmax_rows(const Tensor& x, Tensor& ids) {
  timed("argmax_rows", [&] { in_.argmax_rows(x, ids); });
}
void ProfilingBackend::upload(const void* src, Tensor& dst) {
  timed("upload", [&] { in_.upload(src, dst); });
}

}  // namespace mb
