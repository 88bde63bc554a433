// Whole models on the CUDA backend against the CPU backend, on every fixture (and the real Gemma 3
// 270M GGUF when installed): prompt logits against the f32-weight model (PromptLogitsMatchCpu says
// how close), greedy continuations token for
// token (a flip is accepted only as a reported near-tie: the CPU's own logit gap between the two
// tokens within the CUDA-CPU difference at that position), no NaN, decode through the paged KV
// cache against prefill, several requests in one serving batch against each alone, and recorded
// decode steps (CUDA graphs) against the same steps issued op by op.
//
// Every test skips when mb::cuda_device_available() is false. Figures print as "[ cuda-model ]"
// lines; near-ties as "[ NEAR-TIE ]" lines (tools/device/gpu_suite.sh collects both).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/profiling_backend.h"
#include "markbase/markbase.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "runtime/engine_core.h"
#include "runtime/kv_cache.h"
#include "test_util.h"

namespace {

// Built with -DMB_CUDA_TEST_SELF_CHECK, "cuda" is the CPU backend again, on any machine: a check
// of the harness itself (every difference is then 0; the recorded-steps part skips).
#ifdef MB_CUDA_TEST_SELF_CHECK
const char* const kGpu = "cpu";
bool gpu_available() { return true; }
#else
const char* const kGpu = "cuda";
bool gpu_available() { return mb::cuda_device_available(); }
#endif

#define MB_SKIP_WITHOUT_CUDA() \
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device visible (or a build without CUDA)"

constexpr double kLogitTol = 3e-2;       // max |CUDA - CPU| / logit range, f32 and bf16 weights (bf16 KV)

struct FixtureData {
  std::string name, dir;
  std::vector<std::vector<int32_t>> prompts;
};

// The fixture's reference prompts (5, 32 and 20 tokens) and one of 150 seeded ids: many sliding
// windows and KV pages.
FixtureData load(const std::string& name) {
  FixtureData f{name, mbtest::fixture(name), {}};
  const auto ref = mbtest::read_json(f.dir + "/reference.json");
  for (auto& p : ref["prompts"]) f.prompts.push_back(p["tokens"].get<std::vector<int32_t>>());
  const int64_t vocab = ref["vocab_size"];
  std::mt19937 rng(20);
  std::vector<int32_t> longer = {2};
  while (longer.size() < 150) longer.push_back(int32_t(3 + rng() % uint32_t(vocab - 3)));
  f.prompts.push_back(longer);
  return f;
}

// A CPU engine rounds its K/V to bf16 as it writes them (kv = "bf16", MARKBASE_CPU_KV_ROUND), the
// precision of the CUDA backend's KV, unless kv = "f32": the random fixtures amplify that rounding
// alone to several percent of the logit range (PromptLogitsMatchCpu prints it), which would hide
// any real difference under a tolerance that wide.
std::unique_ptr<markbase::Engine> open_engine(const std::string& path, const std::string& device,
                                              const std::string& dtype, int64_t ctx = 512,
                                              const std::string& kv = "bf16") {
  markbase::EngineOptions o;
  o.model_path = path;
  o.device = device;
  o.dtype = dtype;
  o.max_context = ctx;
  std::optional<mbtest::ScopedEnv> round;
  if (device == "cpu" && kv == "bf16") round.emplace("MARKBASE_CPU_KV_ROUND", "bf16");
  return markbase::Engine::open(o);
}

struct LogitErr {
  double max_abs = 0, range = 0, rel = 0;
  size_t nonfinite = 0;
  bool bit_exact = true;
};

// max |a - ref| over all values, relative to the range (max - min) of ref.
LogitErr logit_error(const std::vector<float>& ref, const std::vector<float>& got) {
  LogitErr e;
  EXPECT_EQ(ref.size(), got.size());
  float lo = INFINITY, hi = -INFINITY;
  for (float v : ref) lo = std::min(lo, v), hi = std::max(hi, v);
  e.range = double(hi) - double(lo);
  for (size_t i = 0; i < std::min(ref.size(), got.size()); ++i) {
    if (!std::isfinite(got[i])) {
      ++e.nonfinite;
      continue;
    }
    e.max_abs = std::max(e.max_abs, std::fabs(double(got[i]) - double(ref[i])));
    if (std::memcmp(&got[i], &ref[i], 4) != 0) e.bit_exact = false;
  }
  e.rel = e.max_abs / std::max(e.range, 1e-30);
  return e;
}

std::vector<float> last_row(const std::vector<float>& logits, int64_t vocab) {
  return std::vector<float>(logits.end() - vocab, logits.end());
}

int32_t argmax(const float* row, int64_t n) { return int32_t(std::max_element(row, row + n) - row); }

class CudaModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { MB_SKIP_WITHOUT_CUDA(); }
};

// ---------------------------------------------------------------- prompt logits

// The reference is the CPU with f32 weights (and bf16-rounded K/V, as the GPU keeps them). Where a
// dtype leaves the CPU's numbers exactly those (f32 weights: "auto" on the f32 fixtures) the GPU does
// the same arithmetic and must match it to kLogitTol. Otherwise the two backends round differently
// (the GPU's prefill GEMMs take bf16 activations and bf16-dequantized weights, the CPU's f32 or int8
// activations with exact weights), and these random small models turn any such rounding into
// logit changes of up to half the range (bf16 weights alone move the CPU by 0.19 on moe_like): the
// GPU must then stay as close to the reference as kLogitTol + kOwnErrorFactor x the CPU's own
// distance with the same weights. Both distances print. The factor is 3, not 1: on the CPU alone,
// rounding the activations to bf16 as the GPU's bf16 path does moves e2b_like's 20-token prompt from
// 0.015 (bf16 weights) to 0.098 of the range, which is where the GPU lands.
constexpr double kOwnErrorFactor = 3.0;

TEST_P(CudaModel, PromptLogitsMatchCpu) {
  const FixtureData f = load(GetParam());
  auto exact = open_engine(f.dir, "cpu", "f32");
  std::vector<std::vector<float>> ref;
  for (const auto& prompt : f.prompts) ref.push_back(exact->prompt_logits(prompt, 0));
  for (const char* dtype : {"auto", "bf16", "q8_0", "q4_0"}) {
    SCOPED_TRACE(std::string("--dtype ") + dtype);
    auto cpu = open_engine(f.dir, "cpu", dtype), gpu = open_engine(f.dir, kGpu, dtype);
    double gpu_err = 0, cpu_err = 0, between = 0;
    for (size_t i = 0; i < f.prompts.size(); ++i) {
      const auto c = cpu->prompt_logits(f.prompts[i], 0), g = gpu->prompt_logits(f.prompts[i], 0);
      const LogitErr eg = logit_error(ref[i], g);
      EXPECT_EQ(eg.nonfinite, 0u) << "prompt " << i << ": non-finite CUDA logits";
      gpu_err = std::max(gpu_err, eg.rel);
      cpu_err = std::max(cpu_err, logit_error(ref[i], c).rel);
      between = std::max(between, logit_error(c, g).rel);
    }
    const bool same_arithmetic = cpu_err == 0;
    const double bound = same_arithmetic ? kLogitTol : kLogitTol + kOwnErrorFactor * cpu_err;
    EXPECT_LE(gpu_err, bound) << f.name << " --dtype " << dtype << ": the CPU's own distance " << cpu_err;
    std::printf("[ cuda-model ] %-13s --dtype %-4s prompt logits max|diff|/range vs f32 weights: cuda %.2e, cpu %.2e "
                "(bound %.2e%s); cuda vs cpu %.2e\n",
                f.name.c_str(), dtype, gpu_err, cpu_err, bound, same_arithmetic ? ", same arithmetic" : "", between);
  }
  // For the record: how far bf16 K/V alone moves the CPU (the GPU's K/V are bf16).
  auto f32kv = open_engine(f.dir, "cpu", "f32", 512, "f32");
  double own = 0;
  for (size_t i = 0; i < f.prompts.size(); ++i)
    own = std::max(own, logit_error(f32kv->prompt_logits(f.prompts[i], 0), ref[i]).rel);
  std::printf("[ cuda-model ] %-13s bf16 K/V alone moves the CPU's logits by %.2e of the range\n", f.name.c_str(), own);
}

// ---------------------------------------------------------------- greedy

// Greedy continuations of `n` tokens on both; a difference at token i passes only as a near-tie:
// the CPU's logits after prompt + its first i tokens rank its token over CUDA's by no more than
// twice the CUDA-CPU logit difference at that very position. Near-ties print "[ NEAR-TIE ]".
// Returns the number of near-ties.
int expect_same_greedy(markbase::Engine& cpu, markbase::Engine& gpu, const std::vector<int32_t>& prompt, int n,
                       const std::string& what) {
  markbase::Request req;
  req.prompt_tokens = prompt;
  req.max_new_tokens = n;
  req.stop_at_eos = false;
  const auto a = cpu.generate(req).tokens, b = gpu.generate(req).tokens;
  EXPECT_EQ(a.size(), size_t(n)) << what;
  EXPECT_EQ(b.size(), size_t(n)) << what;
  size_t i = 0;
  while (i < std::min(a.size(), b.size()) && a[i] == b[i]) ++i;
  if (i == std::min(a.size(), b.size())) return 0;
  const int64_t V = cpu.info().vocab_size;
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), a.begin(), a.begin() + std::ptrdiff_t(i));
  const auto rc = last_row(cpu.prompt_logits(seq, 0), V), rg = last_row(gpu.prompt_logits(seq, 0), V);
  const double gap = double(rc[size_t(a[i])]) - double(rc[size_t(b[i])]);
  const LogitErr e = logit_error(rc, rg);
  const bool near_tie = gap <= 2 * e.max_abs;
  std::printf("[ NEAR-TIE ] %s: greedy token %zu differs: cpu %d, cuda %d; cpu logit gap %.4g, cuda's own gap %.4g, "
              "max |cuda - cpu| at that position %.4g -> %s\n",
              what.c_str(), i, a[i], b[i], gap, double(rg[size_t(b[i])]) - double(rg[size_t(a[i])]), e.max_abs,
              near_tie ? "a near-tie (accepted, reported)" : "NOT a near-tie");
  EXPECT_TRUE(near_tie) << what << ": greedy token " << i << " differs (cpu " << a[i] << ", cuda " << b[i]
                        << ") by a cpu logit gap of " << gap << ", more than twice the logit difference " << e.max_abs;
  ::testing::Test::RecordProperty("near_tie", what + " token " + std::to_string(i));
  return 1;
}

TEST_P(CudaModel, GreedyContinuationsMatchCpu) {
  const FixtureData f = load(GetParam());
  auto cpu = open_engine(f.dir, "cpu", "auto"), gpu = open_engine(f.dir, kGpu, "auto");
  int ties = 0;
  for (size_t i = 0; i < f.prompts.size(); ++i)
    ties += expect_same_greedy(*cpu, *gpu, f.prompts[i], 16, f.name + " prompt " + std::to_string(i));
  std::printf("[ cuda-model ] %-13s greedy 16 tokens x %zu prompts: %d near-tie flips\n", f.name.c_str(),
              f.prompts.size(), ties);
}

// ---------------------------------------------------------------- decode vs prefill

// prompt_logits one token per step (the decode path: KV pages, decode attention, GEMV) and in
// chunks of 7 against the whole prompt in one step: the same rows within the bf16 tolerance, the
// last prompt token's row included. Bit-exactness is reported, not required.
TEST_P(CudaModel, DecodeThroughPagedCacheEqualsPrefill) {
  const FixtureData f = load(GetParam());
  auto gpu = open_engine(f.dir, kGpu, "auto");
  const int64_t V = gpu->info().vocab_size;
  for (size_t i = 0; i < f.prompts.size(); ++i) {
    const auto whole = gpu->prompt_logits(f.prompts[i], 0);
    for (int chunk : {1, 7}) {
      const auto stepped = gpu->prompt_logits(f.prompts[i], chunk);
      const LogitErr e = logit_error(whole, stepped), last = logit_error(last_row(whole, V), last_row(stepped, V));
      EXPECT_EQ(e.nonfinite, 0u);
      EXPECT_LE(e.rel, kLogitTol) << "prompt " << i << " chunk " << chunk;
      EXPECT_LE(last.rel, kLogitTol) << "prompt " << i << " chunk " << chunk << ": the last prompt token";
      std::printf("[ cuda-model ] %-13s prompt %zu (%zu tokens) chunk %d vs whole: max|diff|/range %.2e, last row %.2e%s\n",
                  f.name.c_str(), i, f.prompts[i].size(), chunk, e.rel, last.rel, e.bit_exact ? " (bit-exact)" : "");
    }
  }
}

// ---------------------------------------------------------------- serving batch

struct Outcome {
  std::vector<int32_t> tokens;
  std::string finish;
};

// Every request on one core at once (added together, stepped until all are done); as
// tests/test_serving.cpp runs them.
std::vector<Outcome> run_together(mb::EngineCore& core, const std::vector<std::vector<int32_t>>& prompts,
                                  const std::vector<mb::GenerationOptions>& opts) {
  std::vector<std::shared_ptr<mb::RequestStream>> streams;
  for (size_t i = 0; i < prompts.size(); ++i) {
    core.validate(prompts[i], opts[i]);
    std::string id = "r";
    id += std::to_string(i);
    streams.push_back(std::make_shared<mb::RequestStream>(id, opts[i].n));
    core.add(streams.back(), {prompts[i], opts[i]});
  }
  std::vector<Outcome> out(prompts.size());
  auto drain = [&] {
    for (size_t i = 0; i < streams.size(); ++i)
      while (auto e = streams[i]->next(std::chrono::milliseconds(0))) {
        for (const auto& g : e->tokens)
          if (e->index == 0) out[i].tokens.push_back(g.token);
        if (!e->finish_reason.empty() && e->index == 0) out[i].finish = e->finish_reason;
        EXPECT_NE(e->finish_reason, "error") << e->error;
      }
  };
  for (int guard = 0; core.has_work(); ++guard) {
    EXPECT_LT(guard, 100000) << "the engine does not finish";
    if (guard >= 100000) break;
    core.step();
    drain();
  }
  drain();
  return out;
}

std::vector<int32_t> prompt_of(int len, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back(int32_t(2 + (i * 37 + salt * 101) % 500));
  return p;
}

// Six requests of mixed lengths (greedy and seeded sampling) through one serving core with 4
// slots (some wait), prompts cut into chunks that share steps with decodes, pages of 16: each
// gets the tokens it gets alone on a core of one slot.
TEST_P(CudaModel, BatchedRequestsEqualEachAlone) {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<mb::GenerationOptions> opts;
  const int lens[] = {3, 40, 17, 70, 9, 25};
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(prompt_of(lens[i], i));
    mb::GenerationOptions o;
    o.max_tokens = 12;
    o.ignore_eos = true;
    if (i % 2) {
      o.temperature = 0.9f;
      o.top_k = 40;
      o.top_p = 0.95f;
      o.seed = 100 + uint64_t(i);
    }
    opts.push_back(o);
  }
  mb::EngineOptions eo;
  eo.model_path = mbtest::fixture(GetParam());
  eo.device = kGpu;
  eo.max_seqs = 4;
  eo.max_context = 256;
  eo.page_tokens = 16;
  eo.step_tokens = 24;
  mb::EngineCore core(eo);
  const auto together = run_together(core, prompts, opts);
  mb::EngineOptions ao = eo;
  ao.max_seqs = 1;
  ao.prefix_cache = false;
  mb::EngineCore alone(ao);
  int same = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Outcome one = run_together(alone, {prompts[i]}, {opts[i]})[0];
    EXPECT_EQ(together[i].tokens, one.tokens) << "request " << i << (i % 2 ? " (sampled)" : " (greedy)");
    EXPECT_EQ(together[i].tokens.size(), 12u);
    same += together[i].tokens == one.tokens;
  }
  std::printf("[ cuda-model ] %-13s 6 requests batched (4 slots, 24-token steps, 16-token pages): %d/6 equal alone\n",
              GetParam().c_str(), same);
}

// ---------------------------------------------------------------- recorded steps

// A decode of 32 tokens run twice on one engine: the second run replays the recordings of the
// first (same pages, same shapes), and must give its tokens. Then, below the engine, the model on
// the CUDA backend (decode steps recorded and replayed) against the same model on a wrapper that
// cannot record (every op issued): the same tokens, and logits within 1e-3 of the range.
TEST_P(CudaModel, RecordedDecodeStepsGiveTheUnrecordedResults) {
  const FixtureData f = load(GetParam());
  const std::vector<int32_t>& prompt = f.prompts[1];
  {
    auto gpu = open_engine(f.dir, kGpu, "auto");
    markbase::Request req;
    req.prompt_tokens = prompt;
    req.max_new_tokens = 32;
    req.stop_at_eos = false;
    const auto first = gpu->generate(req).tokens, second = gpu->generate(req).tokens;
    EXPECT_EQ(first, second) << "a repeated 32-token decode on one engine";
    // The backend's switch for recorded steps (docs/cuda.md), read when an engine's backend is made.
    std::unique_ptr<markbase::Engine> plain_engine;
    {
      mbtest::ScopedEnv graphs_off("MARKBASE_CUDA_GRAPHS", "0");
      plain_engine = open_engine(f.dir, kGpu, "auto");
    }
    EXPECT_EQ(first, plain_engine->generate(req).tokens) << "with MARKBASE_CUDA_GRAPHS=0 (every op issued)";
  }

  auto be = mb::make_backend(kGpu);
#ifndef MB_CUDA_TEST_SELF_CHECK
  ASSERT_TRUE(be->can_record_steps()) << "the CUDA backend should record decode steps";
#endif
  mb::ProfilingBackend plain(*be);  // forwards every op; cannot record
  ASSERT_FALSE(plain.can_record_steps());
  std::shared_ptr<const mb::Checkpoint> ck(mb::open_checkpoint(f.dir));
  auto recorded = mb::load_model(ck, *be, {});
  auto issued = mb::load_model(ck, plain, {});
  const mb::ModelConfig& cfg = recorded->config();
  const int64_t V = cfg.vocab_size;
  mb::KVCache kv_rec(cfg, *be, {1, 256, mb::kMaxStepTokens}), kv_plain(cfg, plain, {1, 256, mb::kMaxStepTokens});

  struct Run {
    std::vector<int32_t> tokens;
    std::vector<float> logits;  // every step's row
  };
  auto decode = [&](mb::Model& m, mb::KVCache& kv) {
    Run r;
    mb::Batch b;
    b.tokens = prompt;
    for (size_t i = 0; i < prompt.size(); ++i) b.positions.push_back(int32_t(i));
    b.seqs.push_back({0, 0, int64_t(prompt.size())});
    b.logit_rows.push_back(int32_t(prompt.size() - 1));
    std::vector<float> logits;
    m.forward(b, kv, logits);
    for (int step = 0; step < 32; ++step) {
      r.logits.insert(r.logits.end(), logits.begin(), logits.end());
      const int32_t next = argmax(logits.data(), V);
      r.tokens.push_back(next);
      mb::Batch d;
      d.tokens = {next};
      d.positions = {int32_t(prompt.size()) + step};
      d.seqs.push_back({0, 0, 1});
      d.logit_rows.push_back(0);
      m.forward(d, kv, logits);
    }
    return r;
  };
  const Run a = decode(*recorded, kv_rec);  // step 1 recorded, the rest replayed
  const Run b = decode(*recorded, kv_rec);  // every step replayed (same KV stores, same shapes)
  const Run c = decode(*issued, kv_plain);  // nothing recorded
  EXPECT_EQ(a.tokens, b.tokens) << "replaying the recordings of the first run";
  EXPECT_EQ(a.tokens, c.tokens) << "recorded against issued op by op";
  const LogitErr ab = logit_error(a.logits, b.logits), ac = logit_error(c.logits, a.logits);
  EXPECT_TRUE(ab.bit_exact) << "a replay differs from the run that recorded it: max |diff| " << ab.max_abs;
  EXPECT_EQ(ac.nonfinite, 0u);
  EXPECT_LE(ac.rel, 1e-3) << "recorded vs issued";
  std::printf("[ cuda-model ] %-13s 32 decode steps: replay vs first run %s; recorded vs op-by-op max|diff|/range %.2e%s\n",
              f.name.c_str(), ab.bit_exact ? "bit-exact" : "DIFFERENT", ac.rel, ac.bit_exact ? " (bit-exact)" : "");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaModel,
                         ::testing::Values("dense_kv", "dense_kv_bf16", "e2b_like", "moe_like", "unified_like",
                                           "gemma3_like"));

// ---------------------------------------------------------------- the real Gemma 3 270M

// Against transformers' reference on the GPL-3 chunks (tests/test_real_model.cpp's numbers; the
// CPU's int8 path holds perplexity within 0.45%): perplexity and top-1 agreement; greedy 16
// tokens against the CPU's f32-activation path with near-ties reported.
TEST(CudaRealModel, Gemma3_270mPerplexityTop1AndGreedy) {
  MB_SKIP_WITHOUT_CUDA();
  const std::string path = mbtest::gemma3_gguf_path();
  if (path.empty()) GTEST_SKIP() << "Gemma 3 270M GGUF not installed (tools/install_model.sh; or MARKBASE_GEMMA3_GGUF)";
  const auto ref = mbtest::read_json(mbtest::fixture("gemma3_270m/reference.json"));
  auto gpu = open_engine(path, kGpu, "auto", 2048);
  const int64_t V = gpu->info().vocab_size;
  ASSERT_EQ(V, ref["vocab_size"].get<int64_t>());
  double nll = 0;
  int64_t count = 0, agree = 0, total = 0;
  for (size_t c = 0; c < ref["chunks"].size(); ++c) {
    const auto toks = ref["chunks"][c].get<std::vector<int32_t>>();
    const auto logits = gpu->prompt_logits(toks);
    ASSERT_EQ(logits.size(), toks.size() * size_t(V));
    for (size_t i = 0; i < toks.size(); ++i) {
      const float* row = logits.data() + i * size_t(V);
      for (int64_t j = 0; j < V; ++j) ASSERT_TRUE(std::isfinite(row[j])) << "chunk " << c << " pos " << i;
      agree += argmax(row, V) == ref["argmax"][c][i].get<int32_t>();
      ++total;
      if (i + 1 < toks.size()) {
        const float mx = *std::max_element(row, row + V);
        double z = 0;
        for (int64_t j = 0; j < V; ++j) z += std::exp(double(row[j] - mx));
        nll += -(double(row[toks[i + 1]] - mx) - std::log(z));
        ++count;
      }
    }
  }
  const double ppl = std::exp(nll / double(count)), ref_ppl = ref["perplexity"].get<double>();
  const double top1 = double(agree) / double(total);
  std::printf("[ cuda-model ] Gemma 3 270M Q4_K_M on CUDA: perplexity %.4f (transformers %.4f, %+.3f%%), top-1 %.2f%% "
              "over %lld positions\n",
              ppl, ref_ppl, 100 * (ppl / ref_ppl - 1), 100 * top1, static_cast<long long>(total));
  EXPECT_LT(std::fabs(ppl / ref_ppl - 1), 0.01);
  EXPECT_GE(top1, 0.95);

  auto cpu = open_engine(path, "cpu", "f32", 2048);
  const auto chunk0 = ref["chunks"][0].get<std::vector<int32_t>>();
  int ties = 0;
  for (size_t len : {size_t(8), size_t(64), size_t(300)})
    ties += expect_same_greedy(*cpu, *gpu, std::vector<int32_t>(chunk0.begin(), chunk0.begin() + std::ptrdiff_t(len)),
                               16, "gemma3-270m prompt of " + std::to_string(len));
  std::printf("[ cuda-model ] Gemma 3 270M greedy 16 tokens x 3 prompts: %d near-tie flips\n", ties);
}

}  // namespace

// Images and audio on the GPU: the same encoders through the CUDA backend's ops (bf16 activations
// in its matmuls), and prompts with media against the CPU, bidirectional image blocks included.
namespace {

double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0, lo = 0, hi = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, double(std::fabs(got[i] - want[i])));
    lo = std::min(lo, double(want[i]));
    hi = std::max(hi, double(want[i]));
  }
  return worst / std::max(hi - lo, 1e-6);
}

TEST(CudaMedia, PromptsWithImagesAndAudioMatchCpu) {
  MB_SKIP_WITHOUT_CUDA();
  // E2B-like: causal image tokens, audio; 12B-unified-like: image blocks bidirectional on every layer.
  for (const char* name : {"mm_e2b_like", "mm_unified_like"}) {
    const std::string dir = mbtest::fixture(name);
    const auto ref = mbtest::read_json(dir + "/reference.json");
    auto cpu = markbase::Engine::open({.model_path = dir});
    auto gpu = markbase::Engine::open({.model_path = dir, .device = kGpu});
    for (const auto& p : ref["prompts"]) {
      std::vector<markbase::Media> media;
      for (int i : p["images"].get<std::vector<int>>())
        media.push_back({markbase::Media::Kind::Image, dir + "/" + ref["images"][size_t(i)]["file"].get<std::string>(), {}, {}});
      for (int i : p["audios"].get<std::vector<int>>())
        media.push_back({markbase::Media::Kind::Audio, dir + "/" + ref["audios"][size_t(i)]["file"].get<std::string>(), {}, {}});
      const auto tokens = p["tokens"].get<std::vector<int32_t>>();
      const auto c = cpu->prompt_logits(tokens, 0, media), g = gpu->prompt_logits(tokens, 0, media);
      ASSERT_EQ(c.size(), g.size());
      for (float v : g) ASSERT_FALSE(std::isnan(v));
      const double rel = relative_error(g, c);
      std::printf("[ cuda-model ] %s %s: media prompt logits max|CUDA - CPU| / range = %.3g\n", name,
                  p["logits_file"].get<std::string>().c_str(), rel);
      EXPECT_LT(rel, kLogitTol) << name << " " << p["logits_file"];
    }
    // A video given as a folder of frames (no libavformat needed): the frames go through the vision tower
    // in one batch, each its own block.
    const auto vref = mbtest::read_json(dir + "/video_reference.json");
    for (const auto& p : vref["prompts"]) {
      const std::string file = vref["videos"][p["video"].get<size_t>()]["file"].get<std::string>();
      if (file != "frames") continue;
      const std::vector<markbase::Media> media = {
          {markbase::Media::Kind::Video, mbtest::fixture("videos") + "/" + file, {}, {}}};
      const auto tokens = p["tokens"].get<std::vector<int32_t>>();
      const auto c = cpu->prompt_logits(tokens, 0, media), g = gpu->prompt_logits(tokens, 0, media);
      ASSERT_EQ(c.size(), g.size());
      for (float v : g) ASSERT_FALSE(std::isnan(v));
      const double rel = relative_error(g, c);
      std::printf("[ cuda-model ] %s video %s: prompt logits max|CUDA - CPU| / range = %.3g\n", name, file.c_str(), rel);
      EXPECT_LT(rel, kLogitTol) << name << " video " << file;
    }
  }
}

}  // namespace
