// `markbase bench`: prompt processing (pp) and generation (tg) throughput, per batch size, on a
// checkpoint or on synthetic weights with the real shapes of a Gemma 4 size (in any weight dtype,
// block types included); memory (weights, KV cache, peak resident set); and memory read
// bandwidth, so tg can be read as a fraction of the memory floor. --save writes the weights
// benchmarked as a GGUF llama.cpp runs, so both engines can be measured on the same file.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include <fmt/ranges.h>

#include "backends/backend.h"
#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/qmatmul.h"
#include "backends/profiling_backend.h"
#include "cli/commands.h"
#include "cli/files.h"
#include "cli/flags.h"
#include "core/error.h"
#include "core/mmap.h"
#include "core/splitmix64.h"
#include "core/stats.h"
#include "core/thread_pool.h"
#include "models/checkpoint.h"
#include "models/gguf_export.h"
#include "models/model.h"
#include "models/gemma4/synthetic.h"
#include "runtime/kv_cache.h"

namespace mb::cli {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Bytes of every L2 and L3 cache of the machine, each shared cache once (Linux sysfs; 0 when it
// says nothing). CPUID's answer is no use in a VM: this 32 MB-L3 EPYC guest reports 256 MB there.
size_t cache_bytes() {
  namespace fs = std::filesystem;
  std::set<std::string> seen;  // level + the CPUs sharing it: one entry per physical cache
  size_t total = 0;
  std::error_code ec;
  for (const auto& cpu : fs::directory_iterator("/sys/devices/system/cpu", ec)) {
    const std::string name = cpu.path().filename().string();
    if (name.rfind("cpu", 0) != 0 || name.size() < 4 || !std::isdigit(static_cast<unsigned char>(name[3]))) continue;
    for (const auto& idx : fs::directory_iterator(cpu.path() / "cache", ec)) {
      auto read = [&](const char* f) {
        std::ifstream in(idx.path() / f);
        std::string v;
        std::getline(in, v);
        return v;
      };
      const std::string level = read("level"), type = read("type"), size = read("size");
      if ((level != "2" && level != "3") || type == "Instruction" || size.empty()) continue;
      if (!seen.insert(level + "/" + read("shared_cpu_list")).second) continue;
      char* end = nullptr;
      size_t bytes = std::strtoull(size.c_str(), &end, 10);
      if (end && (*end == 'K' || *end == 'k')) bytes <<= 10;
      else if (end && *end == 'M') bytes <<= 20;
      total += bytes;
    }
  }
  return total;
}

// The probe's default buffer: at least 1 GiB and 20x the caches, so that what the caches keep
// of it between passes is under 5% of a pass. On a 16-core Xeon with a 300 MB adaptive L3 the
// median pass over 1 GiB (~3x the caches) swung 82-131 GB/s within two minutes while 8 GiB held
// 97-104 (docs/benchmarks.md, eighth pass). At most a quarter of the RAM.
size_t default_membw_mb() {
  const size_t want = std::max<size_t>(size_t(1) << 30, 20 * cache_bytes());
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  const size_t cap = pages > 0 && page > 0 ? size_t(pages) * size_t(page) / 4 : want;
  const size_t bytes = std::max<size_t>(size_t(1) << 30, std::min(want, cap));
  return (bytes + (size_t(256) << 20) - 1) / (size_t(256) << 20) * 256;  // whole 256 MiB
}

// Read bandwidth of a buffer much larger than the caches (cpu::read_bandwidth).
cpu::ReadBandwidth measure_read_bandwidth(size_t bytes) {
  // Allocated like the packed weights (huge pages where offered), so the floor is what the
  // weights' own memory can deliver.
  std::shared_ptr<uint8_t> mem = alloc_streamed(bytes);
  float* buf = reinterpret_cast<float*>(mem.get());
  const int64_t n = int64_t(bytes / 4);
  ThreadPool::global().parallel_for(n, 1 << 20, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) buf[i] = float(i & 7);
  });
  return cpu::read_bandwidth(buf, n);
}

// --profile: the profiler's op times of one phase (prefill or decode) summed over the reps.
struct PhaseProfile {
  std::map<std::string, ProfilingBackend::Entry> ops;
  double seconds = 0;  // wall time of the phase
  int64_t units = 0;   // prompts or decode steps

  void add(ProfilingBackend& p, double phase_seconds, int64_t n_units) {
    for (const auto& e : p.entries()) {
      auto& o = ops[e.label];
      o.label = e.label;
      o.calls += e.calls;
      o.seconds += e.seconds;
      o.weight_bytes += e.weight_bytes;
      o.host = e.host;
    }
    p.reset();
    seconds += phase_seconds;
    units += n_units;
  }

  // One table on stderr: per unit (a prompt, a step), each op's time, share of the phase, calls
  // and, for matmuls, the weight bytes per second they read.
  void print(const char* phase, int batch, const char* unit) const {
    if (units == 0 || seconds <= 0) return;
    std::vector<ProfilingBackend::Entry> rows;
    double in_ops = 0;
    for (const auto& [label, e] : ops) {
      rows.push_back(e);
      in_ops += e.host ? 0.0 : e.seconds;
    }
    std::fprintf(stderr, "bench: %s profile, batch %d: %.3f ms a %s, %.1f%% of it inside backend ops\n%s", phase,
                 batch, seconds * 1e3 / double(units), unit, 100 * in_ops / seconds,
                 ProfilingBackend::format_rows(std::move(rows), seconds, double(units)).c_str());
  }
};

// --pp and --tg: a sequence's KV cache holds pp + tg + 1 positions.
constexpr int kMaxBenchTokens = 1 << 20;

struct BenchArgs {
  std::string model, synthetic, dtype = "auto", batches = "1", save, tokenizer, device = "cpu";
  int pp = 512, tg = 128, reps = 3, threads = 0;
  // Decode steps pick by these (the draws from a fixed stream) instead of greedily: what sampling
  // costs where the logits are.
  float temperature = 0.f, top_p = 1.f, min_p = 0.f;
  int top_k = 0;
  int64_t membw_mb = 0;  // 0: default_membw_mb()
  bool json = false, membw = false, profile = false;
};

// Peak resident set of this process so far (Linux reports ru_maxrss in KiB).
size_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return size_t(u.ru_maxrss) * 1024;
}

// The Gemma 4 tokenizer.json a synthetic model is saved with (its 262144 ids are the synthetic
// vocabulary): --tokenizer, else the project's shared copy, looked for beside the repository
// (../shared from the repository root, found from the working directory or from the binary).
std::string synthetic_tokenizer_path(const std::string& given) {
  namespace fs = std::filesystem;
  if (!given.empty()) {
    MB_CHECK(fs::is_regular_file(given), "bench --save: tokenizer file {} does not exist", given);
    return given;
  }
  const fs::path rel = fs::path("shared") / "data" / "tokenizer" / "gemma4-tokenizer.json";
  std::vector<fs::path> tried;
  std::error_code ec;
  tried.push_back(fs::current_path(ec) / ".." / rel);
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec)  // build/bin/markbase -> <repo>/../shared
    tried.push_back(exe.parent_path() / ".." / ".." / ".." / rel);
  std::string names;
  for (auto& p : tried) {
    const std::string c = fs::weakly_canonical(p, ec).string();
    if (fs::is_regular_file(c, ec)) return c;
    if (names.find(c) == std::string::npos) names += (names.empty() ? "" : " or ") + c;
  }
  fail("bench --save: a synthetic model is saved with the Gemma 4 tokenizer (llama.cpp refuses a GGUF without "
       "one), but it is not at {}; pass --tokenizer FILE (a Gemma 4 tokenizer.json with 262144 ids)", names);
}

// -m with --dtype: the quantization type that writes what the model converted to at load.
QuantType save_quant_type(const std::string& dtype) {
  if (dtype == "auto") return QuantType::Keep;
  MB_CHECK(dtype == "f32" || dtype == "bf16" || dtype == "q8_0" || dtype == "q4_0",
           "bench: -m PATH --dtype {} --save cannot write the converted model (use --dtype auto, f32, bf16, q8_0 or "
           "q4_0, or `markbase quantize`)", dtype);
  return parse_quant_type(dtype);
}

void save_gguf(const Checkpoint& ck, const BenchArgs& a) {
  namespace fs = std::filesystem;
  const QuantType q = a.synthetic.empty() ? save_quant_type(a.dtype) : QuantType::Keep;
  const std::string tok = !a.synthetic.empty() ? synthetic_tokenizer_path(a.tokenizer) : a.tokenizer;
  const auto t0 = Clock::now();
  std::fprintf(stderr, "bench: saving %s ...\n", a.save.c_str());
  // Written as FILE.part and renamed at the end: a failure or Ctrl-C never leaves a truncated file.
  PartialOutput part(a.save);
  // In a child process, so that what the export allocates (the tokenizer's JSON, re-encoded
  // tensors) never counts in the peak RSS this benchmark reports. The child shares the weights
  // copy-on-write and only reads them; export_gguf runs on the calling thread alone.
  std::fflush(nullptr);
  const pid_t parent = getpid(), pid = fork();
  MB_CHECK(pid >= 0, "bench --save: fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    PartialOutput::die_with_parent(parent);
    int rc = 0;
    try {
      export_gguf(ck, part.temp_path(), q, nullptr, tok);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      rc = 1;
    }
    std::fflush(nullptr);
    _exit(rc);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail("bench --save: writing {} failed{}", a.save,
         WIFSIGNALED(status) ? fmt::format(" (signal {})", WTERMSIG(status)) : std::string());
  part.commit();
  rusage child{};
  getrusage(RUSAGE_CHILDREN, &child);
  std::fprintf(stderr, "bench: wrote %s (%.1f MB) in %.1f s (peak RSS of the export: %.3f GB)\n", a.save.c_str(),
               double(fs::file_size(a.save)) / 1e6, since(t0), double(child.ru_maxrss) * 1024 / 1e9);
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& v : t) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    v = int32_t(3 + (seed >> 33) % uint64_t(vocab - 3));
  }
  return t;
}

void run_bench(const BenchArgs& a) {
  if (const std::string w = threads_warning(a.threads); !w.empty()) std::fprintf(stderr, "%s\n", w.c_str());
  if (a.threads > 0) ThreadPool::set_global_threads(a.threads);
  const int threads = ThreadPool::global().size();
  if (a.membw && a.device == "cuda") {
    // The device's memory: a copy kernel over a buffer far larger than the GPU's L2.
    const size_t bytes = size_t(a.membw_mb > 0 ? a.membw_mb : 2048) << 20;
    const double bw = make_backend("cuda")->measure_copy_bandwidth(bytes);
    if (a.json)
      std::printf("%s\n", nlohmann::json{{"membw_gb_per_s", bw / 1e9}, {"membw_mb", bytes >> 20}, {"device", "cuda"}}
                              .dump()
                              .c_str());
    else std::printf("GPU memory bandwidth (copy, read + write): %.1f GB/s (a %zu MiB buffer)\n", bw / 1e9, bytes >> 20);
    if (a.model.empty() && a.synthetic.empty()) return;
  } else if (a.membw) {
    MB_CHECK(a.membw_mb == 0 || a.membw_mb >= 64, "bench: --membw-mb must be at least 64 (the probe must not fit the caches), got {}",
             a.membw_mb);
    const int64_t probe_mb = a.membw_mb > 0 ? a.membw_mb : int64_t(default_membw_mb());
    const cpu::ReadBandwidth bw = measure_read_bandwidth(size_t(probe_mb) << 20);
    const double gbs = bw.best / 1e9, median = bw.median / 1e9;
    if (a.json)
      std::printf("%s\n", nlohmann::json{{"membw_gb_per_s", gbs}, {"membw_median_gb_per_s", median}, {"membw_mb", probe_mb}, {"threads", threads}}
                              .dump()
                              .c_str());
    else std::printf("memory read bandwidth: %.1f GB/s (median of the passes %.1f; %d threads, a %lld MiB buffer)\n", gbs, median, threads, static_cast<long long>(probe_mb));
    if (a.model.empty() && a.synthetic.empty()) return;
  }
  MB_CHECK(a.model.empty() != a.synthetic.empty(), "bench: give exactly one of -m PATH or --synthetic NAME");
  if (!a.save.empty()) check_output_path(a.model, a.save, "bench --save");
  MB_CHECK(a.pp >= 0 && a.tg >= 0 && (a.pp + a.tg > 0 || !a.save.empty()) && a.reps > 0,
           "bench: --pp/--tg must be >= 0, not both 0 (except with --save: save only)");
  std::vector<int32_t> batches = parse_token_list(a.batches, "--batch");
  for (int32_t b : batches) MB_CHECK(b >= 1 && b <= 1024, "--batch: batch size {} is not from 1 to 1024", b);

  bool keep = a.dtype == "auto";
  const std::optional<DType> named = keep ? DType::BF16 : weight_dtype_from_name(a.dtype);
  MB_CHECK(named.has_value(), "bench: --dtype {} is not supported (auto, {})", a.dtype, fmt::join(weight_dtype_names(), ", "));
  const DType dtype = *named;

  const char* isa = a.device == "cuda" ? "cuda" : cpu::isa_name(cpu::kernels().isa);
  // How block-quantized matmuls run: the integer kernel (8-bit activations) or f32 activations.
  const char* quant_matmul = a.device == "cuda" || cpu::qmatmul_kernel() ? "int8" : "exact";
  std::fprintf(stderr, "bench: %s %s, %d threads, %s kernels, %s quantized matmuls: loading ...\n",
               a.model.empty() ? ("synthetic " + a.synthetic).c_str() : a.model.c_str(), a.dtype.c_str(), threads, isa,
               quant_matmul);
  auto t_load = Clock::now();
  // Synthetic weights are built in the dtype asked for (block types row by row), so the model
  // uses them as they are; a checkpoint is converted at load unless --dtype is auto.
  std::shared_ptr<Checkpoint> ck = a.model.empty() ? make_synthetic_checkpoint(a.synthetic, dtype)
                                                   : std::shared_ptr<Checkpoint>(open_checkpoint(a.model));
  if (!a.save.empty()) {
    save_gguf(*ck, a);
    if (a.pp + a.tg == 0) return;
  }
  std::unique_ptr<Backend> cpu_backend = make_backend(a.device);
  std::unique_ptr<ProfilingBackend> profiler;
  if (a.profile) profiler = std::make_unique<ProfilingBackend>(*cpu_backend);
  Backend* be = profiler ? static_cast<Backend*>(profiler.get()) : cpu_backend.get();
  ModelLoadOptions mo;
  mo.keep_checkpoint_dtype = keep || !a.synthetic.empty();
  mo.weight_dtype = dtype;
  auto model = load_model(ck, *be, mo);
  ck->gguf.reset();  // metadata (token strings, several MB) is not needed once the model is built
  const ModelConfig& c = model->config();
  const std::string name = a.model.empty() ? a.synthetic : a.model;
  std::string dtype_label = a.dtype;
  if (keep && a.synthetic.empty()) dtype_label = std::string(dtype_name(c.checkpoint_dtype));
  else if (keep) dtype_label = "bf16";
  const double wbytes = double(model->decode_weight_bytes());
  // Weights the model holds, mapped or owned: its matrices and norms, plus the PLE table it reads
  // in place (KV-shared layers' unused K/V projections are not counted).
  size_t weight_bytes = model->weight_bytes();
  if (const TensorEntry* ple = ck->tensors.find(c.tensor_prefix + "embed_tokens_per_layer.weight"))
    weight_bytes += ple->nbytes;
  std::fprintf(stderr, "bench: ready in %.1f s: weights %.3f GB, peak RSS %.3f GB\n", since(t_load),
               double(weight_bytes) / 1e9, double(peak_rss_bytes()) / 1e9);

  // One decode step of B sequences (slot s = sequence s) at position pos, tokens varying by step.
  auto decode_batch = [&](int32_t B, int32_t pos, int step) {
    Batch batch;
    for (int s = 0; s < B; ++s) {
      batch.tokens.push_back(int32_t(3 + (step * 7919 + s * 104729) % (c.vocab_size - 3)));
      batch.positions.push_back(pos);
      batch.seqs.push_back({s, s, 1});
      batch.logit_rows.push_back(s);
    }
    return batch;
  };
  {
    // One untimed decode step first, as llama-bench warms up: weights read in place from the
    // mapped file (unpacked dtypes, the f32-activation path) are faulted in here, not in the
    // first timed prefill.
    KVCache kv(c, *be, {1, 2, 1});
    std::vector<float> logits;
    std::vector<int32_t> picks;
    model->forward_pick(decode_batch(1, 0, 0), kv, {}, picks);
    // And one prompt's worth of prefill: a GPU backend loads its matrix-product kernels then.
    if (a.pp > 0 && a.device != "cpu") {
      const int64_t cnt = std::min<int64_t>(a.pp, kMaxStepTokens);
      KVCache kv2(c, *be, {1, cnt, kMaxStepTokens});
      Batch warm;
      warm.tokens = random_tokens(cnt, c.vocab_size, 7);
      for (int64_t i = 0; i < cnt; ++i) warm.positions.push_back(int32_t(i));
      warm.seqs.push_back({0, 0, cnt});
      warm.logit_rows.push_back(int32_t(cnt - 1));
      model->forward(warm, kv2, logits);
    }
  }
  if (!a.json)
    std::printf("| model | dtype | isa | threads | batch | pp t/s | tg t/s | weight GB/token | weights GB | KV GB | peak RSS GB |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int32_t B : batches) {
    std::vector<double> pp_rates, tg_rates;
    size_t kv_bytes = 0;
    PhaseProfile pp_profile, tg_profile;
    for (int rep = 0; rep < a.reps; ++rep) {
      KVCache kv(c, *be, {B, int64_t(a.pp + a.tg + 1), kMaxStepTokens});
      kv_bytes = kv.bytes();
      std::vector<float> logits;
      if (profiler) profiler->set_enabled(true);
      auto t0 = Clock::now();
      for (int s = 0; s < B; ++s) {
        auto toks = random_tokens(a.pp, c.vocab_size, uint64_t(rep * 1000 + s + 1));
        for (int64_t off = 0; off < a.pp; off += kMaxStepTokens) {
          const int64_t cnt = std::min<int64_t>(kMaxStepTokens, a.pp - off);
          Batch batch;
          batch.tokens.assign(toks.begin() + off, toks.begin() + off + cnt);
          for (int64_t i = 0; i < cnt; ++i) batch.positions.push_back(int32_t(off + i));
          batch.seqs.push_back({s, 0, cnt});
          batch.logit_rows.push_back(int32_t(cnt - 1));
          model->forward(batch, kv, logits);
        }
        if (isatty(2)) std::fprintf(stderr, "\rbench: batch %d rep %d/%d prefill %d/%d   ", B, rep + 1, a.reps, s + 1, B);
      }
      if (a.pp > 0) pp_rates.push_back(double(a.pp) * B / since(t0));
      if (profiler) {
        profiler->set_enabled(false);
        if (a.pp > 0) pp_profile.add(*profiler, since(t0), B);
        profiler->reset();
        profiler->set_enabled(true);
      }
      t0 = Clock::now();
      // Each step ends with every sequence's pick, taken where the logits are (as `serve` does: on
      // a GPU, 4 bytes a sequence reach the host, not the vocabulary): greedy, or sampled.
      std::vector<int32_t> picks;
      std::vector<TokenPick> how;
      uint64_t stream = 0;
      for (int step = 0; step < a.tg; ++step) {
        if (a.temperature > 0.f) {
          how.assign(size_t(B), TokenPick{a.temperature, a.top_k, a.top_p, a.min_p, 0.0});
          for (TokenPick& p : how) p.u = double(splitmix64_next(stream) >> 11) * 0x1.0p-53;
        }
        model->forward_pick(decode_batch(B, a.pp + step, step), kv, how, picks);
        if (step % 8 == 0 && isatty(2))
          std::fprintf(stderr, "\rbench: batch %d rep %d/%d decode %d/%d      ", B, rep + 1, a.reps, step + 1, a.tg);
      }
      if (a.tg > 0) tg_rates.push_back(double(a.tg) * B / since(t0));
      if (profiler) {
        profiler->set_enabled(false);
        if (a.tg > 0) tg_profile.add(*profiler, since(t0), a.tg);
        profiler->reset();
      }
    }
    if (isatty(2)) std::fprintf(stderr, "\r%60s\r", "");
    const double pp = median(pp_rates), tg = median(tg_rates);
    const size_t rss = peak_rss_bytes();
    if (a.json) {
      nlohmann::json j{{"model", name},          {"dtype", dtype_label},
                       {"threads", threads},     {"batch", B},
                       {"pp", a.pp},             {"tg", a.tg},
                       {"pp_tokens_per_s", pp},  {"tg_tokens_per_s", tg},
                       {"weight_bytes_per_token", wbytes}, {"reps", a.reps},
                       {"isa", isa},             {"weight_bytes", weight_bytes},
                       {"kv_bytes", kv_bytes},   {"peak_rss_bytes", rss},
                       {"quant_matmul", quant_matmul}};
      if (a.temperature > 0.f)
        j["sampling"] = {{"temperature", a.temperature}, {"top_k", a.top_k}, {"top_p", a.top_p}, {"min_p", a.min_p}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("| %s | %s | %s | %d | %d | %.2f | %.2f | %.3f | %.3f | %.3f | %.3f |\n", name.c_str(),
                  dtype_label.c_str(), isa, threads, B, pp, tg, wbytes / 1e9, double(weight_bytes) / 1e9,
                  double(kv_bytes) / 1e9, double(rss) / 1e9);
    }
    std::fflush(stdout);
    if (profiler) {
      pp_profile.print("prefill", B, "prompt");
      tg_profile.print("decode", B, "step");
    }
  }
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "measure prompt-processing and generation speed");
  auto a = std::make_shared<BenchArgs>();
  cmd->add_option("-m,--model", a->model, "checkpoint folder or .gguf file");
  cmd->add_option("--synthetic", a->synthetic, "random weights with the shapes of a Gemma 4 size (tiny: for tests)")
      ->check(CLI::IsMember(synthetic_model_names()));
  cmd->add_option("--pp", a->pp, "prompt tokens per sequence")->check(whole_number(0, kMaxBenchTokens));
  cmd->add_option("--tg", a->tg, "generated tokens per sequence")->check(whole_number(0, kMaxBenchTokens));
  cmd->add_option("--batch", a->batches, "batch sizes from 1 to 1024, comma-separated");
  cmd->add_option("--dtype", a->dtype,
                  "weight dtype: auto (the checkpoint's; bf16 for --synthetic), f32, bf16, f16, q8_0, q4_0, q4_k "
                  "(block types: rows that are not whole blocks stay bf16)");
  cmd->add_option("--save", a->save,
                  "write the weights benchmarked to this .gguf first (llama.cpp runs it), then benchmark");
  cmd->add_option("--tokenizer", a->tokenizer,
                  "tokenizer.json for --save (default for --synthetic: ../shared/data/tokenizer/gemma4-tokenizer.json)");
  add_threads_option(cmd, a->threads);
  cmd->add_option("--device", a->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--reps", a->reps, "repetitions; the median is reported")->check(whole_number(1, 1000000));
  cmd->add_flag("--json", a->json, "one JSON object per line per batch size");
  cmd->add_flag("--membw", a->membw, "measure memory read bandwidth");
  cmd->add_option("--membw-mb", a->membw_mb,
                  "size of the --membw probe's buffer in MiB, at least 64 (0: 1 GiB and at least 20x the L2+L3 caches)")
      ->check(whole_number(0, int64_t(1) << 24));
  cmd->add_option("--temperature", a->temperature, "decode by sampling at this temperature (0: greedy)")
      ->check(CLI::Range(0.f, 100.f));
  cmd->add_option("--top-k", a->top_k, "with --temperature: top-k (0: off)")->check(whole_number(0, int64_t(1) << 30));
  cmd->add_option("--top-p", a->top_p, "with --temperature: top-p (1: off)")->check(CLI::Range(0.f, 1.f));
  cmd->add_option("--min-p", a->min_p, "with --temperature: min-p (0: off)")->check(CLI::Range(0.f, 1.f));
  cmd->add_flag("--profile", a->profile,
                "time every backend op and print, per prompt and per decode step, where the time went (stderr)");
  cmd->callback([a] { run_bench(*a); });
}

}  // namespace mb::cli
