// A backend that times every op of another one, for `markbase bench --profile`: where a prefill's
// or a decode step's time goes, op by op, with each matmul weight shape on its own line and its
// weight bytes per second (the figure a memory-bound decode is judged by). It forwards each call
// unchanged, so results are the wrapped backend's bit for bit. Times are host wall clock around
// the call, with the wrapped backend synchronised before and after, unless the backend can put
// timestamps into its op stream (a GPU): then an op's time is the device's, from a mark before it
// to one after it, and the device's idle time between ops is an entry of its own. Marks keep
// the host issuing ahead, but kernels no longer overlap across them (no programmatic launch).
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "backends/backend.h"

namespace mb {

class ProfilingBackend : public Backend {
 public:
  explicit ProfilingBackend(Backend& inner) : in_(inner), marks_(inner.can_mark()) {}

  struct Entry {
    std::string label;     // "matmul 6144x1536 q4_0", "attention", ...
    int64_t calls = 0;
    double seconds = 0;
    double weight_bytes = 0;  // bytes of weights the calls read (matmuls), else 0
    bool host = false;        // time on the host between ops (host_time), not in the ops' total
  };
  // Entries sorted by time, most first.
  std::vector<Entry> entries() const;
  // Timing happens only while enabled (prefill and decode are profiled apart); reset drops it.
  void set_enabled(bool on) {
    if (!on) collect_marks();
    enabled_ = on;
  }
  void reset() { stats_.clear(); }
  // The entries as a table: a title line, then ms, share of the ops' time, calls, weight GB/s, op.
  std::string table(const std::string& title);
  // That table's header and rows, slowest first, for entries summed over `units` (a run, the steps
  // of a phase): ms and calls per unit, the share of `total_seconds`, the weights' bytes per second.
  static std::string format_rows(std::vector<Entry> rows, double total_seconds, double units = 1);

  std::string name() const override { return in_.name(); }
  Device device() const override { return in_.device(); }
  Tensor alloc(DType dtype, std::vector<int64_t> shape) override;
  Tensor scratch(DType dtype, std::vector<int64_t> shape) override;
  Tensor prepare_weight(const Tensor& src, DType dtype, WeightUse use) override {
    return in_.prepare_weight(src, dtype, use);
  }
  bool supports_weight_dtype(DType dtype) const override { return in_.supports_weight_dtype(dtype); }
  DType kv_dtype() const override { return in_.kv_dtype(); }
  int64_t ffn_rows_per_call() const override { return in_.ffn_rows_per_call(); }
  void synchronize() override { in_.synchronize(); }
  void host_time(const char* what, double seconds) override;
  void stage(const std::vector<HostArray>& arrays) override { in_.stage(arrays); }
  // Recording would hide the ops from the timer: a profiled run issues every op.
  void kv_write_batch(const Tensor& k, const Tensor& v, const std::vector<AttentionSeq>& seqs) override;
  void matmul(const Tensor& x, const Tensor& w, Tensor& y) override;
  void matmul_clipped(const Tensor& x, const Tensor& w, const Clip& clip, Tensor& y, Activation act,
                      const Tensor* times) override;
  void matmuls(const Tensor& x, const std::vector<const Tensor*>& ws, const std::vector<Tensor*>& ys) override;
  void matmul_gelu_mul(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, Tensor& out) override;
  void matmul_gelu_times(const Tensor& x, const Tensor& w, const Tensor& m, Tensor& out) override;
  void attention_inputs(Tensor& q, Tensor* k, Tensor* v, const AttentionInputs& p,
                        const std::vector<AttentionSeq>& writes) override;
  void gated_ffn(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down, Tensor& out) override;
  void embed(const Tensor& table, const int32_t* ids, int64_t n, float scale, Tensor& out) override;
  void rms_norm(const Tensor& x, const Tensor* w, float eps, bool add_one, Tensor& y) override;
  void rope(Tensor& x, const int32_t* pos, const float* inv_freq) override;
  void rms_norm_rope(Tensor& x, const Tensor* w, float eps, bool add_one, const int32_t* pos,
                     const float* inv_freq) override;
  void add_rms_norm(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one, float scale) override;
  void add_rms_norm_norm(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one, float scale,
                         const Tensor* w_next, Tensor& y) override;
  void kv_write(KVStore& kv, const Tensor& k, const Tensor& v, const int32_t* pos) override;
  void attention(const Tensor& q, const KVStore& kv, const int32_t* pos, const AttentionParams& p,
                 Tensor& out) override;
  void attention_batch(const Tensor& q, const std::vector<AttentionSeq>& seqs, const AttentionParams& p,
                       Tensor& out) override;
  void gelu_tanh_mul(const Tensor& gate, const Tensor& up, Tensor& out) override;
  void add(const Tensor& a, const Tensor& b, Tensor& out) override;
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override;
  void scale(Tensor& x, float s) override;
  void softcap(Tensor& x, float cap) override;
  void clamp(Tensor& x, float lo, float hi) override;
  void clamp_into(const Tensor& x, float lo, float hi, Tensor& out) override;
  void silu(Tensor& x) override;
  void layer_norm(const Tensor& x, const Tensor& w, const Tensor* b, float eps, bool relu, Tensor& y) override;
  void im2col(const Tensor& x, const uint8_t* row_valid, const Im2col& c, int64_t row0, Tensor& cols) override;
  void glu_causal_conv(const Tensor& g, const Tensor& w, Tensor& out) override;
  void local_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_gain, const Tensor& rel_keys,
                       const LocalAttention& p, Tensor& out) override;
  void route_topk(const Tensor& logits, int k, const Tensor* per_expert_scale, Tensor& weights,
                  Tensor& experts) override;
  void moe_gated_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down, const Tensor& weights,
                         const Tensor& experts, Tensor& out) override;
  void slice_cols(const Tensor& src, int64_t begin, Tensor& dst) override;
  void gather_rows(const Tensor& src, const int32_t* rows, int64_t n, Tensor& dst) override;
  void gather_sum_rows(const Tensor& src, const int32_t* rows, int64_t group, float scale, Tensor& dst) override;
  void copy(const Tensor& src, Tensor& dst) override;
  void to_host(const Tensor& src, void* dst) override;
  void argmax_rows(const Tensor& x, Tensor& ids) override;
  void upload(const void* src, Tensor& dst) override;

 private:
  // Op name, and for matmuls the (first) weight's rows, columns, dtype and how many weights.
  using Key = std::tuple<const char*, int64_t, int64_t, int, size_t>;
  template <class F> void timed(const Key& key, double weight_bytes, F&& f);
  template <class F> void timed(const char* op, F&& f) { timed(Key{op, 0, 0, -1, 0}, 0.0, f); }

  void collect_marks();  // the device's times of the ops in pending_ into stats_

  Backend& in_;
  bool enabled_ = false;
  const bool marks_;
  std::vector<std::pair<Key, double>> pending_;  // ops marked but not yet read back, and their weight bytes
  std::map<Key, Entry> stats_;
};

}  // namespace mb
