// What docs/architecture.md says is bit for bit, tested bit for bit, on every SIMD kernel table
// this machine runs (tests/test_kernels.cpp switches tables the same way):
//  - matmul (f32/bf16/f16 weights: one fma chain over k; block-quantized weights on the integer
//    path: one int32 chain per block, qmatmul_ref's order, AMX-INT8 included) and attention (a row
//    depends only on its own keys; decode's key splits fold in key order) do not depend on the
//    batch or the thread count, so
//    * decode (`logits --chunk 1`, prompt_logits(tokens, 1)) gives prefill's bits (chunk 0), and
//      so does any chunk size in between;
//    * a sequence in a ragged batch gets the bits it gets alone;
//    * a token's logits are the same on 1, 2, 3 or many threads.
//  - The exception the docs state: bf16 weights times 9+ tokens run on AMX-BF16 tiles where the
//    CPU has them, "as accurate as the fma chain but not its bits"; their result still does not
//    depend on the batch (of 9+ tokens) or the thread count. Where that path is active, prefill
//    is held to the fma chain within kNear and everything else stays bit for bit.
// No bit claim is made for the scalar table (its dot is a plain loop, not the fma chain) or for the
// f32-activation path of block-quantized weights (decode's fused dequantize-dot and prefill's GEMM
// over dequantized panels sum in different orders): those are held to kNear.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/cpu_kernels.h"
#include "backends/cpu/qmatmul.h"
#include "core/thread_pool.h"
#include "models/checkpoint.h"
#include "markbase/markbase.h"
#include "models/model.h"
#include "runtime/kv_cache.h"
#include "test_util.h"

namespace {

using mb::cpu::Isa;

// Paths without a bit claim differ by f32 rounding, which grows over the 150-token prompt's layers
// and positions: up to 4e-4 measured (the f32-activation q4_0 path on AVX2, e2b_like).
constexpr double kNear = 1e-3;

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

std::vector<Isa> tables() { return mbtest::kernel_tables(); }

// One kernel table, the AMX-BF16 switch and the thread count for a scope; the previous ones after.
struct Setting {
  Isa prev_isa;
  bool prev_amx;
  explicit Setting(Isa isa, bool amx_bf16 = true)
      : prev_isa(mb::cpu::set_isa(isa)), prev_amx(mb::cpu::set_amx_bf16_matmul(amx_bf16)) {}
  ~Setting() {
    mb::cpu::set_isa(prev_isa);
    mb::cpu::set_amx_bf16_matmul(prev_amx);
    mb::ThreadPool::set_global_threads(0);
  }
};

std::string label(Isa isa, const std::string& fixture, const std::string& dtype) {
  return std::string(mb::cpu::isa_name(isa)) + " " + fixture + " --dtype " + dtype +
         (mb::cpu::amx_bf16_matmul_active() ? " (AMX-BF16 on)" : "") +
         (mb::cpu::qmatmul_kernel() && !mb::cpu::quant_matmul_exact() ? " (integer matmuls)" : "");
}

// "" when a and b hold the same bits; else where and by how much they differ.
std::string difference(const std::vector<float>& a, const std::vector<float>& b, int64_t row_len) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  if (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0) return "";
  size_t first = a.size(), count = 0;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], 4) != 0) {
      first = std::min(first, i);
      ++count;
      worst = std::max(worst, std::fabs(double(a[i]) - double(b[i])));
    }
  return std::to_string(count) + " of " + std::to_string(a.size()) + " values differ, the first at row " +
         std::to_string(int64_t(first) / row_len) + " (" + std::to_string(a[first]) + " vs " +
         std::to_string(b[first]) + "), max |difference| " + std::to_string(worst);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = a.size() == b.size() ? 0 : INFINITY;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  return m;
}

// The fixture's three reference prompts (5, 32 and 20 tokens) and one of 150 seeded ids: past two
// of decode's 64-key splits (kAttnSplit) and many sliding windows.
std::vector<std::vector<int32_t>> prompts_of(const std::string& fixture, int64_t vocab) {
  std::vector<std::vector<int32_t>> v;
  const auto ref = mbtest::read_json(mbtest::fixture(fixture) + "/reference.json");
  for (auto& p : ref["prompts"]) v.push_back(p["tokens"].get<std::vector<int32_t>>());
  std::mt19937 rng(20);
  std::vector<int32_t> longer = {2};
  while (longer.size() < 150) longer.push_back(int32_t(3 + rng() % uint32_t(vocab - 3)));
  v.push_back(longer);
  return v;
}

struct Case {
  std::string fixture, dtype;
  bool bf16_weights;  // matrices the AMX-BF16 path would take
  // With integer matmuls after them: the AMX-BF16 rows' last-bit differences move the 8-bit
  // rounding of the activations that follow, so decode and prefill are compared with AMX-BF16 off
  // only (the AMX-BF16 exception itself is held by the cases with bf16 weights alone).
  bool int8_downstream = false;
};

// Under the sanitizers (slow, and there to catch memory errors, not to recheck bits the Release
// run checks) a subset: every fixture as stored, and e2b_like in every dtype.
bool in_sanitized_subset(const Case& c) { return c.dtype == "auto" || c.fixture == "e2b_like"; }

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const char* f : {"e2b_like", "moe_like", "dense_kv", "dense_kv_bf16", "unified_like", "gemma3_like"}) {
    v.push_back({f, "auto", std::string(f) == "dense_kv_bf16"});
    // Block-quantized: the integer path where the table has a kernel, the f32-activation one on
    // the scalar table. dense_kv_bf16's rows of 48 are not whole blocks: those stay bf16.
    const bool bf16_rows = std::string(f) == "dense_kv_bf16";
    v.push_back({f, "q8_0", bf16_rows, bf16_rows});
    v.push_back({f, "q4_0", bf16_rows, bf16_rows});
  }
  v.push_back({"e2b_like", "bf16", true});
  v.push_back({"moe_like", "bf16", true});
  return v;
}

std::unique_ptr<markbase::Engine> open(const Case& c, int threads = 0) {
  markbase::EngineOptions o;
  o.model_path = mbtest::fixture(c.fixture);
  o.dtype = c.dtype;
  o.threads = threads;
  return markbase::Engine::open(o);
}

// The rows [r0, r1) of logits with `V` columns.
std::vector<float> rows(const std::vector<float>& logits, int64_t V, int64_t r0, int64_t r1) {
  return {logits.begin() + r0 * V, logits.begin() + r1 * V};
}

// Decode, chunks of 3 and 16 tokens, and prefill give the same bits. With `amx` (bf16 weights and
// the AMX-BF16 path active) a chunk of 9+ tokens runs on AMX tiles: such rows equal prefill's
// AMX rows bit for bit, and rows of shorter chunks (the fma chain) are held to them within kNear.
void expect_decode_equals_prefill(markbase::Engine& engine, const std::vector<int32_t>& tokens, bool amx,
                                  const std::string& what) {
  SCOPED_TRACE(what + ", " + std::to_string(tokens.size()) + " tokens");
  const int64_t V = engine.info().vocab_size, n = int64_t(tokens.size());
  const auto prefill = engine.prompt_logits(tokens, 0), decode = engine.prompt_logits(tokens, 1);
  const auto by3 = engine.prompt_logits(tokens, 3), by16 = engine.prompt_logits(tokens, 16);
  if (mb::cpu::kernels().isa == Isa::Scalar) {
    EXPECT_LE(max_abs_diff(decode, prefill), kNear);
    EXPECT_LE(max_abs_diff(by3, prefill), kNear);
    EXPECT_LE(max_abs_diff(by16, prefill), kNear);
    return;
  }
  // Chunks below kAmxMinTokens run the GEMV, the fma chain, on every table.
  EXPECT_EQ(difference(by3, decode, V), "") << "chunks of 3 against decode";
  const bool amx_prefill = amx && n >= mb::cpu::kAmxMinTokens;
  if (!amx_prefill) {
    EXPECT_EQ(difference(decode, prefill, V), "") << "decode against prefill";
  } else {
    EXPECT_LE(max_abs_diff(decode, prefill), kNear) << "the fma chain against AMX-BF16 prefill";
  }
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    const int64_t r1 = std::min(n, r0 + 16);
    const auto a = rows(by16, V, r0, r1), b = rows(prefill, V, r0, r1);
    if (amx_prefill != (amx && r1 - r0 >= mb::cpu::kAmxMinTokens)) {
      EXPECT_LE(max_abs_diff(a, b), kNear) << "rows " << r0 << ".." << r1 << ": the fma chain against AMX-BF16";
    } else {
      EXPECT_EQ(difference(a, b, V), "") << "chunk of rows " << r0 << ".." << r1 << " against prefill";
    }
  }
}

TEST(BitExact, DecodeEqualsPrefillOnEveryFixtureTableAndDtype) {
  for (Isa isa : tables()) {
    for (const Case& c : cases()) {
      if (kSanitized && !in_sanitized_subset(c)) continue;
      Setting s(isa, /*amx_bf16=*/!c.int8_downstream);
      auto engine = open(c);
      const bool amx = c.bf16_weights && mb::cpu::amx_bf16_matmul_active();
      for (const auto& p : prompts_of(c.fixture, engine->info().vocab_size))
        expect_decode_equals_prefill(*engine, p, amx, label(isa, c.fixture, c.dtype));
      if (amx) {
        // With the AMX-BF16 path off, bf16 weights run the fma chain everywhere: bits again.
        mb::cpu::set_amx_bf16_matmul(false);
        for (const auto& p : prompts_of(c.fixture, engine->info().vocab_size))
          expect_decode_equals_prefill(*engine, p, false, label(isa, c.fixture, c.dtype));
      }
    }
  }
}

// The f32-activation path for block-quantized weights (MARKBASE_QUANT_MATMUL=exact) computes with
// the dequantized weights' numbers, without a bit claim between decode and prefill.
TEST(BitExact, ExactQuantPathDecodeStaysNearPrefill) {
  struct Exact {
    bool prev = mb::cpu::set_quant_matmul_exact(true);
    ~Exact() { mb::cpu::set_quant_matmul_exact(prev); }
  } exact;
  for (Isa isa : tables()) {
    Setting s(isa);
    for (const char* f : {"e2b_like", "moe_like"}) {
      auto engine = open({f, "q4_0", false});
      for (const auto& p : prompts_of(f, engine->info().vocab_size)) {
        SCOPED_TRACE(label(isa, f, "q4_0") + " " + std::to_string(p.size()) + " tokens");
        EXPECT_LE(max_abs_diff(engine->prompt_logits(p, 1), engine->prompt_logits(p, 0)), kNear);
      }
    }
  }
}

// One token's logits (every position of a prefill, and of decode) on 1, 2, 3 and 16 threads.
TEST(BitExact, LogitsDoNotDependOnTheThreadCount) {
  for (Isa isa : tables()) {
    if (isa == Isa::Scalar) continue;
    for (const Case& c : cases()) {
      if (c.dtype == "q4_0" && c.fixture != "e2b_like") continue;  // q8_0 covers the integer path
      const bool one_per_path = (c.dtype == "auto" && (c.fixture == "e2b_like" || c.bf16_weights)) ||
                                (c.dtype == "q8_0" && c.fixture == "moe_like");
      if (kSanitized && !one_per_path) continue;  // under the sanitizers: f32, bf16 and integer matmuls
      Setting s(isa);
      const auto tokens = prompts_of(c.fixture, 512).back();
      std::vector<float> prefill1, decode1;
      for (int threads : {1, 2, 3, 16}) {
        auto engine = open(c, threads);
        ASSERT_EQ(mb::ThreadPool::global().size(), threads);
        const std::string what = label(isa, c.fixture, c.dtype) + ", " + std::to_string(threads) + " threads";
        auto prefill = engine->prompt_logits(tokens, 0), decode = engine->prompt_logits(tokens, 1);
        if (threads == 1) {
          prefill1 = prefill;
          decode1 = decode;
          continue;
        }
        EXPECT_EQ(difference(prefill, prefill1, 512), "") << what << ": prefill against 1 thread";
        EXPECT_EQ(difference(decode, decode1, 512), "") << what << ": decode against 1 thread";
      }
    }
  }
}

// Several sequences in one forward call (batched decode, continuous batching) give each sequence
// the bits it gets alone, through the same steps: a prefill, then one decode token.
TEST(BitExact, RaggedBatchEqualsSequencesRunAlone) {
  const std::vector<std::vector<int32_t>> prompts = {
      {2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50}, {2, 7}, {2, 300, 301, 302, 303, 304}};
  const std::vector<Case> batch_cases = {{"e2b_like", "auto", false}, {"moe_like", "auto", false},
                                         {"dense_kv_bf16", "auto", true}, {"unified_like", "q8_0", false},
                                         {"gemma3_like", "q4_0", false}, {"moe_like", "q8_0", false}};
  for (Isa isa : tables()) {
    for (const Case& c : batch_cases) {
      Setting s(isa);
      std::shared_ptr<mb::Checkpoint> ck = mb::open_checkpoint(mbtest::fixture(c.fixture));
      auto be = mb::make_cpu_backend();
      mb::ModelLoadOptions mo;
      if (c.dtype != "auto") {
        mo.keep_checkpoint_dtype = false;
        mo.weight_dtype = *mb::weight_dtype_from_name(c.dtype);
      }
      auto model = mb::load_model(ck, *be, mo);
      const size_t V = size_t(ck->config.vocab_size);
      const std::string what = label(isa, c.fixture, c.dtype);
      // Each sequence alone: its prefill's last row, then one decode step.
      auto alone = [&](int s) {
        const auto& p = prompts[size_t(s)];
        mb::KVCache kv(ck->config, *be, {1, 64, 16});
        mb::Batch b;
        b.tokens = p;
        for (size_t i = 0; i < p.size(); ++i) b.positions.push_back(int32_t(i));
        b.seqs.push_back({0, 0, int64_t(p.size())});
        b.logit_rows.push_back(int32_t(p.size() - 1));
        std::vector<float> first, second;
        model->forward(b, kv, first);
        mb::Batch d;
        d.tokens = {100 + s};
        d.positions = {int32_t(p.size())};
        d.seqs.push_back({0, 0, 1});
        d.logit_rows = {0};
        model->forward(d, kv, second);
        return std::pair(first, second);
      };
      mb::KVCache kv(ck->config, *be, {3, 64, 16});
      mb::Batch b, d;
      for (int s = 0; s < 3; ++s) {
        const auto& p = prompts[size_t(s)];
        b.seqs.push_back({s, int64_t(b.tokens.size()), int64_t(p.size())});
        for (size_t i = 0; i < p.size(); ++i) {
          b.tokens.push_back(p[i]);
          b.positions.push_back(int32_t(i));
        }
        b.logit_rows.push_back(int32_t(b.tokens.size() - 1));
        d.seqs.push_back({s, s, 1});
        d.tokens.push_back(100 + s);
        d.positions.push_back(int32_t(p.size()));
        d.logit_rows.push_back(s);
      }
      std::vector<float> prefill, step;
      model->forward(b, kv, prefill);
      model->forward(d, kv, step);
      ASSERT_EQ(prefill.size(), 3 * V);
      ASSERT_EQ(step.size(), 3 * V);
      for (int s = 0; s < 3; ++s) {
        SCOPED_TRACE(what + ", sequence " + std::to_string(s));
        const auto [first, second] = alone(s);
        const std::vector<float> in_prefill(prefill.begin() + s * int64_t(V), prefill.begin() + (s + 1) * int64_t(V));
        const std::vector<float> in_step(step.begin() + s * int64_t(V), step.begin() + (s + 1) * int64_t(V));
        // The batched prefill has 20 tokens: on AMX-BF16 tiles where that path is active, so a
        // sequence of fewer than 9 tokens, which alone runs the fma chain, is only near.
        const bool near_only = isa == Isa::Scalar || (c.bf16_weights && mb::cpu::amx_bf16_matmul_active() &&
                                                      int64_t(prompts[size_t(s)].size()) < mb::cpu::kAmxMinTokens);
        if (near_only) {
          EXPECT_LE(max_abs_diff(in_prefill, first), kNear);
          EXPECT_LE(max_abs_diff(in_step, second), kNear);
        } else {
          EXPECT_EQ(difference(in_prefill, first, int64_t(V)), "") << "prefill";
          EXPECT_EQ(difference(in_step, second, int64_t(V)), "") << "decode step";
        }
      }
    }
  }
}

// The real Gemma 3 270M Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 matrices) on the integer path: decode
// and prefill give the same bits, on every table with an integer kernel.
TEST(BitExact, RealModelDecodeEqualsPrefill) {
  const std::string path = mbtest::gemma3_gguf_path();
  if (path.empty()) GTEST_SKIP() << "Gemma 3 270M GGUF not installed (run tools/setup.sh)";
  if (kSanitized) GTEST_SKIP() << "too slow under AddressSanitizer; the Release run covers it";
  auto ref = mbtest::read_json(mbtest::fixture("gemma3_270m/reference.json"));
  auto chunk = ref["chunks"][0].get<std::vector<int32_t>>();
  chunk.resize(80);
  int ran = 0;
  for (Isa isa : tables()) {
    Setting s(isa);
    if (!mb::cpu::qmatmul_kernel()) continue;
    ++ran;
    markbase::EngineOptions o;
    o.model_path = path;
    auto engine = markbase::Engine::open(o);
    const std::string what = label(isa, "gemma-3-270m-q4_k_m.gguf", "auto");
    const int64_t V = engine->info().vocab_size;
    const auto prefill = engine->prompt_logits(chunk, 0);
    EXPECT_EQ(difference(engine->prompt_logits(chunk, 1), prefill, V), "") << what << ": decode";
    EXPECT_EQ(difference(engine->prompt_logits(chunk, 7), prefill, V), "") << what << ": chunks of 7";
  }
  if (ran == 0) GTEST_SKIP() << "no integer kernel (AVX-512 VNNI or AVX2) on this CPU";
}

}  // namespace
