// The CUDA backend: device memory, staging of a step's host arrays, recorded steps (CUDA graphs)
// and the dispatch of backend.h's ops to the kernels in this folder and to cuBLAS.
//
// Everything runs on one stream, in order, so memory a finished op released can be handed to the
// next op at once (the scratch pool) and a recording replays against the same buffers it saw.
#include "backends/cuda/cuda_backend.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "backends/cuda/cuda_kernels.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace mb::cuda {

std::atomic<uint64_t> g_device_calls{0};

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail("CUDA: {} failed: {}", what, cudaGetErrorString(e));
}

void check_call(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("CUDA: {} failed: {}", what, cudaGetErrorString(e));
}

bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MARKBASE_CUDA_PDL");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

bool gemv_early_loads() {
  static const bool on = [] {
    const char* v = std::getenv("MARKBASE_CUDA_EARLY_LOADS");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

int attention_waves() {
  static const int n = [] {
    const char* v = std::getenv("MARKBASE_CUDA_ATTN_WAVES");
    return v ? std::max(1, std::atoi(v)) : 2;
  }();
  return n;
}

int gemv_resident_waves() {
  static const int n = [] {
    const char* v = std::getenv("MARKBASE_CUDA_GEMV_WAVES");
    return v ? std::max(0, std::atoi(v)) : 2;
  }();
  return n;
}

namespace {

void check(cudaError_t e, const char* what) {
  g_device_calls.fetch_add(1, std::memory_order_relaxed);
  if (e != cudaSuccess) fail("CUDA: {} failed: {}", what, cudaGetErrorString(e));
}
void check_blas(cublasStatus_t s, const char* what) {
  g_device_calls.fetch_add(1, std::memory_order_relaxed);
  if (s != CUBLAS_STATUS_SUCCESS) fail("cuBLAS: {} failed (status {})", what, int(s));
}

std::string mib(size_t b) { return fmt::format("{:.0f} MiB", double(b) / (1 << 20)); }

// Device memory for op outputs, kept for reuse in size classes (4 per power of two).
class ScratchPool {
 public:
  ~ScratchPool() {
    for (auto& [size, v] : free_)
      for (void* p : v) cudaFree(p);
  }
  static size_t size_class(size_t b) {
    if (b <= 4096) return 4096;
    size_t c = size_t(1) << (63 - __builtin_clzll(b));
    const size_t step = c / 4;
    return (b + step - 1) / step * step;
  }
  void* take(size_t bytes) {
    const size_t c = size_class(bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(c);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        return p;
      }
    }
    void* p = nullptr;
    if (cudaMalloc(&p, c) != cudaSuccess) {
      cudaGetLastError();
      release_all();
      if (cudaMalloc(&p, c) != cudaSuccess) {
        cudaGetLastError();
        size_t free_b = 0, total = 0;
        cudaMemGetInfo(&free_b, &total);
        fail("out of GPU memory: activations of {} do not fit ({} free of {})", mib(c), mib(free_b), mib(total));
      }
    }
    return p;
  }
  void give(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[size_class(bytes)].push_back(p);
  }
  void release_all() {
    std::lock_guard<std::mutex> lock(mu_);
    cudaDeviceSynchronize();
    for (auto& [size, v] : free_)
      for (void* p : v) cudaFree(p);
    free_.clear();
  }

 private:
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
};

WType wtype_of(DType d) {
  switch (d) {
    case DType::F32: return WType::F32;
    case DType::BF16: return WType::BF16;
    case DType::Q8_0: return WType::Q8_0;
    case DType::Q4_0: return WType::Q4_0;
    case DType::Q4_K: return WType::Q4_K;
    default: fail("cuda backend: no kernels for weight dtype {}", dtype_name(d));
  }
}

// The dtype a weight asked for in `d` is kept in on the GPU: the block types without kernels here
// (Q4_1, Q5_x, Q5_K, Q6_K) become Q8_0 (at least as precise, a little larger), F16 becomes F32
// (exact).
DType gpu_dtype(DType d) {
  switch (d) {
    case DType::F32: case DType::BF16: case DType::Q8_0: case DType::Q4_0: case DType::Q4_K: return d;
    case DType::F16: return DType::F32;
    default: return dtype_is_quantized(d) ? DType::Q8_0 : d;
  }
}

bool is_quantized(WType t) { return t == WType::Q8_0 || t == WType::Q4_0 || t == WType::Q4_K; }

// A weight's GPU description: Tensor::packed of what prepare_weight returns.
struct WeightHold {
  GpuWeight w;
};

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device), cpu_(make_cpu_backend()), pool_(std::make_shared<ScratchPool>()) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      cudaGetLastError();
      fail("device 'cuda': no CUDA GPU is visible (driver missing or no device); use --device cpu");
    }
    MB_CHECK(device < n, "device 'cuda': GPU {} does not exist ({} visible)", device, n);
    check(cudaSetDevice(device), "selecting the GPU");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "reading the GPU's properties");
    gpu_name_ = prop.name;
    sm90_ = prop.major == 9 && prop.minor == 0;
    MB_CHECK(prop.major >= 9, "device 'cuda': {} has compute capability {}.{}; this build's kernels are for 9.0 "
             "(Hopper: H100, H200) or newer",
             gpu_name_, prop.major, prop.minor);
    check(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking), "creating a stream");
    check(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming), "creating an event");
    check_blas(cublasCreate(&blas_), "creating a handle");
    check_blas(cublasSetStream(blas_, st_), "setting the stream");
    // A fixed workspace, so that cuBLAS allocates nothing while a step is recorded.
    check(cudaMalloc(&blas_ws_, kBlasWorkspace), "allocating cuBLAS's workspace");
    check_blas(cublasSetWorkspace(blas_, blas_ws_, kBlasWorkspace), "setting the workspace");
    check_blas(cublasLtCreate(&lt_), "creating a cuBLASLt handle");
    graphs_on_ = env_int("MARKBASE_CUDA_GRAPHS", 1) != 0;
    bf16_copies_ = env_int("MARKBASE_CUDA_BF16_COPIES", -1);
    gemv_rows_ = env_int("MARKBASE_CUDA_GEMV_ROWS", -1);
    mmq_rows_ = env_int("MARKBASE_CUDA_MMQ_ROWS", -1);
    slab_rows_ = env_int("MARKBASE_CUDA_SLAB_ROWS", int(kSlabRows));
    mmq_pairs_ = env_int("MARKBASE_CUDA_MMQ_PAIRS", -1);
    moe_gemv_glu_ = env_int("MARKBASE_CUDA_MOE_GEMV_GLU", 1) != 0;
    mmq_bf16_from_ = env_int("MARKBASE_CUDA_MMQ_BF16_FROM", int(kMmqRowsBesideCopies));
    mmq_bf16_rows_ = env_int("MARKBASE_CUDA_MMQ_BF16_ROWS", int(kMmqBf16Rows));
    mmq_wgmma_rows_ = env_int("MARKBASE_CUDA_MMQ_WGMMA_ROWS", int(kMmqWgmmaRows));
    frag_copies_ = env_int("MARKBASE_CUDA_FRAG_COPIES", 1) != 0;
    // Bisecting aids: 1 no GEMV kernels, 4 unfused norms, 8 attention key splits always.
    debug_ = env_int("MARKBASE_CUDA_DEBUG", 0);
    fuse_quant_ = env_int("MARKBASE_CUDA_NORM_QUANT", 1) != 0;
    tiled_quant_ = env_int("MARKBASE_CUDA_TILED_QUANT", 1) != 0;
    bf16_out_ = env_int("MARKBASE_CUDA_BF16_OUT", 1) != 0;
    dense_attention_ = env_int("MARKBASE_CUDA_DENSE_ATTENTION", 1) != 0;
    fused_whole_ = env_int("MARKBASE_CUDA_FUSED_WHOLE", 1) != 0;
    moe_glu_ = env_int("MARKBASE_CUDA_MOE_GLU", 1) != 0;
    dense_prefill_ = env_int("MARKBASE_CUDA_DENSE_PREFILL", 1) != 0;
    seq_scan_ = env_int("MARKBASE_CUDA_SEQ_SCAN", 0) != 0;
    ffn_rows_ = std::max(1, env_int("MARKBASE_CUDA_FFN_ROWS", 2048));
    pair_glu_ = env_int("MARKBASE_CUDA_PAIR_GLU", 1) != 0;
  }

  ~CudaBackend() override {
    cudaStreamSynchronize(st_);
    forget_recordings();
    const_cache_.clear();
    staged_dev_ = Tensor();
    if (staged_host_) cudaFreeHost(staged_host_);
    if (pinned_) cudaFreeHost(pinned_);
    for (auto& [key, plan] : plans_) {
      cublasLtMatmulDescDestroy(plan.op);
      cublasLtMatrixLayoutDestroy(plan.a);
      cublasLtMatrixLayoutDestroy(plan.b);
      cublasLtMatrixLayoutDestroy(plan.c);
    }
    cublasLtDestroy(lt_);
    cublasDestroy(blas_);
    cudaFree(blas_ws_);
    cudaEventDestroy(staged_);
    for (cudaEvent_t e : marks_) cudaEventDestroy(e);
    cudaStreamDestroy(st_);
  }

  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::CUDA; }
  DType kv_dtype() const override { return DType::BF16; }
  int64_t ffn_rows_per_call() const override { return ffn_rows_; }
  bool supports_weight_dtype(DType d) const override {
    return d == DType::F32 || d == DType::BF16 || d == DType::F16 || dtype_is_quantized(d);
  }

  // A tensor on this GPU (no memory yet) and the bytes it needs (at least 16).
  static Tensor device_tensor(DType dtype, std::vector<int64_t> shape, size_t& bytes) {
    Tensor t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.device = Device::CUDA;
    bytes = std::max<size_t>(t.nbytes(), 16);
    return t;
  }

  Tensor alloc(DType dtype, std::vector<int64_t> shape) override {
    size_t bytes = 0;
    Tensor t = device_tensor(dtype, std::move(shape), bytes);
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      cudaGetLastError();
      pool_->release_all();
      if (cudaMalloc(&p, bytes) != cudaSuccess) {
        cudaGetLastError();
        size_t free_b = 0, total = 0;
        cudaMemGetInfo(&free_b, &total);
        fail("out of GPU memory: a {} buffer of shape {} ({}) does not fit on the {} ({} free of {}); use a smaller "
             "model or quantization, or less KV memory (--kv-mem, --ctx, --max-seqs)",
             dtype_name(dtype), t.shape_str(), mib(bytes), gpu_name_, mib(free_b), mib(total));
      }
    }
    check(cudaMemsetAsync(p, 0, bytes, st_), "clearing new memory");
    t.data = p;
    t.owner = std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
    return t;
  }

  Tensor scratch(DType dtype, std::vector<int64_t> shape) override {
    size_t bytes = 0;
    Tensor t = device_tensor(dtype, std::move(shape), bytes);
    void* p = pool_->take(bytes);
    t.data = p;
    std::shared_ptr<ScratchPool> pool = pool_;
    t.owner = std::shared_ptr<void>(p, [pool, bytes](void* q) { pool->give(q, bytes); });
    return t;
  }

  Tensor prepare_weight(const Tensor& src, DType dtype, WeightUse use) override {
    if (src.device == Device::CUDA) return src;
    MB_CHECK(supports_weight_dtype(src.dtype), "cuda backend: unsupported weight dtype {}", dtype_name(src.dtype));
    DType want = gpu_dtype(dtype);
    // Rows that are not whole blocks stay bf16, as on the CPU.
    if (dtype_is_quantized(want) && src.cols() % dtype_block_size(want) != 0) want = DType::BF16;
    // Conversions between dtypes run on the host, through the CPU backend's (tested) converters.
    const Tensor host = src.dtype == want ? src : cpu_->prepare_weight(src, want, WeightUse::Lookup);
    const int64_t cols = host.cols(), rows = host.rows();
    auto hold = std::make_shared<WeightHold>();
    GpuWeight& w = hold->w;
    w.type = wtype_of(want);
    w.rows = rows;
    w.cols = cols;
    Tensor t = alloc(want, host.shape);
    if (w.type == WType::Q4_0 || w.type == WType::Q8_0) {
      const int qs_bytes = w.type == WType::Q4_0 ? 16 : 32;
      const int64_t nblocks = rows * (cols / 32);
      Tensor scales = alloc(DType::F16, {nblocks});
      void* raw = pool_->take(host.nbytes());
      check(cudaMemcpyAsync(raw, host.data, host.nbytes(), cudaMemcpyHostToDevice, st_), "uploading a weight");
      split_blocks(raw, nblocks, qs_bytes + 2, qs_bytes, t.data, scales.ptr<uint16_t>(), st_);
      check(cudaStreamSynchronize(st_), "uploading a weight");
      pool_->give(raw, host.nbytes());
      w.scale = scales.ptr<uint16_t>();
      // The planes live as long as the tensor: one owner holds both.
      auto both = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(t.owner, scales.owner);
      t.owner = std::shared_ptr<void>(both, t.data);
    } else {
      check(cudaMemcpyAsync(t.data, host.data, host.nbytes(), cudaMemcpyHostToDevice, st_), "uploading a weight");
      check(cudaStreamSynchronize(st_), "uploading a weight");
    }
    w.qs = t.data;
    // Lookup-only tensors may be activations a caller uploads (tests) and ops write in place.
    w.fixed = use != WeightUse::Lookup;
    // Stacked experts (rank 3) get none: their products are the GEMV's or the grouped kernels',
    // which read the blocks (26B-A4B: ~46 GB of copies that nothing read).
    if (use != WeightUse::Lookup && is_quantized(w.type) && src.rank() < 3 &&
        want_bf16_copy(size_t(rows * cols) * 2)) {
      // A bf16 copy for the products of many rows (prefill, large batches), which cuBLAS runs on
      // tensor cores; decode's few rows stream the compact blocks.
      Tensor copy = alloc(DType::BF16, {rows, cols});
      dequant_bf16(w, 0, rows, copy.ptr<uint16_t>(), st_);
      check(cudaStreamSynchronize(st_), "making a bf16 copy of a weight");
      w.bf16 = copy.ptr<uint16_t>();
      auto both = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(t.owner, copy.owner);
      t.owner = std::shared_ptr<void>(both, t.data);
    }
    // A copy in the tensor-core block products' fragment order, their path for many rows where a
    // weight has no bf16 copy (stacked experts: 26B-A4B Q4_0 on an H200, pp512 12,093 -> 14,053
    // tok/s, 64 streams 2,560 -> 3,417) and for few rows beside one (use_mmq). Beside one only
    // while half the GPU stays free: a model whose copies do not all fit keeps more bf16 copies
    // (its prefill's path) rather than few-row products' ~12%.
    if (use != WeightUse::Lookup && frag_copies_ && mmq_supports(w) &&
        want_copy(size_t(frag_bytes(w) + frag_scale_bytes(w)), w.bf16 ? 5 : 4)) {
      Tensor frag = alloc(DType::U8, {frag_bytes(w)}), fscale = alloc(DType::U8, {frag_scale_bytes(w)});
      make_frag(w, frag.data, fscale.data, st_);
      check(cudaStreamSynchronize(st_), "making a fragment-ordered copy of a weight");
      w.frag = frag.data;
      w.frag_scale = fscale.data;
      auto all = std::make_shared<std::tuple<std::shared_ptr<void>, std::shared_ptr<void>, std::shared_ptr<void>>>(
          t.owner, frag.owner, fscale.owner);
      t.owner = std::shared_ptr<void>(all, t.data);
    }
    t.packed = hold;
    return t;
  }

  // ------------------------------------------------------------------ staging and recording

  void stage(const std::vector<HostArray>& arrays) override {
    abandon_recording();
    size_t off = 0;
    std::vector<size_t> at(arrays.size());
    for (size_t i = 0; i < arrays.size(); ++i) {
      off = (off + 255) / 256 * 256;
      at[i] = off;
      off += std::max(arrays[i].reserve, arrays[i].bytes);
    }
    if (off > staged_cap_) {
      // New buffers move every staged address: recordings that read the old ones go.
      check(cudaStreamSynchronize(st_), "staging");
      forget_recordings();
      if (staged_host_) cudaFreeHost(staged_host_);
      staged_host_ = nullptr;
      staged_dev_ = Tensor();
      staged_cap_ = std::max<size_t>(off * 2, size_t(1) << 20);
      check(cudaMallocHost(&staged_host_, staged_cap_), "allocating pinned staging memory");
      staged_dev_ = alloc(DType::U8, {int64_t(staged_cap_)});
    }
    // The previous step's copy must have left the pinned buffer before it is rewritten.
    check(cudaEventSynchronize(staged_), "staging");
    spans_.clear();
    uint8_t* host = static_cast<uint8_t*>(staged_host_);
    uint8_t* dev = staged_dev_.ptr<uint8_t>();
    for (size_t i = 0; i < arrays.size(); ++i) {
      if (arrays[i].bytes) std::memcpy(host + at[i], arrays[i].data, arrays[i].bytes);
      // An op's host pointer matches the array's bytes only: the reserve is device room (a
      // recording's tables grow into it), and the host memory past the bytes may be another
      // array, whose op would then read this one's copy.
      spans_.push_back({static_cast<const uint8_t*>(arrays[i].data), arrays[i].bytes, dev + at[i]});
    }
    if (off) check(cudaMemcpyAsync(dev, host, off, cudaMemcpyHostToDevice, st_), "staging a step's inputs");
    check(cudaEventRecord(staged_, st_), "staging");
  }

  bool can_record_steps() const override { return graphs_on_; }

  bool replay_step(uint64_t key) override {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) return false;
    check(cudaGraphLaunch(it->second, st_), "replaying a recorded step");
    return true;
  }

  void begin_recording(uint64_t key) override {
    abandon_recording();
    // A key's first step runs as plain ops (constants and pool memory get made then, outside a
    // recording); its second is recorded.
    if (seen_.insert(key).second) return;
    if (graphs_.size() >= kMaxRecordings) forget_recordings();
    check(cudaStreamBeginCapture(st_, cudaStreamCaptureModeRelaxed), "starting to record a step");
    recording_ = true;
  }

  void end_recording(uint64_t key) override {
    if (!recording_) return;
    recording_ = false;
    cudaGraph_t g = nullptr;
    check(cudaStreamEndCapture(st_, &g), "recording a step");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    check(e, "instantiating a recorded step");
    graphs_[key] = exec;
    check(cudaGraphLaunch(exec, st_), "running a recorded step");
  }

  void forget_recordings() override {
    abandon_recording();
    if (!graphs_.empty()) cudaStreamSynchronize(st_);
    for (auto& [k, g] : graphs_) cudaGraphExecDestroy(g);
    graphs_.clear();
    seen_.clear();
  }

  size_t device_free_bytes() const override {
    size_t free_b = 0, total = 0;
    cudaMemGetInfo(&free_b, &total);
    return free_b;
  }

  double measure_copy_bandwidth(size_t bytes) override {
    bytes = bytes / 16 * 16;
    Tensor a = alloc(DType::U8, {int64_t(bytes)}), b = alloc(DType::U8, {int64_t(bytes)});
    const int reps = 20;
    const double s = copy_seconds(a.data, b.data, bytes, reps, st_);
    return s > 0 ? 2.0 * double(bytes) * reps / s : 0.0;
  }

  void synchronize() override { check(cudaStreamSynchronize(st_), "waiting for the GPU"); }

  bool can_mark() const override { return true; }
  void mark() override {
    MB_CHECK(!recording_, "cuda backend: a timing mark while a step is recorded");
    if (n_marks_ == marks_.size()) {
      cudaEvent_t e = nullptr;
      check(cudaEventCreate(&e), "creating a timing event");
      marks_.push_back(e);
    }
    check(cudaEventRecord(marks_[n_marks_++], st_), "recording a timing event");
  }
  std::vector<double> marked_seconds() override {
    std::vector<double> out;
    if (n_marks_ > 0) check(cudaEventSynchronize(marks_[n_marks_ - 1]), "waiting for the GPU");
    for (size_t i = 1; i < n_marks_; ++i) {
      float ms = 0;
      check(cudaEventElapsedTime(&ms, marks_[i - 1], marks_[i]), "reading a timing event");
      out.push_back(double(ms) / 1e3);
    }
    n_marks_ = 0;
    return out;
  }

  // ------------------------------------------------------------------ ops

  void matmul(const Tensor& x, const Tensor& w, Tensor& y) override { matmuls(x, {&w}, {&y}); }

  // Q/K/V (or any weights over the same input): one GEMV launch for a few rows, else one bf16
  // conversion of x for all the cuBLAS products.
  void matmuls(const Tensor& x, const std::vector<const Tensor*>& ws, const std::vector<Tensor*>& ys) override {
    MB_CHECK(ws.size() == ys.size() && !ws.empty(), "matmuls: {} weights, {} outputs", ws.size(), ys.size());
    const int64_t n = x.rows(), k = x.cols();
    on_device(x, "matmul x");
    std::vector<GpuWeight> gw;
    for (size_t i = 0; i < ws.size(); ++i) {
      gw.push_back(weight_of(*ws[i]));
      MB_CHECK(gw[i].cols == k && ys[i]->numel() == n * gw[i].rows, "matmul: x {} · w {}ᵀ -> y {} do not fit",
               x.shape_str(), ws[i]->shape_str(), ys[i]->shape_str());
      on_device(*ys[i], "matmul y");
    }
    if (n == 0) return;
    if (use_mmq(gw, n)) {
      std::vector<float*> y;
      for (Tensor* t : ys) y.push_back(t->f32());
      for (size_t i0 = 0; i0 < gw.size(); i0 += 3)
        mmq_batch(gw.data() + i0, y.data() + i0, int(std::min<size_t>(3, gw.size() - i0)), MmqMode::Plain, nullptr, x);
      return;
    }
    if (use_gemv(gw, n)) {
      std::vector<float*> y;
      for (Tensor* t : ys) y.push_back(t->f32());
      for (size_t i0 = 0; i0 < gw.size(); i0 += 3) {
        const int nw = int(std::min<size_t>(3, gw.size() - i0));
        gemv_batch(gw.data() + i0, y.data() + i0, nw, false, x);
      }
      return;
    }
    Tensor xb;
    for (size_t i = 0; i < gw.size(); ++i) gemm(x, xb, gw[i], *ys[i]);
  }

  void matmul_gelu_mul(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, Tensor& out) override {
    std::vector<GpuWeight> gw = {weight_of(w_gate), weight_of(w_up)};
    const int64_t n = x.rows();
    MB_CHECK(gw[0].cols == x.cols() && gw[1].cols == x.cols() && gw[0].rows == gw[1].rows &&
                 out.numel() == n * gw[0].rows,
             "matmul_gelu_mul: x {} · gate {}ᵀ, up {}ᵀ -> out {} do not fit", x.shape_str(), w_gate.shape_str(),
             w_up.shape_str(), out.shape_str());
    if (n > 0 && use_mmq(gw, n)) {
      float* y = out.f32();
      mmq_batch(gw.data(), &y, 2, MmqMode::Glu, nullptr, x);
      return;
    }
    if (n > 0 && use_gemv(gw, n)) {
      float* y = out.f32();
      gemv_batch(gw.data(), &y, 2, true, x);
      return;
    }
    Tensor xb, y2;
    const float *gate = out.f32(), *up = nullptr;
    const int gate_at = pair_glu_ ? gemm_pair(x, xb, gw[0], gw[1], y2) : -1;
    if (gate_at >= 0) {
      gate = y2.f32() + gate_at * out.numel();
      up = y2.f32() + (1 - gate_at) * out.numel();
    } else {
      y2 = scratch(DType::F32, out.shape);
      gemm(x, xb, gw[0], out);
      gemm(x, xb, gw[1], y2);
      up = y2.f32();
    }
    const QuantOut qo = quantize_next(out, true);  // for the down projection
    cuda::gelu_tanh_mul(gate, up, out.f32(), out.numel(), st_, qo.bf16);
    quantized_now(out, qo);
  }

  // A media tower's clipped linear on cuBLAS's path: x clamped as it is rounded to bf16, y clamped and
  // activated in one pass after the product (the default's five passes: copy, clamp, round, clamp,
  // activation). Few rows (GEMV, block products) and f32 weights keep the default.
  void matmul_clipped(const Tensor& x, const Tensor& w, const Clip& clip, Tensor& y, Activation act,
                      const Tensor* times) override {
    check_activation(y, act, times);
    const GpuWeight gw = weight_of(w);
    const int64_t n = x.rows(), k = x.cols();
    if (n == 0 || gw.type == WType::F32 || use_mmq({gw}, n) || use_gemv({gw}, n))
      return Backend::matmul_clipped(x, w, clip, y, act, times);
    MB_CHECK(gw.cols == k && y.numel() == n * gw.rows, "matmul_clipped: x {} · w {}ᵀ -> y {} do not fit",
             x.shape_str(), w.shape_str(), y.shape_str());
    on_device(x, "matmul_clipped x");
    on_device(y, "matmul_clipped y");
    if (times) on_device(*times, "matmul_clipped times");
    Tensor xb;
    if (clip.clips_input() || !take_norm_quant(x, CopyLayout::Bf16, xb)) {
      xb = scratch(DType::BF16, {n, k});
      if (clip.clips_input())
        cuda::clamp_to_bf16(x.f32(), n * k, clip.in_lo, clip.in_hi, xb.ptr<uint16_t>(), st_);
      else
        cuda::f32_to_bf16(x.f32(), n * k, xb.ptr<uint16_t>(), st_);
    }
    gemm(x, xb, gw, y);
    const cuda::ClipAct a = act == Activation::Silu            ? cuda::ClipAct::Silu
                            : act == Activation::GeluTanhTimes ? cuda::ClipAct::GeluTanhTimes
                                                               : cuda::ClipAct::None;
    if (clip.clips_output() || a != cuda::ClipAct::None)
      cuda::clamp_activate(y.f32(), y.numel(), clip.clips_output(), clip.out_lo, clip.out_hi, a,
                           times ? times->f32() : nullptr, st_);
  }

  void matmul_gelu_times(const Tensor& x, const Tensor& w, const Tensor& m, Tensor& out) override {
    const GpuWeight gw = weight_of(w);
    const int64_t n = x.rows();
    MB_CHECK(gw.cols == x.cols() && m.numel() == n * gw.rows && out.numel() == n * gw.rows,
             "matmul_gelu_times: x {} · w {}ᵀ, times {} -> out {} do not fit", x.shape_str(), w.shape_str(),
             m.shape_str(), out.shape_str());
    if (n > 0 && use_mmq({gw}, n)) {
      on_device(m, "matmul_gelu_times m");
      float* y = out.f32();
      mmq_batch(&gw, &y, 1, MmqMode::GeluTimes, m.f32(), x);
      return;
    }
    if (n > 0 && use_gemv({gw}, n)) {
      on_device(m, "matmul_gelu_times m");
      Tensor q, d, s;
      QuantX xq{};
      if (is_quantized(gw.type)) xq = quantized(x, q, d, s);
      gemv_gelu_times(gw, x.f32(), &xq, n, m.f32(), out.f32(), st_);
      return;
    }
    Backend::matmul_gelu_times(x, w, m, out);
  }

  void embed(const Tensor& table, const int32_t* ids, int64_t n, float scale_v, Tensor& out) override {
    const GpuWeight gw = weight_of(table);
    MB_CHECK(out.rows() == n && out.cols() == gw.cols, "embed: out {} does not fit {} rows of {}", out.shape_str(), n,
             gw.cols);
    cuda::embed(gw, dev(ids, n), n, scale_v, out.f32(), st_);
  }

  void rms_norm(const Tensor& x, const Tensor* w, float eps, bool add_one, Tensor& y) override {
    MB_CHECK(x.numel() == y.numel(), "rms_norm: x {} and y {} differ", x.shape_str(), y.shape_str());
    const QuantOut qo = quantize_next(y);
    cuda::rms_norm(x.f32(), norm_weight(w, x.cols(), "rms_norm"), eps, add_one, x.rows(), x.cols(), y.f32(), st_, qo);
    quantized_now(y, qo);
  }

  void rope(Tensor& x, const int32_t* pos, const float* inv_freq) override {
    MB_CHECK(x.rank() == 3, "rope: expected [n, heads, head_dim], got {}", x.shape_str());
    const int64_t n = x.dim(0), hd = x.dim(2);
    cuda::rope(x.f32(), n, x.dim(1), hd, dev(pos, n), constant(inv_freq, hd / 2), st_);
  }

  void rms_norm_rope(Tensor& x, const Tensor* w, float eps, bool add_one, const int32_t* pos,
                     const float* inv_freq) override {
    MB_CHECK(x.rank() == 3, "rms_norm_rope: expected [n, heads, head_dim], got {}", x.shape_str());
    const int64_t n = x.dim(0), hd = x.dim(2);
    cuda::rms_norm_rope(x.f32(), n, x.dim(1), hd, norm_weight(w, hd, "rms_norm_rope"), eps, add_one, dev(pos, n),
                        constant(inv_freq, hd / 2), st_);
  }

  void add_rms_norm(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one, float s) override {
    MB_CHECK(x.numel() == branch.numel(), "add_rms_norm: x {} and branch {} differ", x.shape_str(),
             branch.shape_str());
    const QuantOut qo = quantize_next(x);
    cuda::add_rms_norm(x.f32(), branch.f32(), norm_weight(w, x.cols(), "add_rms_norm"), eps, add_one, s, x.rows(),
                       x.cols(), st_, qo);
    quantized_now(x, qo);
  }

  void add_rms_norm_norm(Tensor& x, Tensor& branch, const Tensor* w, float eps, bool add_one, float s,
                         const Tensor* w_next, Tensor& y) override {
    MB_CHECK(x.numel() == branch.numel() && y.numel() == x.numel(), "add_rms_norm_norm: x {}, branch {}, y {} differ",
             x.shape_str(), branch.shape_str(), y.shape_str());
    if (debug_ & 4) return Backend::add_rms_norm_norm(x, branch, w, eps, add_one, s, w_next, y);
    const QuantOut qo = quantize_next(y);
    cuda::add_rms_norm_norm(x.f32(), branch.f32(), norm_weight(w, x.cols(), "add_rms_norm_norm"), eps, add_one, s,
                            norm_weight(w_next, x.cols(), "add_rms_norm_norm"), y.f32(), x.rows(), x.cols(), st_, qo);
    quantized_now(y, qo);
  }

  void kv_write(KVStore& kv, const Tensor& k, const Tensor& v, const int32_t* pos) override {
    KVSeqs seqs;
    seqs.n = 1;
    seqs.s[0] = kv_seq(kv, 0, k.dim(0), pos);
    check_kv(kv, k);
    order_rows(seqs, !seq_scan_);
    cuda::kv_write(seqs, k.f32(), v.f32(), k.dim(1), k.dim(2), st_);
  }

  void kv_write_batch(const Tensor& k, const Tensor& v, const std::vector<AttentionSeq>& seqs) override {
    for (size_t i0 = 0; i0 < seqs.size(); i0 += kMaxSeqsPerLaunch) {
      KVSeqs ks;
      for (size_t i = i0; i < std::min(seqs.size(), i0 + kMaxSeqsPerLaunch); ++i) {
        check_kv(*seqs[i].kv, k);
        ks.s[ks.n++] = kv_seq(*seqs[i].kv, seqs[i].begin, seqs[i].count, seqs[i].pos);
      }
      order_rows(ks, !seq_scan_);
      cuda::kv_write(ks, k.f32(), v.f32(), k.dim(1), k.dim(2), st_);
    }
  }

  void attention_inputs(Tensor& q, Tensor* k, Tensor* v, const AttentionInputs& p,
                        const std::vector<AttentionSeq>& writes) override {
    MB_CHECK(q.rank() == 3 && (!k || (k->rank() == 3 && v && v->numel() == k->numel() && k->dim(0) == q.dim(0) &&
                                       k->dim(2) == q.dim(2))),
             "attention_inputs: q {}, k {}, v {}", q.shape_str(), k ? k->shape_str() : "-", v ? v->shape_str() : "-");
    const int64_t n = q.dim(0), hd = q.dim(2);
    AttnInputArgs a;
    a.nh = q.dim(1);
    a.nkv = k ? k->dim(1) : 0;
    a.hd = hd;
    a.q_norm = norm_weight(p.q_norm, hd, "attention_inputs");
    a.k_norm = k ? norm_weight(p.k_norm, hd, "attention_inputs") : nullptr;
    a.eps = p.eps;
    a.add_one = p.add_one ? 1 : 0;
    a.v_norm = p.v_norm ? 1 : 0;
    // The first kMaxSeqsPerLaunch sequences' KV is written by the same launch; the rest after it.
    KVSeqs first;
    for (size_t i = 0; k && i < std::min<size_t>(writes.size(), kMaxSeqsPerLaunch); ++i) {
      check_kv(*writes[i].kv, *k);
      first.s[first.n++] = kv_seq(*writes[i].kv, writes[i].begin, writes[i].count, writes[i].pos);
    }
    order_rows(first, !seq_scan_);
    cuda::attention_inputs(q.f32(), k ? k->f32() : nullptr, k ? v->f32() : nullptr, n, a, dev(p.pos, n),
                           constant(p.inv_freq, hd / 2), first, st_);
    if (k && writes.size() > size_t(kMaxSeqsPerLaunch))
      kv_write_batch(*k, *v, std::vector<AttentionSeq>(writes.begin() + kMaxSeqsPerLaunch, writes.end()));
  }

  void attention(const Tensor& q, const KVStore& kv, const int32_t* pos, const AttentionParams& p,
                 Tensor& out) override {
    attention_batch(q, {AttentionSeq{&kv, 0, q.dim(0), pos}}, p, out);
  }

  void attention_batch(const Tensor& q, const std::vector<AttentionSeq>& seqs, const AttentionParams& p,
                       Tensor& out) override {
    MB_CHECK(q.rank() == 3 && out.numel() == q.numel(), "attention: q {} / out {}", q.shape_str(), out.shape_str());
    if (seqs.empty() || dense_attention(q, seqs, p, out)) return;
    // Long prefill chunks take the dense path, the rest of the call (decode rows beside them) the kernel.
    const std::vector<AttentionSeq> rest = dense_prefill(q, seqs, p, out);
    if (!rest.empty()) kernel_attention(q, rest, p, out, rest.size() == seqs.size());
  }

  // The attention kernel over `seqs` (their rows of q and out); `whole`: they are every row of the call, so
  // the output's quantized copy for the next product can be written as it is.
  void kernel_attention(const Tensor& q, const std::vector<AttentionSeq>& seqs, const AttentionParams& p, Tensor& out,
                        bool whole) {
    const KVStore& kv0 = *seqs[0].kv;
    AttnArgs a;
    a.n_rows = q.dim(0);
    a.n_heads = q.dim(1);
    a.hd = q.dim(2);
    a.n_kv = kv0.k.dim(1);
    a.scale = p.scale;
    a.softcap = p.softcap;
    a.window = p.window;
    int32_t max_pos = 0, max_ahead = 0;
    for (const AttentionSeq& sq : seqs)
      for (int64_t i = 0; i < sq.count; ++i) {
        max_pos = std::max(max_pos, sq.last ? sq.last[i] : sq.pos[i]);
        if (sq.last) max_ahead = std::max(max_ahead, sq.last[i] - sq.pos[i]);
      }
    a.max_keys = (int64_t(max_pos >> 8) + 1) << 8;
    if (debug_ & 8) a.max_keys = 1 << 20;
    if (a.window > 0) a.max_keys = std::min<int64_t>(a.max_keys, int64_t(a.window) + max_ahead);
    MB_CHECK(kv0.k.dim(2) == a.hd && a.n_kv > 0 && a.n_heads % a.n_kv == 0 && a.hd % 8 == 0 && a.hd <= 512,
             "attention: q {} over KV {} (head dims up to 512, a multiple of 8)", q.shape_str(), kv0.k.shape_str());
    const int64_t pf = attention_partial_floats(a);
    Tensor part = pf > 0 ? scratch(DType::F32, {pf}) : Tensor();
    // A decode step's attention output, quantized as it is written for the output projection.
    Tensor flat = out.reshaped({a.n_rows, a.n_heads * a.hd});
    const QuantOut qo = whole && a.hd % 32 == 0 ? quantize_next(flat) : QuantOut{};
    a.qo = qo;
    for (size_t i0 = 0; i0 < seqs.size(); i0 += kMaxSeqsPerLaunch) {
      KVSeqs ks;
      for (size_t i = i0; i < std::min(seqs.size(), i0 + kMaxSeqsPerLaunch); ++i) {
        check_kv(*seqs[i].kv, q);
        ks.s[ks.n++] = kv_seq(*seqs[i].kv, seqs[i].begin, seqs[i].count, seqs[i].pos);
        if (seqs[i].last) ks.s[ks.n - 1].last = dev(seqs[i].last, seqs[i].count);
      }
      order_rows(ks, !seq_scan_);
      cuda::attention(ks, a, q.f32(), out.f32(), pf > 0 ? part.f32() : nullptr, st_);
    }
    quantized_now(flat, qo);
  }

  // Sequences whose every query sees the same keys, and many of them (an image's patches in a vision
  // encoder: 2,520 x 2,520 for a 280-token image, 10,080 x 10,080 at 1,120 tokens), as two batched
  // tensor-core GEMMs over the heads and a softmax kernel between them: S = Q·Kᵀ (q rounded to
  // bf16, the bf16 KV as it is), P = softmax(S) in bf16, O = P·V, a chunk of queries at a time. The
  // attention kernel walks every key of every row one warp-step at a time, which for long
  // sequences is far from the tensor cores. Plain stores only (no pages or ring), one KV head per
  // query head, no window or soft-cap: the encoders' case. MARKBASE_CUDA_DENSE_ATTENTION=0 turns it off.
  // Head dims up to 80 (the ViTs' 64 and 72) take one fused kernel instead (cuda::attention_whole: the
  // scores stay on chip; the two GEMMs wrote and read ~0.9 GB a layer of a 280-token image);
  // MARKBASE_CUDA_FUSED_WHOLE=0 keeps the GEMMs.
  bool dense_attention(const Tensor& q, const std::vector<AttentionSeq>& seqs, const AttentionParams& p, Tensor& out) {
    constexpr int64_t kMinKeys = 256, kMinRows = 64;
    if (!dense_attention_ || p.window > 0 || p.softcap > 0.f || q.rank() != 3) return false;
    const int64_t nh = q.dim(1), hd = q.dim(2);
    std::vector<int64_t> keys(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      const AttentionSeq& s = seqs[i];
      const KVStore& kv = *s.kv;
      if (s.count < kMinRows || kv.pages || kv.ring || kv.k.dtype != DType::BF16 || kv.k.rank() != 3 ||
          kv.k.dim(1) != nh || kv.k.dim(2) != hd || hd % 8 != 0)
        return false;
      // Each query's last key: `last` where given, else its position (the ViT places every patch at
      // its image's last position).
      const int32_t* hi = s.last ? s.last : s.pos;
      for (int64_t t = 1; t < s.count; ++t)
        if (hi[t] != hi[0]) return false;
      keys[i] = int64_t(hi[0]) + 1;
      if (keys[i] < kMinKeys || keys[i] > kv.capacity) return false;
    }
    Tensor qb = scratch(DType::BF16, {q.numel()});
    cuda::f32_to_bf16(q.f32(), q.numel(), qb.ptr<uint16_t>(), st_);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const AttentionSeq& s = seqs[i];
      const int64_t nk = keys[i], width = nh * hd;
      const uint16_t *K = static_cast<const uint16_t*>(s.kv->k.data), *V = static_cast<const uint16_t*>(s.kv->v.data);
      if (fused_whole_ && cuda::attention_whole(qb.ptr<uint16_t>() + s.begin * width, K, V, s.count, nk, nh, hd,
                                                p.scale, out.f32() + s.begin * width, st_))
        continue;
      // Queries per chunk: S (f32) and P (bf16) of every head within ~256 MB.
      const int64_t ld = score_ld(nk);
      const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(s.count, (int64_t(256) << 20) / (nh * ld * 6)));
      Tensor S = scratch(DType::F32, {nh * chunk * ld}), P = scratch(DType::BF16, {nh * chunk * ld});
      for (int64_t q0 = 0; q0 < s.count; q0 += chunk) {
        const int64_t rows = std::min(chunk, s.count - q0);
        // Every patch sees every key: each row's last key is the last column.
        dense_heads(false, qb.ptr<uint16_t>() + (s.begin + q0) * width, nullptr, K, V, nh, nh, hd,
                    rows, nk, ld, p.scale, nk - 1, nullptr, 0, 0.f, S.f32(), P.ptr<uint16_t>(), nullptr,
                    out.f32() + (s.begin + q0) * width);
      }
    }
    return true;
  }

  // S and P's rows: a chunk's key count rounded up to 8 (16 bytes of P), so that cuBLAS's tensor-core kernels
  // for aligned operands take both products (an image's last key ends a chunk's range anywhere).
  static int64_t score_ld(int64_t nk) { return (nk + 7) / 8 * 8; }

  // The dense attention of `rows` queries over nk keys (K and V bf16, rows nkv·hd apart): S_h [rows, nk] =
  // scale · Q_h · K_gᵀ, P_h = softmax_rows_bf16 of S_h (row r's own key at column first_hi + r, its last
  // ahead[r] further where given, window and soft-cap as given; S and P rows ld apart), O_h = P_h · V_g.
  // In cuBLAS's column order S_h is [nk x rows] = K_g ([hd x nk])ᵀ · Q_h ([hd x rows]) and O_h [hd x rows]
  // = V_g ([hd x nk]) · P_h ([nk x rows]).
  // Two layouts of q and o:
  // - rows (q bf16 and o f32 [rows, nh, hd], each query head its own KV head: the images): one batched
  //   GEMM over the heads for each product, K and V a head apart;
  // - heads (head_major: q [nh, rows, hd], o [nh, rows, hd] f32): a KV head's `group` query heads are one
  //   [group·rows, hd] matrix, so one batched GEMM over the KV heads for each product however many
  //   query heads share one (a call a KV head took 26B-A4B's prefill attention to 30+ cuBLAS calls a
  //   layer, each too small to fill the GPU).
  // q_lo and P_lo (both or neither): the remainders of q and P after bf16 (rows_to_heads_bf16's and the
  // softmax's lo), each product then taken twice (hi, then lo added): within ~1e-5 of f32 where K and
  // V are bf16 as stored, as the attention kernel computes. Text models' logits need that (a routed
  // expert flips on a bf16 Q or P); the images' encoders round to bf16 as torch's bf16 SDPA does.
  void dense_heads(bool head_major, const uint16_t* q, const uint16_t* q_lo, const uint16_t* K, const uint16_t* V,
                   int64_t nh, int64_t nkv, int64_t hd, int64_t rows, int64_t nk, int64_t ld, float scale,
                   int64_t first_hi, const int32_t* ahead, int window, float softcap, float* S, uint16_t* P,
                   uint16_t* P_lo, float* o) {
    const float zero = 0.f, one = 1.f;
    const int64_t group = nh / nkv, kw = nkv * hd;
    MB_CHECK(head_major || group == 1, "dense attention: rows-major queries need a KV head each");
    // Per batch entry: query columns n, their leading dimension and stride; K/V's stride.
    const int64_t batch = head_major ? nkv : nh, n = head_major ? group * rows : rows;
    const int64_t q_ld = head_major ? hd : nh * hd, q_stride = head_major ? n * hd : hd, kv_stride = hd;
    for (const uint16_t* qt : {q, q_lo}) {
      if (!qt) continue;
      check_blas(cublasGemmStridedBatchedEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, int(nk), int(n), int(hd), &scale, K,
                                            CUDA_R_16BF, int(kw), kv_stride, qt, CUDA_R_16BF, int(q_ld), q_stride,
                                            qt == q ? &zero : &one, S, CUDA_R_32F, int(ld), n * ld, int(batch),
                                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "attention scores (batched GEMM)");
    }
    cuda::softmax_rows_bf16(S, nh, rows, nk, ld, first_hi, ahead, window, softcap, P, P_lo, st_);
    for (const uint16_t* pt : {static_cast<const uint16_t*>(P), static_cast<const uint16_t*>(P_lo)}) {
      if (!pt) continue;
      check_blas(cublasGemmStridedBatchedEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, int(hd), int(n), int(nk), &one, V,
                                            CUDA_R_16BF, int(kw), kv_stride, pt, CUDA_R_16BF, int(ld), n * ld,
                                            pt == P ? &zero : &one, o, CUDA_R_32F, int(q_ld), q_stride, int(batch),
                                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "attention output (batched GEMM)");
    }
  }

  // Prefill chunks of many rows at consecutive positions (each query sees the keys up to its own, or
  // up to its image's last where `last` says so, within the window) as the dense path above runs
  // images: dense_heads on the chunk's queries laid out by heads (one batched GEMM over the KV heads a
  // product) and the chunk's key range (K and V read in place from a plain store, gathered from pages
  // or a ring), the mask, window and soft-cap in the softmax between. The attention kernel walks each
  // row's keys a warp-step at a time on the CUDA cores, its cost growing with the prompt's square.
  // Returns the sequences it left to the kernel (decode rows, short chunks); never in a recorded step
  // (the key ranges follow the positions). MARKBASE_CUDA_DENSE_PREFILL=0 turns it off.
  std::vector<AttentionSeq> dense_prefill(const Tensor& q, const std::vector<AttentionSeq>& seqs,
                                          const AttentionParams& p, Tensor& out) {
    constexpr int64_t kMinRows = 64;
    if (!dense_prefill_ || recording_ || q.rank() != 3) return seqs;
    const int64_t nh = q.dim(1), hd = q.dim(2), width = nh * hd;
    auto dense = [&](const AttentionSeq& s) {
      const KVStore& kv = *s.kv;
      if (s.count < kMinRows || kv.k.dtype != DType::BF16 || kv.k.rank() != 3 || kv.k.dim(2) != hd || hd % 8 != 0 ||
          nh % kv.k.dim(1) != 0)
        return false;
      for (int64_t t = 0; t < s.count; ++t)
        if (s.pos[t] != s.pos[0] + t || (s.last && s.last[t] < s.pos[t])) return false;
      return true;
    };
    std::vector<AttentionSeq> rest;
    for (const AttentionSeq& s : seqs) {
      if (!dense(s)) {
        rest.push_back(s);
        continue;
      }
      const KVStore& kv = *s.kv;
      const int64_t nkv = kv.k.dim(1), kw = nkv * hd, p0 = s.pos[0];
      // How far past its own key each row sees (an image's tokens: to the image's last).
      std::vector<int32_t> ahead;
      int64_t max_ahead = 0;
      if (s.last) {
        ahead.resize(size_t(s.count));
        for (int64_t t = 0; t < s.count; ++t) {
          ahead[size_t(t)] = s.last[t] - s.pos[t];
          max_ahead = std::max<int64_t>(max_ahead, ahead[size_t(t)]);
        }
      }
      // Queries per chunk: S (f32), P and its remainder (bf16) of every head within ~128 MB at the most keys a
      // chunk reads.
      const int64_t key_bound = (p.window > 0 ? std::min<int64_t>(p.window, p0 + 1) : p0 + 1) + s.count + max_ahead;
      const int64_t chunk =
          std::max<int64_t>(1, std::min<int64_t>(s.count, (int64_t(128) << 20) / (nh * score_ld(key_bound) * 8)));
      const int64_t most_keys =
          std::min<int64_t>(key_bound, p.window > 0 ? p.window + chunk + max_ahead : p0 + s.count + max_ahead);
      // The buffers whose size follows the keys at a power of two of it: a prompt's chunks read ever more keys,
      // and at sizes apart each was a new cudaMalloc of up to ~100 MB (the pool keeps sizes apart).
      auto keyed = [&](DType t, int64_t n) { return scratch(t, {int64_t(std::bit_ceil(uint64_t(n)))}); };
      const int64_t scores = nh * chunk * score_ld(most_keys);
      Tensor S = keyed(DType::F32, scores), P = keyed(DType::BF16, scores), P_lo = keyed(DType::BF16, scores);
      // A chunk's queries and output by heads (dense_heads' head-major layout).
      Tensor qh = scratch(DType::BF16, {chunk * width}), qh_lo = scratch(DType::BF16, {chunk * width}),
             oh = scratch(DType::F32, {chunk * width});
      const bool in_place = !kv.pages && !kv.ring;
      Tensor kc, vc;
      if (!in_place) {
        kc = keyed(DType::BF16, most_keys * kw);
        vc = keyed(DType::BF16, most_keys * kw);
      }
      for (int64_t q0 = 0; q0 < s.count; q0 += chunk) {
        const int64_t rows = std::min(chunk, s.count - q0);
        int64_t khi = p0 + q0 + rows - 1;
        if (s.last) khi = std::max<int64_t>(khi, *std::max_element(s.last + q0, s.last + q0 + rows));
        const int64_t klo = p.window > 0 ? std::max<int64_t>(0, p0 + q0 - p.window + 1) : 0, nk = khi - klo + 1;
        MB_CHECK(nk <= most_keys && (!in_place || khi < kv.k.dim(0)),
                 "dense prefill: keys [{}, {}] for a chunk sized for {} keys, a store of {}", klo, khi, most_keys,
                 kv.k.dim(0));
        const uint16_t *K = static_cast<const uint16_t*>(kv.k.data) + klo * kw,
                       *V = static_cast<const uint16_t*>(kv.v.data) + klo * kw;
        if (!in_place) {
          cuda::gather_kv(kv_seq(kv, s.begin, s.count, s.pos), klo, nk, kw, kc.ptr<uint16_t>(), vc.ptr<uint16_t>(),
                          st_);
          K = kc.ptr<uint16_t>();
          V = vc.ptr<uint16_t>();
        }
        cuda::rows_to_heads_bf16(q.f32() + (s.begin + q0) * width, width, rows, nh, hd, qh.ptr<uint16_t>(),
                                 qh_lo.ptr<uint16_t>(), st_);
        dense_heads(true, qh.ptr<uint16_t>(), qh_lo.ptr<uint16_t>(), K, V, nh, nkv, hd, rows, nk, score_ld(nk), p.scale,
                    p0 + q0 - klo, s.last ? dev(ahead.data() + q0, rows) : nullptr, p.window, p.softcap, S.f32(),
                    P.ptr<uint16_t>(), P_lo.ptr<uint16_t>(), oh.f32());
        cuda::heads_to_rows(oh.f32(), rows, nh, hd, width, out.f32() + (s.begin + q0) * width, st_);
      }
    }
    return rest;
  }

  void gelu_tanh_mul(const Tensor& gate, const Tensor& up, Tensor& out) override {
    const int64_t n = gate.numel();
    MB_CHECK(up.numel() == n && out.numel() == n, "gelu_tanh_mul: sizes differ");
    const QuantOut qo = out.rank() == 2 ? quantize_next(out, true) : QuantOut{};
    cuda::gelu_tanh_mul(gate.f32(), up.f32(), out.f32(), n, st_, qo.bf16);
    quantized_now(out, qo);
  }
  void add(const Tensor& a, const Tensor& b, Tensor& out) override {
    const int64_t n = a.numel(), bn = add_operand(a, b, out);
    if (bn == n)
      cuda::add(a.f32(), b.f32(), out.f32(), n, st_);
    else
      cuda::add_bcast(a.f32(), b.f32(), out.f32(), n, bn, st_);
  }
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override {
    const int64_t n = a.numel(), bn = b.numel();
    MB_CHECK(out.numel() == n && bn > 0 && n % bn == 0, "mul: sizes {} and {} do not broadcast", a.shape_str(),
             b.shape_str());
    cuda::mul(a.f32(), b.f32(), out.f32(), n, bn, st_);
  }
  void scale(Tensor& x, float s) override { cuda::scale(x.f32(), x.numel(), s, st_); }
  void softcap(Tensor& x, float cap) override { cuda::softcap(x.f32(), x.numel(), cap, st_); }
  void clamp(Tensor& x, float lo, float hi) override { cuda::clamp(x.f32(), x.numel(), lo, hi, st_); }
  void silu(Tensor& x) override { cuda::silu(x.f32(), x.numel(), st_); }
  void layer_norm(const Tensor& x, const Tensor& w, const Tensor* b, float eps, bool relu, Tensor& y) override {
    MB_CHECK(x.numel() == y.numel() && x.cols() > 0, "layer_norm: x {} and y {} differ", x.shape_str(),
             y.shape_str());
    cuda::layer_norm(x.f32(), norm_weight(&w, x.cols(), "layer_norm"), norm_weight(b, x.cols(), "layer_norm"), eps,
                     relu, x.rows(), x.cols(), y.f32(), st_);
  }
  void im2col(const Tensor& x, const uint8_t* row_valid, const Im2col& c, int64_t row0, Tensor& cols) override {
    const Im2colShape g = im2col_shape(x, c, row0, cols);
    cuda::im2col(x.f32(), dev(row_valid, row_valid ? g.h : 0), g.h, g.w, g.c, c.kernel, c.stride, c.pad, row0, g.rows,
                 g.wo, cols.f32(), st_);
  }
  void glu_causal_conv(const Tensor& g, const Tensor& w, Tensor& out) override {
    check_glu_causal_conv(g, w, out);
    const int64_t n = out.rows(), D = out.cols(), K = w.cols();
    cuda::glu_causal_conv(g.f32(), w.f32(), n, D, K, out.f32(), st_);
  }
  void local_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_gain, const Tensor& rel_keys,
                       const LocalAttention& p, Tensor& out) override {
    const LocalAttentionShape s = local_attention_shape(q, k, v, q_gain, rel_keys, p, out);
    MB_CHECK(s.hd <= cuda::kLocalAttnMaxHeadDim && p.context <= cuda::kLocalAttnMaxContext,
             "cuda local_attention: head dim {} (at most {}) or context {} (at most {}) too large", s.hd,
             cuda::kLocalAttnMaxHeadDim, p.context, cuda::kLocalAttnMaxContext);
    const cuda::LocalAttnArgs a{p.chunk, p.left, p.context, p.rel_offset, p.q_scale, p.k_scale, p.logit_cap,
                                p.invalid_logit};
    cuda::local_attention(q.f32(), k.f32(), v.f32(), q_gain.f32(), rel_keys.f32(), dev(p.valid, s.n), s.n, s.heads,
                          s.hd, a, out.f32(), st_);
  }

  void route_topk(const Tensor& logits, int k, const Tensor* per_expert_scale, Tensor& weights,
                  Tensor& experts) override {
    const int64_t n = logits.rows(), E = logits.cols();
    MB_CHECK(k > 0 && k <= E && k <= 64, "route_topk: k={} for {} experts", k, E);
    cuda::route_topk(logits.f32(), n, E, k, per_expert_scale ? per_expert_scale->f32() : nullptr, weights.f32(),
                     experts.ptr<int32_t>(), st_);
  }

  void moe_gated_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down, const Tensor& weights,
                         const Tensor& experts, Tensor& out) override {
    const int64_t n = x.rows(), H = x.cols(), E = gate_up.dim(0), I2 = gate_up.dim(1), I = I2 / 2;
    const int k = int(weights.cols());
    MB_CHECK(gate_up.rank() == 3 && down.rank() == 3 && gate_up.dim(2) == H && down.dim(0) == E &&
                 down.dim(1) == H && down.dim(2) == I,
             "moe: expert tensors {} / {} do not fit hidden size {}", gate_up.shape_str(), down.shape_str(), H);
    const GpuWeight gu = weight_of(gate_up), dn = weight_of(down);
    MB_CHECK((is_quantized(gu.type) || H % 8 == 0) && (is_quantized(dn.type) || I % 8 == 0),
             "moe: expert rows of {} and {} elements need a multiple of 8 on the GPU", H, I);
    const int64_t pairs = n * k;
    // Tiles pay off once experts average enough pairs: on the blocks' planes from 2 an expert (at 0.5,
    // 26B-A4B at 8 streams, the pair-by-pair GEMV was faster: 4.6 against 7.0 ms a step), on
    // fragment-ordered copies from 0.5 (26B-A4B Q4_0 tok/s at 8 / 16 streams: 996 / 1,582 in tiles
    // against 932 / 1,244 pair by pair; 274 against 358 at one stream's 8 pairs).
    const int64_t min_pairs = mmq_pairs_ >= 0 ? mmq_pairs_ : gu.frag && dn.frag ? E / 2 : 2 * E;
    if (mmq_pairs_ != 0 && pairs >= min_pairs && mmq_supports(gu) && mmq_supports(dn) && I2 % 64 == 0 &&
        H % 64 == 0 && I % 32 == 0)
      return grouped_experts(x, gu, dn, E, I, weights, experts, out);
    Tensor q, d, s;
    QuantX xq{};
    if (is_quantized(gu.type)) xq = quantized(x, q, d, s);
    Tensor act = scratch(DType::F32, {pairs, I});
    if (moe_gemv_glu_) {
      moe_gemv(gu, I2, x.f32(), &xq, experts.ptr<int32_t>(), pairs, k, false, true, act.f32(), st_);
    } else {
      Tensor h = scratch(DType::F32, {pairs, I2});
      moe_gemv(gu, I2, x.f32(), &xq, experts.ptr<int32_t>(), pairs, k, false, false, h.f32(), st_);
      gelu_split_mul(h.f32(), pairs, I, act.f32(), st_);
    }
    Tensor y = scratch(DType::F32, {pairs, H});
    Tensor q2, d2, s2;
    QuantX aq{};
    if (is_quantized(dn.type)) aq = quantized(act, q2, d2, s2);
    moe_gemv(dn, H, act.f32(), &aq, experts.ptr<int32_t>(), pairs, k, true, false, y.f32(), st_);
    moe_combine(y.f32(), weights.f32(), n, k, H, out.f32(), st_);
  }

  // Many token-expert pairs: sorted into per-expert tiles on the device, each expert's weights read
  // once per tile of up to 64 pairs (the pair-by-pair GEMV reads them once per pair).
  void grouped_experts(const Tensor& x, const GpuWeight& gu, const GpuWeight& dn, int64_t E, int64_t I,
                       const Tensor& weights, const Tensor& experts, Tensor& out) {
    const int64_t n = x.rows(), H = x.cols(), k = weights.cols(), pairs = n * k;
    const int64_t rows = moe_tiled_rows(pairs, E), max_tiles = moe_max_tiles(pairs, E);
    Tensor row_pair = scratch(DType::I32, {rows}), tiles = scratch(DType::I32, {max_tiles * 4});
    Tensor n_tiles = scratch(DType::I32, {1});
    moe_tiles(experts.ptr<int32_t>(), pairs, E, row_pair.ptr<int32_t>(), tiles.ptr<int32_t>(), n_tiles.ptr<int32_t>(),
              st_);
    // On fragment-ordered weights the product's epilogue applies the GLU (no [pairs, 2I] sums to write
    // and read back; MARKBASE_CUDA_MOE_GLU=0 leaves it to its own kernel).
    const bool glu = gu.frag && moe_glu_;
    Tensor act = scratch(DType::F32, {pairs, I});
    {
      Tensor h = glu ? Tensor() : scratch(DType::F32, {pairs, 2 * I});
      Tensor q = scratch(DType::U8, {rows * H}), d = scratch(DType::F32, {rows * H / 32});
      tile_x(x.f32(), n, H, row_pair.ptr<int32_t>(), int(k), rows, q.ptr<int8_t>(), d.f32(), st_);
      mmq_experts(gu, 2 * I, pairs, E, q.ptr<int8_t>(), d.f32(), tiles.ptr<int32_t>(), n_tiles.ptr<int32_t>(),
                  row_pair.ptr<int32_t>(), glu, glu ? act.f32() : h.f32(), st_);
      if (!glu) gelu_split_mul(h.f32(), pairs, I, act.f32(), st_);
    }
    Tensor y = scratch(DType::F32, {pairs, H});
    {
      Tensor q = scratch(DType::U8, {rows * I}), d = scratch(DType::F32, {rows * I / 32});
      tile_x(act.f32(), pairs, I, row_pair.ptr<int32_t>(), 1, rows, q.ptr<int8_t>(), d.f32(), st_);
      mmq_experts(dn, H, pairs, E, q.ptr<int8_t>(), d.f32(), tiles.ptr<int32_t>(), n_tiles.ptr<int32_t>(),
                  row_pair.ptr<int32_t>(), false, y.f32(), st_);
    }
    moe_combine(y.f32(), weights.f32(), n, int(k), H, out.f32(), st_);
  }

  void argmax_rows(const Tensor& x, Tensor& ids) override {
    MB_CHECK(ids.dtype == DType::I32 && ids.numel() > 0 && x.numel() % ids.numel() == 0,
             "argmax_rows: {} ids for x {}", ids.numel(), x.shape_str());
    on_device(x, "argmax_rows x");
    on_device(ids, "argmax_rows ids");
    cuda::argmax_rows(x.f32(), ids.numel(), x.numel() / ids.numel(), ids.ptr<int32_t>(), st_);
  }

  void sample_rows(const Tensor& x, std::span<const TokenPick> picks, std::span<int32_t> ids) override {
    const int64_t r = x.rows(), V = x.cols();
    MB_CHECK(int64_t(picks.size()) == r && int64_t(ids.size()) == r, "sample_rows: {} picks and {} ids for x {}",
             picks.size(), ids.size(), x.shape_str());
    if (r == 0) return;
    on_device(x, "sample_rows x");
    static_assert(sizeof(PickArgs) == sizeof(TokenPick));
    std::vector<PickArgs> args(static_cast<size_t>(r));
    for (int64_t i = 0; i < r; ++i) {
      const TokenPick& p = picks[size_t(i)];
      args[size_t(i)] = {p.temperature, p.top_k, p.top_p, p.min_p, p.u};
    }
    Tensor dev_args = scratch(DType::U8, {int64_t(r * sizeof(PickArgs))}), dev_ids = scratch(DType::I32, {r});
    upload(args.data(), dev_args);
    cuda::sample_rows(x.f32(), r, V, dev_args.ptr<PickArgs>(), dev_ids.ptr<int32_t>(), st_);
    to_host(dev_ids, ids.data());
    // Rows whose top-k or nucleus is longer than the kernel's list: sorted whole.
    Tensor keys, sorted, temp;
    for (int64_t i = 0; i < r; ++i) {
      if (ids[size_t(i)] != -2) continue;
      if (keys.empty()) {
        keys = scratch(DType::U8, {V * 8});
        sorted = scratch(DType::U8, {V * 8});
        temp = scratch(DType::U8, {int64_t(std::max<size_t>(cuda::sample_sort_temp_bytes(V), 16))});
      }
      cuda::sample_row_sorted(x.f32() + i * V, V, args[size_t(i)], keys.ptr<uint64_t>(), sorted.ptr<uint64_t>(),
                              temp.data, size_t(temp.nbytes()), dev_ids.ptr<int32_t>() + i, st_);
      Tensor one = dev_ids.slice_rows(i, 1);
      to_host(one, &ids[size_t(i)]);
    }
  }

  void slice_cols(const Tensor& src, int64_t begin, Tensor& dst) override {
    const int64_t n = src.rows(), c = src.cols(), w = dst.cols();
    MB_CHECK(dst.rows() == n && begin >= 0 && begin + w <= c, "slice_cols: [{}, {}) of {} into {}", begin, begin + w,
             src.shape_str(), dst.shape_str());
    cuda::slice_cols(src.f32(), n, c, begin, w, dst.f32(), st_);
  }

  void gather_rows(const Tensor& src, const int32_t* rows, int64_t n, Tensor& dst) override {
    MB_CHECK(dst.rows() == n && dst.cols() == src.cols(), "gather_rows: {} rows of {} into {}", n, src.shape_str(),
             dst.shape_str());
    cuda::gather_rows(src.f32(), src.cols(), dev(rows, n), n, dst.f32(), st_);
  }

  void gather_sum_rows(const Tensor& src, const int32_t* rows, int64_t group, float scale, Tensor& dst) override {
    check_gather_sum_rows(src, rows, group, dst);
    cuda::gather_sum_rows(src.f32(), src.cols(), dev(rows, dst.rows() * group), dst.rows(), group, scale, dst.f32(),
                          st_);
  }

  void copy(const Tensor& src, Tensor& dst) override {
    MB_CHECK(src.nbytes() == dst.nbytes(), "copy: sizes differ ({} vs {})", src.shape_str(), dst.shape_str());
    check(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, st_), "copy");
  }

  void upload(const void* src, Tensor& dst) override {
    MB_CHECK(!recording_, "cuda backend: upload inside a recorded step");
    if (dst.device != Device::CUDA) {
      std::memcpy(dst.data, src, dst.nbytes());
      return;
    }
    // Synchronous: the caller may free or reuse `src` as soon as this returns.
    check(cudaMemcpyAsync(dst.data, src, dst.nbytes(), cudaMemcpyHostToDevice, st_), "copying to the device");
    check(cudaStreamSynchronize(st_), "copying to the device");
  }

  void to_host(const Tensor& src, void* dst) override {
    MB_CHECK(!recording_, "cuda backend: to_host inside a recorded step");
    if (src.device != Device::CUDA) {
      std::memcpy(dst, src.data, src.nbytes());
      return;
    }
    const size_t bytes = src.nbytes();
    // Large results (a batch's logits: 1 MB a row) go through pinned memory, which the copy engine
    // fills at full speed, then out in parallel; pageable destinations copy at a fraction of that.
    const bool bounce = bytes >= (size_t(1) << 20);
    if (bounce && bytes > pinned_cap_) {
      if (pinned_) cudaFreeHost(pinned_);
      pinned_ = nullptr;
      pinned_cap_ = 0;
      check(cudaMallocHost(&pinned_, bytes), "allocating pinned memory");
      pinned_cap_ = bytes;
    }
    check(cudaMemcpyAsync(bounce ? pinned_ : dst, src.data, bytes, cudaMemcpyDeviceToHost, st_),
          "copying to the host");
    const cudaError_t e = cudaStreamSynchronize(st_);
    if (e != cudaSuccess) fail("CUDA: a kernel of this step failed: {}", cudaGetErrorString(e));
    uploads_.clear();
    if (bounce) {
      const size_t piece = size_t(1) << 20;
      const int64_t pieces = int64_t((bytes + piece - 1) / piece);
      ThreadPool::global().parallel_for(pieces, 1, [&](int64_t b, int64_t e2) {
        const size_t lo = size_t(b) * piece, hi = std::min(bytes, size_t(e2) * piece);
        std::memcpy(static_cast<uint8_t*>(dst) + lo, static_cast<const uint8_t*>(pinned_) + lo, hi - lo);
      });
    }
  }

 private:
  static constexpr size_t kBlasWorkspace = size_t(64) << 20;
  static constexpr size_t kMaxRecordings = 512;

  struct Span {
    const uint8_t* host;
    size_t bytes;
    uint8_t* dev;
  };

  static void on_device(const Tensor& t, const char* what) {
    MB_CHECK(t.device == Device::CUDA, "cuda backend: {} {} is in host memory", what, t.shape_str());
  }

  // The device copy of host array [p, p + n): staged, or copied now (never while recording).
  template <class T> const T* dev(const T* p, int64_t n) {
    if (!p) return nullptr;
    const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
    const size_t bytes = size_t(std::max<int64_t>(n, 0)) * sizeof(T);
    for (const Span& s : spans_)
      if (b >= s.host && b + bytes <= s.host + s.bytes) return reinterpret_cast<const T*>(s.dev + (b - s.host));
    MB_CHECK(!recording_, "cuda backend: an op was given host data that was not staged while a step is recorded");
    Tensor t = scratch(DType::U8, {int64_t(std::max<size_t>(bytes, 16))});
    if (bytes) check(cudaMemcpyAsync(t.data, p, bytes, cudaMemcpyHostToDevice, st_), "copying op inputs");
    uploads_.push_back(t);
    if (uploads_.size() > 4096) {
      synchronize();
      uploads_.erase(uploads_.begin(), uploads_.end() - 1);
    }
    return static_cast<const T*>(t.data);
  }

  // Constant host arrays (rotary frequencies), copied once per content.
  const float* constant(const float* p, int64_t n) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, p + i, 4);
      h = (h ^ u) * 1099511628211ull;
    }
    const auto key = std::make_pair(reinterpret_cast<uintptr_t>(p) ^ (uint64_t(n) << 48), h);
    auto it = const_cache_.find(key);
    if (it != const_cache_.end()) return it->second.f32();
    MB_CHECK(!recording_, "cuda backend: a new constant array while a step is recorded");
    Tensor t = alloc(DType::F32, {std::max<int64_t>(n, 1)});
    // On the backend's stream, after alloc's clearing of the buffer: a plain cudaMemcpy runs on
    // the legacy stream, which a non-blocking stream does not wait for, so the clearing could land
    // after the copy and zero the constants (rotary frequencies: no rotation).
    check(cudaMemcpyAsync(t.data, p, size_t(n) * 4, cudaMemcpyHostToDevice, st_), "copying constants");
    return const_cache_.emplace(key, t).first->second.f32();
  }

  const float* norm_weight(const Tensor* w, int64_t cols, const char* op) {
    if (!w) return nullptr;
    MB_CHECK(w->dtype == DType::F32 && w->numel() == cols && w->device == Device::CUDA,
             "{}: weight {} {} does not fit rows of {}", op, dtype_name(w->dtype), w->shape_str(), cols);
    return w->f32();
  }

  static GpuWeight weight_of(const Tensor& w) {
    if (w.packed) return static_cast<const WeightHold*>(w.packed.get())->w;
    // A device tensor made without prepare_weight (f32/bf16 rows).
    on_device(w, "weight");
    GpuWeight g;
    g.type = wtype_of(w.dtype);
    MB_CHECK(!is_quantized(g.type), "cuda backend: a block-quantized weight must come from prepare_weight");
    g.rows = w.rows();
    g.cols = w.cols();
    g.qs = w.data;
    return g;
  }

  // A norm's (or the attention's) output of a few rows is quantized by its kernel as it writes it,
  // for the GEMV that most likely reads it next (a decode step's Q/K/V, output, FFN and
  // per-layer-input products): one kernel less per product. quantized() takes that copy while no
  // CUDA call has come between (g_device_calls unchanged: nothing can have written the activations
  // since). Rows past the GEMV's, in whole groups of 8 up to 16, go out in the block products' tiled
  // layout instead (mmq_batch takes it in place of a tile_x launch: E4B Q4_0 at 8 streams +6% on an
  // H100; MARKBASE_CUDA_TILED_QUANT=0 turns it off). More rows go out as bf16 for cuBLAS, gemm taking
  // that in place of an f32_to_bf16 launch (64 and 128 streams +7-9%, pp512 +8-10%;
  // MARKBASE_CUDA_BF16_OUT=0 turns it off).
  enum class CopyLayout { None, Rows, Tiled, Bf16 };
  struct NormQuant {
    const void* x = nullptr;
    int64_t n = 0, k = 0;
    uint64_t calls = 0;
    CopyLayout layout = CopyLayout::None;
    Tensor q, d, s;  // Bf16: q holds the rows
  };
  NormQuant norm_quant_;

  // bf16_only: the kernel writes only a bf16 copy (none for rows the GEMV takes).
  QuantOut quantize_next(const Tensor& y, bool bf16_only = false) {
    norm_quant_ = NormQuant();
    const int64_t n = y.rows(), k = y.cols();
    if (!fuse_quant_ || n == 0) return {};
    NormQuant& p = norm_quant_;
    QuantOut qo;
    if (n > 2 * kGemvMaxRows) {
      if (!bf16_out_) return {};
      p.layout = CopyLayout::Bf16;
      p.q = scratch(DType::BF16, {n, k});
      qo.bf16 = p.q.ptr<uint16_t>();
      return qo;
    }
    if (bf16_only || k % 32 != 0) return {};
    const bool tiled = tiled_quant_ && n % 8 == 0 && n > gemv_block_rows();
    p.layout = tiled ? CopyLayout::Tiled : CopyLayout::Rows;
    p.q = scratch(DType::U8, {n * k});
    p.d = scratch(DType::F32, {n * k / 32});
    qo.q = p.q.ptr<int8_t>();
    qo.d = p.d.f32();
    if (tiled) {
      qo.tiled_cols = k;
      return qo;
    }
    p.s = scratch(DType::F32, {n * k / 32});
    qo.s = p.s.f32();
    return qo;
  }
  // The copy of x the kernel before wrote, where it wrote x as it is now and in that layout (q, and
  // where given d and s; false: none).
  bool take_norm_quant(const Tensor& x, CopyLayout layout, Tensor& q, Tensor* d = nullptr, Tensor* s = nullptr) {
    NormQuant& p = norm_quant_;
    if (p.x != x.data || p.n != x.rows() || p.k != x.cols() || p.layout != layout ||
        p.calls != g_device_calls.load(std::memory_order_relaxed))
      return false;
    q = std::move(p.q);
    if (d) *d = std::move(p.d);
    if (s) *s = std::move(p.s);
    p = NormQuant();
    return true;
  }
  void quantized_now(const Tensor& y, const QuantOut& qo) {
    if (!qo.q && !qo.bf16) return;
    norm_quant_.x = y.data;
    norm_quant_.n = y.rows();
    norm_quant_.k = y.cols();
    norm_quant_.calls = g_device_calls.load(std::memory_order_relaxed);
  }

  QuantX quantized(const Tensor& x, Tensor& q, Tensor& d, Tensor& s) {
    const int64_t n = x.rows(), k = x.cols();
    MB_CHECK(k % 32 == 0, "cuda backend: rows of {} elements cannot meet block-quantized weights", k);
    if (!take_norm_quant(x, CopyLayout::Rows, q, &d, &s)) {
      q = scratch(DType::U8, {n * k});
      d = scratch(DType::F32, {n * k / 32});
      s = scratch(DType::F32, {n * k / 32});
      quantize_x(x.f32(), n, k, q.ptr<int8_t>(), d.f32(), s.f32(), st_);
    }
    QuantX xq;
    xq.q = q.ptr<int8_t>();
    xq.d = d.f32();
    xq.s = s.f32();
    xq.k = k;
    return xq;
  }

  // The most rows the GEMV takes of block-type weights where a bf16 copy could serve.
  int64_t gemv_block_rows() const { return gemv_rows_ >= 0 ? gemv_rows_ : 4; }
  // Few activation rows against weights of one type and width: the GEMV kernels.
  bool use_gemv(const std::vector<GpuWeight>& gw, int64_t n) const {
    if (debug_ & 1) return false;
    const bool q = is_quantized(gw[0].type);
    if (n > (q ? 2 * kGemvMaxRows : kGemvMaxRows)) return false;
    // Where cuBLAS can read bf16 rows as they are (no slab dequantization), it wins from a few rows
    // up (H200, E4B, tok/s at 1/2/4/8 rows: Q4_0 GEMV 293/477/710/835 vs cuBLAS -/304/642/1,209;
    // BF16 GEMV 194 at 1 row, 277 at 8 vs cuBLAS 185 and 1,325).
    const int64_t cap = q ? gemv_block_rows() : gemv_rows_ >= 0 ? gemv_rows_ : 1;
    if (n > cap) {
      bool gemm_ready = true;
      for (const GpuWeight& w : gw) gemm_ready = gemm_ready && (w.type == WType::BF16 || w.bf16);
      if (gemm_ready) return false;
    }
    for (const GpuWeight& w : gw)
      if (w.type != gw[0].type || w.cols != gw[0].cols || (!q && w.cols % 8 != 0)) return false;
    return true;
  }

  // More rows than the GEMV takes, of Q8_0/Q4_0 weights: the tensor-core kernels read the blocks as
  // they are. Weights without a bf16 copy take them below slab_rows_ rows (MARKBASE_CUDA_SLAB_ROWS,
  // default kSlabRows; 0: never slabs) and cuBLAS on dequantized slabs from there, where the slabs' GEMMs
  // outrun the block kernels (docs/cuda.md, "Weights": E4B and 31B Q4_0 prefill at 64-512 rows). Beside a
  // copy, the fragment-ordered copy's kernel up to kMmqRowsBesideCopies rows, cuBLAS on the bf16 copy above
  // (E4B Q4_0 on an H100, decode tok/s at 16/32/64 streams: 3,570-3,645 against cuBLAS's 2,440; 4,437-4,527
  // against 4,856; 6,057-8,467 against 8,979-9,058). MARKBASE_CUDA_MMQ_ROWS=N sends every product of at
  // most N rows there (planes where a weight has no fragment copy), 0 none.
  static constexpr int64_t kMmqRowsBesideCopies = 16, kSlabRows = 128;
  bool use_mmq(const std::vector<GpuWeight>& gw, int64_t n) const {
    if (mmq_rows_ == 0 || (mmq_rows_ > 0 && n > mmq_rows_) || n <= gemv_block_rows() || (debug_ & 1))
      return false;
    bool copies = true, frags = true;
    for (const GpuWeight& w : gw) {
      if (!mmq_supports(w) || w.type != gw[0].type || w.cols != gw[0].cols) return false;
      copies = copies && w.bf16;
      frags = frags && w.frag;
    }
    return mmq_rows_ > 0 || (!copies && (slab_rows_ <= 0 || n < slab_rows_)) ||
           (frags && n <= kMmqRowsBesideCopies) ||
           use_mmq_bf16(gw.data(), int(gw.size()), n) || use_mmq_wgmma(gw.data(), int(gw.size()), n);
  }
  // Q4_0 weights with fragment-ordered copies, more rows than the int8 kernel serves beside cuBLAS
  // and up to kMmqBf16Rows: the bf16-activation kernel (MARKBASE_CUDA_MMQ_BF16_FROM < n <=
  // MARKBASE_CUDA_MMQ_BF16_ROWS). E4B Q4_0 on an H100, decode tok/s against cuBLAS on the bf16 copies:
  // 17 streams 3,849 against 2,083, 32 6,373 against 4,657, 48 7,481 against 6,808, 64 7,911 against
  // 8,693 (cuBLAS keeps 64 and more; docs/cuda.md).
  static constexpr int64_t kMmqBf16Rows = 48;
  bool use_mmq_bf16(const GpuWeight* ws, int nw, int64_t n) const {
    return n > mmq_bf16_from_ && n <= mmq_bf16_rows_ && !(debug_ & 1) && mmq_bf16_supports(ws, nw);
  }
  // Past those rows, up to MARKBASE_CUDA_MMQ_WGMMA_ROWS (default kMmqWgmmaRows: none), the same weights on
  // Hopper's warpgroup products (mmq_bf16's warpgroup kernel). Not yet the default: E4B Q4_0 on an H200 decoded
  // 5,313 / 6,745 tok/s at 64 / 128 streams on it against cuBLAS's 8,159 / 16,454 (docs/cuda.md).
  static constexpr int64_t kMmqWgmmaRows = 0;
  bool use_mmq_wgmma(const GpuWeight* ws, int nw, int64_t n) const {
    return n > std::max(mmq_bf16_from_, mmq_bf16_rows_) && n <= mmq_wgmma_rows_ && !(debug_ & 1) &&
           sm90_ && mmq_bf16_supports(ws, nw);
  }

  void mmq_batch(const GpuWeight* ws, float* const* ys, int nw, MmqMode mode, const float* m, const Tensor& x) {
    const int64_t n = x.rows(), k = x.cols(), rows = tiled_x_rows(n);
    const bool wgmma = use_mmq_wgmma(ws, nw, n), bf16 = wgmma || use_mmq_bf16(ws, nw, n);
    Tensor xb, q, d;  // the activations first: a copy that the kernel before wrote is taken before any other call
    if (bf16) {
      bf16_input(x, xb);
    } else if (!take_norm_quant(x, CopyLayout::Tiled, q, &d)) {
      q = scratch(DType::U8, {rows * k});
      d = scratch(DType::F32, {rows * k / 32});
      tile_x(x.f32(), n, k, nullptr, 1, rows, q.ptr<int8_t>(), d.f32(), st_);
    }
    const int64_t splits = mmq_splits(ws, nw, n, wgmma ? mmq_wgmma_groups(n) : 0);
    int64_t total = 0;
    for (int i = 0; i < nw; ++i) total += ws[i].rows;
    Tensor part;
    if (!mmq_direct(ws, nw, mode, splits)) part = scratch(DType::F32, {splits * n * total});
    float* p = part.empty() ? nullptr : part.f32();
    if (bf16)
      mmq_bf16(ws, ys, nw, mode, m, xb.ptr<uint16_t>(), n, splits, p, wgmma, st_);
    else
      mmq(ws, ys, nw, mode, m, q.ptr<int8_t>(), d.f32(), n, splits, p, st_);
  }

  void gemv_batch(const GpuWeight* ws, float* const* ys, int nw, bool glu, const Tensor& x) {
    const int64_t n = x.rows();
    Tensor q, d, s;
    QuantX xq{};
    if (is_quantized(ws[0].type)) xq = quantized(x, q, d, s);
    gemv_multi(ws, ys, nw, glu, x.f32(), &xq, n, st_);
  }

  // x in bf16 for cuBLAS into xb, once: a norm's bf16 copy where it made one, else a conversion.
  void bf16_input(const Tensor& x, Tensor& xb) {
    if (!xb.empty() || take_norm_quant(x, CopyLayout::Bf16, xb)) return;
    xb = scratch(DType::BF16, {x.rows(), x.cols()});
    cuda::f32_to_bf16(x.f32(), x.numel(), xb.ptr<uint16_t>(), st_);
  }
  // A weight's bf16 rows for cuBLAS (bf16 weights themselves, else their copy), null where it has none.
  static const uint16_t* bf16_rows(const GpuWeight& w) {
    return w.type == WType::BF16 ? static_cast<const uint16_t*>(w.qs) : w.bf16;
  }

  // y[n, m] = x · wᵀ on cuBLAS: f32 weights as f32, the others as bf16 with f32 accumulation. xb
  // holds x in bf16 once made (products sharing an input convert it once).
  void gemm(const Tensor& x, Tensor& xb, const GpuWeight& w, Tensor& y) {
    const int64_t n = x.rows(), k = x.cols(), m = w.rows;
    const float one = 1.f, zero = 0.f;
    if (w.type == WType::F32) {
      check_blas(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(n), int(k), &one,
                             static_cast<const float*>(w.qs), int(k), x.f32(), int(k), &zero, y.f32(), int(m)),
                 "f32 matrix product");
      return;
    }
    bf16_input(x, xb);
    auto run = [&](const uint16_t* wb, int64_t row0, int64_t rows) {
      // Rows [row0, row0 + rows) of w give the output's columns there: ldc stays m.
      const Plan& p = plan(rows, n, k, m);
      check_blas(cublasLtMatmul(lt_, p.op, &one, wb, p.a, xb.data, p.b, &zero, y.f32() + row0, p.c, y.f32() + row0, p.c,
                                &p.algo, blas_ws_, kBlasWorkspace, st_),
                 "bf16 matrix product");
    };
    if (const uint16_t* rows = bf16_rows(w)) return run(rows, 0, m);
    // No bf16 copy: dequantize a slab of rows at a time, a whole weight up to 256M values (512 MB of
    // scratch), so that one GEMM covers the weight: smaller slabs of a large weight (31B's FFN down
    // product in 3,120 rows of 21,504) left part of the GPU empty (docs/cuda.md, "Weights").
    const int64_t slab = std::max<int64_t>(1, std::min<int64_t>(m, (int64_t(256) << 20) / std::max<int64_t>(k, 1)));
    Tensor wb = scratch(DType::BF16, {slab, k});
    for (int64_t r0 = 0; r0 < m; r0 += slab) {
      const int64_t rows = std::min(slab, m - r0);
      dequant_bf16(w, r0, rows, wb.ptr<uint16_t>(), st_);
      run(wb.ptr<uint16_t>(), r0, rows);
    }
  }

  // gate and up over one input as one cuBLASLt product of batch 2 (the second weight at its distance
  // from the first in memory, the outputs one [2, n, m] buffer): one launch of twice the tiles fills
  // the waves that two launches of a prompt's few hundred rows leave part empty. Returns the index
  // (0 or 1) of gate's output in y2 (made here, [2, n, m]), or -1 where a weight has no bf16 rows or
  // cuBLASLt refuses the weights' distance for the shape's algorithm (refused, the pair is not tried
  // again).
  int gemm_pair(const Tensor& x, Tensor& xb, const GpuWeight& wg, const GpuWeight& wu, Tensor& y2) {
    const uint16_t *g = bf16_rows(wg), *u = bf16_rows(wu);
    const int64_t n = x.rows(), k = x.cols(), m = wg.rows;
    if (!g || !u || wu.rows != m || wu.cols != k) return -1;
    bf16_input(x, xb);
    y2 = scratch(DType::F32, {2, n, m});
    const bool up_first = u < g;  // a batch's matrices lie at a positive distance
    const uint16_t* a0 = up_first ? u : g;
    const int64_t dist = (up_first ? g - u : u - g);
    const Plan& p = plan(m, n, k, m, 2);
    cublasLtMatrixLayoutSetAttribute(p.a, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &dist, sizeof(dist));
    const float one = 1.f, zero = 0.f;
    const cublasStatus_t st = cublasLtMatmul(lt_, p.op, &one, a0, p.a, xb.data, p.b, &zero, y2.f32(), p.c, y2.f32(),
                                             p.c, &p.algo, blas_ws_, kBlasWorkspace, st_);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
      pair_glu_ = false;
      return -1;
    }
    check_blas(st, "bf16 matrix product pair");
    return up_first ? 1 : 0;
  }

  // A bf16 product's cuBLASLt descriptors and algorithm, chosen once per shape: asking the
  // heuristic on every call (what cublasGemmEx does) cost more host time than a prefill's kernels.
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // batch 2: two weights over the same input into one [2, n, m] output (gemm_pair); the weights'
  // distance is set on p.a before each call.
  const Plan& plan(int64_t m, int64_t n, int64_t k, int64_t ldc, int batch = 1) {
    const std::array<int64_t, 5> key = {m, n, k, ldc, batch};
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    Plan p;
    check_blas(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "a matmul descriptor");
    const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
    cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn));
    check_blas(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, uint64_t(k), uint64_t(m), k), "a matrix layout");
    check_blas(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, uint64_t(k), uint64_t(n), k), "a matrix layout");
    check_blas(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, uint64_t(m), uint64_t(n), ldc), "a matrix layout");
    if (batch > 1) {
      const int64_t sa = m * k, sb = 0, sc = ldc * n;
      for (cublasLtMatrixLayout_t l : {p.a, p.b, p.c})
        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch));
      cublasLtMatrixLayoutSetAttribute(p.a, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sa, sizeof(sa));
      cublasLtMatrixLayoutSetAttribute(p.b, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sb, sizeof(sb));
      cublasLtMatrixLayoutSetAttribute(p.c, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &sc, sizeof(sc));
    }
    cublasLtMatmulPreference_t pref = nullptr;
    cublasLtMatmulPreferenceCreate(&pref);
    const size_t ws = kBlasWorkspace;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, p.op, p.a, p.b, p.c, p.c, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    MB_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0, "cuBLASLt has no algorithm for a bf16 product {}x{}x{}", m,
             n, k);
    p.algo = res.algo;
    return plans_.emplace(key, p).first->second;
  }

  bool want_bf16_copy(size_t bytes) {
    if (bf16_copies_ >= 0) return bf16_copies_ != 0;
    return want_copy(bytes);
  }
  // Only while at least tenths / 10 of the GPU (40% by default) stays free for the rest of the
  // weights and the KV pages.
  bool want_copy(size_t bytes, int tenths = 4) const {
    size_t free_b = 0, total = 0;
    cudaMemGetInfo(&free_b, &total);
    return free_b > bytes && free_b - bytes > total / 10 * size_t(tenths);
  }

  void check_kv(const KVStore& kv, const Tensor& rows) const {
    MB_CHECK(kv.k.dtype == DType::BF16 && kv.k.device == Device::CUDA && kv.k.rank() == 3 &&
                 kv.k.dim(2) == rows.dim(2),
             "cuda backend: KV store {} {} does not fit rows {} (bf16 KV on the GPU expected)", dtype_name(kv.k.dtype),
             kv.k.shape_str(), rows.shape_str());
  }

  KVSeq kv_seq(const KVStore& kv, int64_t begin, int64_t count, const int32_t* pos) {
    KVSeq s;
    s.k = kv.k.data;
    s.v = kv.v.data;
    s.capacity = kv.capacity > 0 ? kv.capacity : kv.k.dim(0);
    s.ring = kv.ring ? 1 : 0;
    if (kv.pages) {
      MB_CHECK(kv.page_size > 0 && (kv.page_size & (kv.page_size - 1)) == 0, "KV pages of {} rows", kv.page_size);
      s.pages = dev(kv.pages, kv.n_pages);
      s.page_shift = __builtin_ctzll(uint64_t(kv.page_size));
    }
    s.pos = dev(pos, count);
    s.begin = int32_t(begin);
    s.count = int32_t(count);
    return s;
  }

  void abandon_recording() {
    if (!recording_) return;
    recording_ = false;
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(st_, &g);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
  }

  int device_;
  bool sm90_ = false;  // compute capability 9.0: the warpgroup kernels' sm_90a machine code runs
  std::string gpu_name_;
  std::unique_ptr<Backend> cpu_;
  std::shared_ptr<ScratchPool> pool_;
  cudaStream_t st_ = nullptr;
  cudaEvent_t staged_ = nullptr;
  std::vector<cudaEvent_t> marks_;  // mark()'s events, reused; the first n_marks_ are recorded
  size_t n_marks_ = 0;
  cublasHandle_t blas_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  std::map<std::array<int64_t, 5>, Plan> plans_;
  void* blas_ws_ = nullptr;
  bool graphs_on_ = true;
  int bf16_copies_ = -1;
  int gemv_rows_ = -1;  // MARKBASE_CUDA_GEMV_ROWS: most rows for the GEMV where cuBLAS could run (-1: use_gemv's)
  int slab_rows_ = int(kSlabRows);  // MARKBASE_CUDA_SLAB_ROWS: rows from which weights without copies take slabs
  int mmq_rows_ = -1;  // MARKBASE_CUDA_MMQ_ROWS: most rows for the tensor-core block products (-1: use_mmq's)
  bool frag_copies_ = true;  // MARKBASE_CUDA_FRAG_COPIES=0: no fragment-ordered copies (the kernels read the planes)
  // MARKBASE_CUDA_MMQ_BF16_FROM/_ROWS: see use_mmq_bf16
  int mmq_bf16_from_ = int(kMmqRowsBesideCopies), mmq_bf16_rows_ = int(kMmqBf16Rows);
  int mmq_wgmma_rows_ = int(kMmqWgmmaRows);
  // MARKBASE_CUDA_MOE_GEMV_GLU (default 1; 0: the GEMV writes [pairs, 2I] and gelu_split_mul activates it): the
  // pair-by-pair experts' GEMV writes gelu_tanh(gate) * up itself (docs/cuda.md, grouped experts).
  bool moe_gemv_glu_ = true;
  int mmq_pairs_ = -1;  // MARKBASE_CUDA_MMQ_PAIRS: fewest token-expert pairs for the grouped products (-1: see moe_gated_experts)
  int debug_ = 0;
  bool fuse_quant_ = true;  // MARKBASE_CUDA_NORM_QUANT=0: norms do not quantize their output
  bool tiled_quant_ = true;   // MARKBASE_CUDA_TILED_QUANT=0: off; see NormQuant
  bool bf16_out_ = true;      // MARKBASE_CUDA_BF16_OUT=0: off; see NormQuant
  bool dense_prefill_ = true;    // MARKBASE_CUDA_DENSE_PREFILL=0: off
  int64_t ffn_rows_ = 2048;      // MARKBASE_CUDA_FFN_ROWS: the rows of one gated_ffn call
  bool pair_glu_ = true;         // MARKBASE_CUDA_PAIR_GLU=0: gate and up as two cuBLAS products
  bool dense_attention_ = true;  // MARKBASE_CUDA_DENSE_ATTENTION
  bool fused_whole_ = true;      // MARKBASE_CUDA_FUSED_WHOLE: an image's attention in one fused kernel (head dims <= 80)
  bool moe_glu_ = true;          // MARKBASE_CUDA_MOE_GLU=0: the grouped experts' GLU in its own kernel
  bool recording_ = false;
  bool seq_scan_ = false;  // MARKBASE_CUDA_SEQ_SCAN=1: kernels find a row's sequence by a scan (order_rows)
  std::unordered_map<uint64_t, cudaGraphExec_t> graphs_;
  std::unordered_set<uint64_t> seen_;
  void* staged_host_ = nullptr;
  void* pinned_ = nullptr;  // to_host's bounce buffer
  size_t pinned_cap_ = 0;
  Tensor staged_dev_;
  size_t staged_cap_ = 0;
  std::vector<Span> spans_;
  std::vector<Tensor> uploads_;
  std::map<std::pair<uint64_t, uint64_t>, Tensor> const_cache_;
};

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

int compute_capability() {
  int major = 0, minor = 0;
  if (device_count() == 0 || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major * 10 + minor;
}

std::unique_ptr<Backend> make_backend(int device) { return std::make_unique<CudaBackend>(device); }

}  // namespace mb::cuda
