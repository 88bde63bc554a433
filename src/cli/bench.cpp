// `markbase bench`: prompt processing (pp) and generation (tg) throughput, per batch size, on a
// checkpoint or on synthetic weights with the real shapes of a Gemma 4 size; and memory read
// bandwidth, so tg can be read as a fraction of the memory floor.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "backends/backend.h"
#include "backends/cpu/cpu_kernels.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "formats/checkpoint.h"
#include "models/model.h"
#include "models/synthetic.h"
#include "runtime/kv_cache.h"

namespace mb::cli {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Read bandwidth of a buffer much larger than the caches, all threads, best of several passes.
double measure_read_bandwidth_gbs(size_t bytes = size_t(1) << 30) {
  Tensor buf = host_tensor(DType::F32, {int64_t(bytes / 4)});
  auto& pool = ThreadPool::global();
  const int64_t n = buf.numel();
  pool.parallel_for(n, 1 << 20, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) buf.f32()[i] = float(i & 7);
  });
  double best = 0;
  std::vector<float> sinks(size_t(pool.size()) * 16);
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    pool.run_on_all([&](int t, int nt) {
      const int64_t per = (n / nt + 15) / 16 * 16, b = std::min(n, per * t), e = std::min(n, b + per);
      sinks[size_t(t) * 16] = cpu::sum_f32(buf.f32() + b, e - b);
    });
    best = std::max(best, double(bytes) / since(t0) / 1e9);
  }
  return best;
}

struct BenchArgs {
  std::string model, synthetic, dtype = "auto", batches = "1";
  int pp = 512, tg = 128, reps = 3, threads = 0;
  bool json = false, membw = false;
};

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& v : t) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    v = int32_t(3 + (seed >> 33) % uint64_t(vocab - 3));
  }
  return t;
}

void run_bench(const BenchArgs& a) {
  if (a.threads > 0) ThreadPool::set_global_threads(a.threads);
  const int threads = ThreadPool::global().size();
  if (a.membw) {
    double gbs = measure_read_bandwidth_gbs();
    if (a.json) std::printf("%s\n", nlohmann::json{{"membw_gb_per_s", gbs}, {"threads", threads}}.dump().c_str());
    else std::printf("memory read bandwidth: %.1f GB/s (%d threads)\n", gbs, threads);
    if (a.model.empty() && a.synthetic.empty()) return;
  }
  MB_CHECK(a.model.empty() != a.synthetic.empty(), "bench: give exactly one of -m PATH or --synthetic NAME");
  MB_CHECK(a.pp >= 0 && a.tg >= 0 && a.pp + a.tg > 0 && a.reps > 0, "bench: --pp/--tg must be >= 0, not both 0");
  std::vector<int32_t> batches = parse_token_list(a.batches);
  for (int32_t b : batches) MB_CHECK(b >= 1 && b <= 1024, "bench: batch size {} out of range", b);

  DType dtype = DType::BF16;
  bool keep = a.dtype == "auto";
  if (a.dtype == "f32") dtype = DType::F32;
  else if (a.dtype == "bf16" || a.dtype == "auto") dtype = DType::BF16;
  else if (a.dtype == "f16") dtype = DType::F16;
  else fail("bench: --dtype {} is not supported by this build (auto, f32, bf16, f16)", a.dtype);

  std::fprintf(stderr, "bench: loading %s ...\n", a.model.empty() ? ("synthetic " + a.synthetic).c_str() : a.model.c_str());
  std::shared_ptr<Checkpoint> ck = a.model.empty() ? make_synthetic_checkpoint(a.synthetic, dtype)
                                                   : std::shared_ptr<Checkpoint>(open_checkpoint(a.model));
  auto be = make_cpu_backend();
  ModelLoadOptions mo;
  mo.keep_checkpoint_dtype = keep || !a.synthetic.empty();
  mo.weight_dtype = dtype;
  auto model = load_model(ck, *be, mo);
  const ModelConfig& c = model->config();
  const std::string name = a.model.empty() ? a.synthetic : a.model;
  const std::string dtype_label = keep && a.synthetic.empty() ? std::string(dtype_name(c.checkpoint_dtype)) : a.dtype;
  const double wbytes = double(model->decode_weight_bytes());

  if (!a.json)
    std::printf("| model | dtype | threads | batch | pp t/s | tg t/s | weight GB/token |\n|---|---|---|---|---|---|---|\n");
  for (int32_t B : batches) {
    std::vector<double> pp_rates, tg_rates;
    for (int rep = 0; rep < a.reps; ++rep) {
      KVCache kv(c, *be, {B, int64_t(a.pp + a.tg + 1), 512});
      std::vector<float> logits;
      auto t0 = Clock::now();
      for (int s = 0; s < B; ++s) {
        auto toks = random_tokens(a.pp, c.vocab_size, uint64_t(rep * 1000 + s + 1));
        for (int64_t off = 0; off < a.pp; off += 512) {
          const int64_t cnt = std::min<int64_t>(512, a.pp - off);
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
      t0 = Clock::now();
      for (int step = 0; step < a.tg; ++step) {
        Batch batch;
        for (int s = 0; s < B; ++s) {
          batch.tokens.push_back(int32_t(3 + (step * 7919 + s * 104729) % (c.vocab_size - 3)));
          batch.positions.push_back(a.pp + step);
          batch.seqs.push_back({s, s, 1});
          batch.logit_rows.push_back(s);
        }
        model->forward(batch, kv, logits);
        if (step % 8 == 0 && isatty(2))
          std::fprintf(stderr, "\rbench: batch %d rep %d/%d decode %d/%d      ", B, rep + 1, a.reps, step + 1, a.tg);
      }
      if (a.tg > 0) tg_rates.push_back(double(a.tg) * B / since(t0));
    }
    if (isatty(2)) std::fprintf(stderr, "\r%60s\r", "");
    const double pp = median(pp_rates), tg = median(tg_rates);
    if (a.json) {
      nlohmann::json j{{"model", name},          {"dtype", dtype_label},
                       {"threads", threads},     {"batch", B},
                       {"pp", a.pp},             {"tg", a.tg},
                       {"pp_tokens_per_s", pp},  {"tg_tokens_per_s", tg},
                       {"weight_bytes_per_token", wbytes}, {"reps", a.reps}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("| %s | %s | %d | %d | %.2f | %.2f | %.3f |\n", name.c_str(), dtype_label.c_str(), threads, B, pp, tg,
                  wbytes / 1e9);
    }
    std::fflush(stdout);
  }
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "measure prompt-processing and generation speed");
  auto a = std::make_shared<BenchArgs>();
  cmd->add_option("-m,--model", a->model, "checkpoint folder or .gguf file");
  cmd->add_option("--synthetic", a->synthetic, "random weights with the shapes of a Gemma 4 size")
      ->check(CLI::IsMember(synthetic_model_names()));
  cmd->add_option("--pp", a->pp, "prompt tokens per sequence (default 512)");
  cmd->add_option("--tg", a->tg, "generated tokens per sequence (default 128)");
  cmd->add_option("--batch", a->batches, "batch sizes, comma-separated (default 1)");
  cmd->add_option("--dtype", a->dtype, "weight dtype: auto, f32, bf16, f16");
  cmd->add_option("--threads", a->threads, "worker threads (0: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--reps", a->reps, "repetitions; the median is reported (default 3)");
  cmd->add_flag("--json", a->json, "one JSON object per line per batch size");
  cmd->add_flag("--membw", a->membw, "measure memory read bandwidth");
  cmd->callback([a] { run_bench(*a); });
}

}  // namespace mb::cli
